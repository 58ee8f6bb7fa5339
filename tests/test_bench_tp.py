"""The tensor-parallel benchmark's pure parts on CPU: options, the chunk decomposition
(checked by running the chunked layer with emulated collectives on CPU tensors against the
unsplit computation), the schedule list, the bit-for-bit checker (shown to fail on a
planted fault), the speedups and ratios, and the table.  The GPU run is
``bash tools/gpu_run.sh tp``."""

import pytest

torch = pytest.importorskip("torch")

from hoccl.bench import tp  # noqa: E402
from hoccl.bench.tp import (ASYNC_TP, COMPUTE, Layout, Schedule, arguments,  # noqa: E402
                            count_mismatches, schedules, summary)


def test_full_and_quick_runs_take_their_own_shapes_and_keep_explicit_options():
    full, quick = arguments([]), arguments(["--quick"])
    assert (full.tokens, full.hidden, full.ffn, full.rounds) == (8192, 8192, 28672, 3)
    assert (quick.tokens, quick.rounds, quick.chunks) == (2048, 1, "2")
    assert arguments(["--quick", "--tokens", "4096"]).tokens == 4096


def test_the_parser_refuses_other_dtypes_and_empty_shapes():
    with pytest.raises(SystemExit):
        arguments(["--dtype", "float32"])
    with pytest.raises(SystemExit):
        arguments(["--hidden", "0"])


def test_layout_arithmetic_of_the_default_shape():
    layout = Layout(8192, 8192, 28672, 2, 4)
    assert (layout.rows_per_rank, layout.rows, layout.ffn_shard) == (4096, 1024, 14336)
    assert layout.flops == 2 * 2 * 8192 * 8192 * 14336
    # rank 1's part of chunk 2 starts at its own token 2048
    assert layout.token(2, 1, 0) == 4096 + 2048


@pytest.mark.parametrize("fields, words", [((8192, 8192, 28672, 2, 3), "tokens"),
                                           ((8192, 8192, 28673, 2, 1), "ffn"),
                                           ((8192, 8192, 28672, 0, 1), "world_size")])
def test_a_layout_that_does_not_divide_says_what(fields, words):
    with pytest.raises(ValueError, match=words):
        Layout(*fields)


def _address(tensor):
    return tensor.data_ptr()


@pytest.mark.parametrize("world_size, chunks", [(2, 1), (2, 2), (2, 4), (4, 2)])
def test_the_chunked_layer_with_emulated_collectives_equals_the_unsplit_layer(world_size, chunks):
    """Each rank's buffers as the benchmark lays them out; the all_gather and the
    reduce_scatter emulated by copies between the ranks' views; every rank's output in
    token order must equal its rows of sum_r (X_full @ W1_r) @ W2_r."""
    tokens, hidden, ffn = 48 * world_size, 8, 6 * world_size
    layout = Layout(tokens, hidden, ffn, world_size, chunks)
    generator = torch.Generator().manual_seed(7)
    xs = [torch.randn(layout.rows_per_rank, hidden, generator=generator, dtype=torch.float64)
          for _ in range(world_size)]
    w1s = [torch.randn(hidden, layout.ffn_shard, generator=generator, dtype=torch.float64)
           for _ in range(world_size)]
    w2s = [torch.randn(layout.ffn_shard, hidden, generator=generator, dtype=torch.float64)
           for _ in range(world_size)]
    buffers = [tuple(torch.full((size,), float("nan"), dtype=torch.float64)
                     for size in (tokens * hidden, tokens * layout.ffn_shard, tokens * hidden))
               for _ in range(world_size)]
    views = [layout.views(*buffers[rank], rank) for rank in range(world_size)]
    for rank in range(world_size):
        layout.place_input(buffers[rank][0], xs[rank], rank)
    for chunk in range(chunks):
        for rank in range(world_size):
            mine = views[rank][chunk]
            # in place: the send block is the rank's own block of the receive buffer
            item = mine.own.element_size()
            assert _address(mine.own) == _address(mine.gathered) + rank * mine.own.numel() * item
            assert _address(mine.result) == (_address(mine.partial_flat)
                                             + rank * mine.result.numel() * item)
            for peer in range(world_size):  # all_gather
                block = views[rank][chunk].gathered.view(world_size, -1)
                block[peer].copy_(views[peer][chunk].own)
        for rank in range(world_size):
            mine = views[rank][chunk]
            torch.mm(mine.activations, w1s[rank], out=mine.hidden)
            torch.mm(mine.hidden, w2s[rank], out=mine.partial)
        sums = [sum(views[peer][chunk].partial_flat.view(world_size, -1)[rank]
                    for peer in range(world_size)) for rank in range(world_size)]
        for rank in range(world_size):  # reduce_scatter
            views[rank][chunk].result.copy_(sums[rank])
    for rank in range(world_size):
        want = sum(xs[rank] @ w1s[peer] @ w2s[peer] for peer in range(world_size))
        got = layout.output(buffers[rank][2], rank)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-10), (rank, (got - want).abs().max())


def test_a_rank_rows_in_a_chunk_are_the_tokens_token_maps_them_to():
    layout = Layout(16, 2, 4, 2, 2)
    gather = torch.zeros(16 * 2)
    tokens = torch.arange(16, dtype=torch.float32)
    for rank in range(2):
        mine = tokens[rank * 8:(rank + 1) * 8].repeat_interleave(2).view(8, 2)
        layout.place_input(gather, mine, rank)
    blocks = layout.blocks(gather, 2)
    for chunk in range(2):
        for rank in range(2):
            for row in range(layout.rows):
                assert blocks[chunk, rank, row, 0] == layout.token(chunk, rank, row)


def test_schedules_bring_nccls_sequence_with_async_tp_and_the_matmuls_alone():
    found = schedules(["hoccl", ASYNC_TP], [2, 4])
    assert found == [Schedule("hoccl", 1, False), Schedule("hoccl", 2, True),
                     Schedule("hoccl", 4, True), Schedule("nccl", 1, False),
                     Schedule(ASYNC_TP, 0, True), Schedule(COMPUTE, 1, False),
                     Schedule(COMPUTE, 2, True), Schedule(COMPUTE, 4, True)]
    assert Schedule(ASYNC_TP, 0, True).baseline == Schedule("nccl", 1, False)
    labels = {schedule.label for schedule in found}
    assert {"sequential", "4 chunks overlapped", "matmuls only, 2 chunks"} <= labels
    with_nccl = schedules(["nccl", ASYNC_TP], [2])
    assert Schedule("nccl", 2, True) in with_nccl and len(with_nccl) == 5


def test_a_schedule_refuses_chunks_that_make_no_sense():
    with pytest.raises(ValueError, match="Schedule"):
        Schedule("hoccl", 0, True)
    with pytest.raises(ValueError, match="Schedule"):
        Schedule(ASYNC_TP, 2, True)
    with pytest.raises(ValueError, match="Schedule"):
        Schedule("nccl", 4, False)


def test_the_checker_counts_a_planted_bit_flip_and_poison_but_not_an_exact_copy():
    want = (torch.arange(64, dtype=torch.float32).view(8, 8) - 20).to(torch.bfloat16)
    assert count_mismatches(want.clone(), want) == 0
    flipped = want.clone()
    flipped.view(torch.int16)[3, 5] ^= 1  # what --plant-fault does
    assert count_mismatches(flipped, want) == 1
    poisoned = want.clone()
    poisoned[0, :4] = float("nan")  # an element the layer never wrote
    assert count_mismatches(poisoned, want) == 4
    zero = torch.zeros(2, dtype=torch.bfloat16)
    assert count_mismatches(-zero, zero) == 2  # -0 is not +0 bit for bit
    with pytest.raises(ValueError, match="shapes"):
        count_mismatches(want, want[:4])


def _records():
    times = {("hoccl", 1, False): 6.0, ("hoccl", 2, True): 5.5, ("hoccl", 4, True): 5.4,
             ("nccl", 1, False): 6.2, ("nccl", 2, True): 5.9, ("nccl", 4, True): None,
             (ASYNC_TP, 0, True): 5.8, (COMPUTE, 1, False): 5.2, (COMPUTE, 2, True): 5.25}
    records = []
    for (library, chunks, overlapped), ms in times.items():
        record = {"library": library, "chunks": chunks, "overlapped": overlapped,
                  "label": Schedule(library, chunks, overlapped).label, "wrong": 0}
        if ms is None:
            record["error"] = "rank 1: RuntimeError: NCCL timeout"
        else:
            record["ms_per_layer"] = ms
            record["tflops"] = 900.0 / ms
        records.append(record)
    return records


def test_speedups_are_over_each_librarys_own_sequence_and_ratios_over_hoccls_best():
    records = _records()
    found = summary(records)
    by_key = {(r["library"], r["chunks"]): r for r in records}
    assert by_key[("hoccl", 4)]["speedup"] == pytest.approx(6.0 / 5.4)
    assert by_key[(ASYNC_TP, 0)]["speedup"] == pytest.approx(6.2 / 5.8)
    assert "speedup" not in by_key[("hoccl", 1)] and "speedup" not in by_key[(COMPUTE, 2)]
    assert found["best"]["hoccl"]["ms_per_layer"] == 5.4
    assert found["best"]["nccl"]["schedule"] == "2 chunks overlapped"
    assert found["time_ratios"]["nccl / hoccl"] == pytest.approx(5.9 / 5.4)
    assert found["time_ratios"][f"{ASYNC_TP} / hoccl"] == pytest.approx(5.8 / 5.4)


def test_the_table_shows_every_schedule_its_errors_and_the_ratios():
    records = _records()
    result = {"shape": {"tokens": 8192, "hidden": 8192, "ffn": 28672}, "dtype": "bfloat16",
              "world_size": 2, "rounds": 3, "iters": 10, "records": records,
              "summary": summary(records)}
    text = tp.table(result)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(records)
    assert "NCCL timeout" in text and "1.111x" in text
    assert "nccl / hoccl 1.093" in text
