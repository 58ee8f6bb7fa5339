"""The one-GPU lever study's pure parts: options, the variant list, the launch plan, the
residency analysis of per-block records, the profiler-trace reader and the tables.  The
GPU part runs on the device machine (``bash tools/gpu_run.sh levers``)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parent.parent / "benchmarks" / "levers.py"
_spec = importlib.util.spec_from_file_location("levers", STUDY)
assert _spec is not None and _spec.loader is not None
levers = importlib.util.module_from_spec(_spec)
sys.modules["levers"] = levers  # dataclasses look their module up by name
_spec.loader.exec_module(levers)
Variant, arguments, pieces = levers.Variant, levers.arguments, levers.pieces
residency, variants = levers.residency, levers.variants

MiB = 1 << 20


def test_full_and_quick_runs_take_their_own_defaults_and_keep_explicit_options():
    full, quick = arguments([]), arguments(["--quick"])
    assert (full.gemms, full.rounds, full.bytes) == (60, 3, "512M")
    assert (quick.gemms, quick.rounds, quick.bytes) == (20, 1, "128M")
    assert len(variants(quick)) < len(variants(full))
    chosen = arguments(["--quick", "--sms", "3,5", "--rounds", "2"])
    assert (chosen.sms, chosen.rounds, chosen.gemms) == ("3,5", 2, 20)


def test_bad_counts_are_refused_by_the_parser():
    with pytest.raises(SystemExit):
        arguments(["--rounds", "0"])


def test_variants_start_with_the_baseline_and_keep_each_setting_once():
    args = arguments(["--sms", "2,4,8,16,32", "--chunks", "8M,32M,whole"])
    found = variants(args)
    assert found[0] == Variant("sms", 8, 32 * MiB)
    settings = [(v.sms, v.chunk_bytes, v.reduce_priority, v.gemm_priority, v.threads, v.unroll,
                 v.green, v.lever == "pipeline", v.fused) for v in found]
    assert len(settings) == len(set(settings))
    assert [v.sms for v in found if v.lever == "sms"] == [8, 2, 4, 16, 32]
    # 32M at 8 SMs is the baseline itself: the launches lever adds only the others
    assert sorted(v.chunk_bytes for v in found if v.lever == "launches") == [0, 8 * MiB]
    levers_in_order = [v.lever for v in found]
    assert levers_in_order == sorted(levers_in_order, key=levers.LEVERS.index)
    greens = {(v.sms, v.green) for v in found if v.lever == "green"}
    assert greens == {(8, "reduce"), (8, "both"), (16, "reduce"), (16, "both")}
    priorities = {(v.reduce_priority, v.gemm_priority) for v in found if v.lever == "priority"}
    assert priorities == {("least", "least"), ("least", "greatest"), ("greatest", "greatest")}
    assert [(v.sms, v.threads) for v in found if v.lever == "block"] == [(32, 256)]


def test_the_adaptive_cap_joins_only_when_the_probe_found_idle_sms_of_a_new_count():
    args = arguments(["--quick"])
    assert not [v for v in variants(args) if v.lever == "adaptive"]
    assert [v.sms for v in variants(args, idle_sms=5) if v.lever == "adaptive"] == [5]
    # a cap the sms lever already measures is not measured twice
    assert not [v for v in variants(args, idle_sms=4) if v.lever == "adaptive"]


def test_the_torch_lever_sums_on_the_whole_gpu_per_chunk_or_per_call():
    args = arguments(["--torch-chunks", "32M,whole"])
    args.sm_count = 132
    found = [v for v in variants(args) if v.lever == "torch"]
    assert [(v.sms, v.chunk_bytes) for v in found] == [(132, 32 * MiB), (132, 0)]
    assert all(v.torch and not v.hoccl_kernel for v in found)
    assert found[0].label.startswith("torch.add, all SMs, 32M chunks")
    assert not [v for v in variants(arguments(["--torch-chunks", ""])) if v.lever == "torch"]
    assert [v.lever for v in variants(arguments(["--quick"]))][-1] == "torch"


def test_a_variant_names_every_field_it_refuses():
    with pytest.raises(ValueError, match="reduce_priority.*green"):
        Variant("sms", 8, 32 * MiB, reduce_priority="highest", green="gemm")
    with pytest.raises(ValueError, match="chunk_bytes"):
        Variant("sms", 8, 100)


def test_only_hoccls_block_shape_outside_green_contexts_runs_through_device_reduce():
    assert Variant("sms", 8, 0).hoccl_kernel
    assert not Variant("block", 32, 0, threads=256).hoccl_kernel
    assert not Variant("green", 8, 0, green="reduce").hoccl_kernel
    assert "1 launch/call" in Variant("launches", 8, 0).label
    assert "32x256 thr" in Variant("block", 32, MiB, threads=256).label


@pytest.mark.parametrize("nbytes, chunk", [(512 * MiB, 32 * MiB), (100 * MiB + 48, 32 * MiB),
                                           (64 * MiB, 0), (96, 32)])
def test_pieces_cover_every_byte_once_in_order(nbytes, chunk):
    plan = pieces(nbytes, chunk, 2)
    covered = 0
    for offset, count in plan:
        assert offset == covered
        covered += 2 * count
    assert covered == nbytes
    assert len(plan) == levers.launches_per_call(nbytes, chunk)


def test_pieces_refuse_a_size_that_is_not_whole_elements():
    with pytest.raises(ValueError, match="multiple of 2"):
        pieces(33, 8, 2)


def _timeline(gemms=10, launches=6, idle=(130, 131)):
    """A dated GEMM loop beside a sum of 8 blocks per launch (times in ns): the blocks on
    the ``idle`` SMs start at once; the others wait for the running GEMM's CTAs to retire
    and start in its tail, and the next GEMM, which starts with them resident, takes
    1400 µs instead of 1000."""
    us = 1000
    markers = [(0, 0, 3 * us)]
    gemm_intervals = [(3 * us, 1003 * us)]
    placed = []

    def next_gemm():
        end = gemm_intervals[-1][1]
        markers.append((0, end, end + 3 * us))
        begin = end + 3 * us
        resident = any(start <= begin < stop for _, start, stop in placed)
        gemm_intervals.append((begin, begin + (1400 if resident else 1000) * us))

    ready = gemm_intervals[0][0] + 100 * us
    found = []
    for _ in range(launches):
        while gemm_intervals[-1][1] <= ready:
            next_gemm()
        running = next(gemm for gemm in gemm_intervals if gemm[0] <= ready < gemm[1])
        blocks = []
        for block in range(8):
            if block < len(idle):
                sm, start = idle[block], ready + (1 + block) * us
            else:
                sm, start = block, running[1] - (5 + block) * us
            blocks.append((sm, start, start + 300 * us))
        placed.extend(blocks)
        found.append(blocks)
        ready = max(stop for _, _, stop in blocks)
    while len(gemm_intervals) < gemms:
        next_gemm()
    end = gemm_intervals[-1][1]
    markers.append((0, end, end + 3 * us))
    return markers, found


def test_residency_finds_the_idle_sms_and_the_waits_for_gemm_boundaries():
    markers, launches = _timeline()
    found = residency(markers, launches)
    assert found["launches"] == 6 and found["blocks"] == 48
    assert found["idle_sms"] == [130, 131]
    assert found["block_starts"] == {"mid_gemm": 12, "gemm_tail_or_boundary": 36, "no_gemm": 0}
    assert found["immediate_blocks_per_launch"] == 2
    # the other 6 blocks of a launch wait for the running GEMM to end: hundreds of µs
    assert found["wait_us"]["max"] > 500
    assert found["gemm_us"]["count"] == 10
    assert found["gemm_us_starting_with_reduction_blocks"]["median"] == pytest.approx(1400)
    assert found["gemm_us_starting_without"]["median"] == pytest.approx(1000)


def test_residency_of_gemms_alone_has_no_waits_and_every_gemm_without_blocks():
    markers, _ = _timeline()
    found = residency(markers, [])
    assert found["blocks"] == 0 and found["wait_us"] == {}
    assert found["immediate_blocks_per_launch"] is None
    assert found["gemm_us_starting_without"]["count"] == 10
    assert found["gemm_us_starting_with_reduction_blocks"] == {}


def test_kernels_are_read_from_a_chrome_trace_relative_to_the_first():
    events = [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 5.0},
        {"cat": "kernel", "name": "sm90_xmma_gemm", "ts": 100.0, "dur": 1450.0,
         "args": {"stream": 7, "grid": [132, 1, 1], "block": [384, 1, 1],
                  "registers per thread": 168, "shared memory": 232448}},
        {"cat": "kernel", "name": "hoccl_reduce_bfloat16_sum", "ts": 180.0, "dur": 140.0,
         "args": {"stream": 9, "grid": [8, 1, 1], "block": [1024, 1, 1],
                  "registers per thread": 52, "shared memory": 0}},
        {"cat": "kernel", "name": "sm90_xmma_gemm", "ts": 1560.0, "dur": 1900.0, "args": {}},
    ]
    kernels = levers.kernels_of(events)
    assert [k["start_us"] for k in kernels] == [0.0, 80.0, 1460.0]
    summary = levers.kernel_summary(kernels)
    gemm = summary["sm90_xmma_gemm"]
    assert gemm["grid"] == [132, 1, 1] and gemm["registers"] == 168
    assert gemm["duration_us"]["count"] == 2 and gemm["duration_us"]["max"] == 1900.0
    assert summary["hoccl_reduce_bfloat16_sum"]["block"] == [1024, 1, 1]


def _result():
    args = arguments(["--quick"])
    records = []
    for index, variant in enumerate(variants(args)):
        record = {**levers.asdict(variant), "label": variant.label,
                  "blocks": f"{variant.sms} x {variant.threads}", "launches_per_call": 4}
        if index == 1:
            record["error"] = "RuntimeError: green contexts of 8 SMs: refused"
        else:
            record.update(gemm_tflops_alone=750.0, gemm_tflops_beside=500.0 + index,
                          slowdown_pct=50.0 - index, reduce_gbps_alone=700.0,
                          reduce_gbps_beside=None if index == 2 else 350.0)
        records.append(record)
    markers, launches = _timeline()
    return {"gemm": 8192, "gpu": "H200", "sm_count": 132, "bytes": 512 * MiB, "rounds": 1,
            "gemm_tflops_alone": 751.0, "records": records,
            "kernel": {"threads": 1024, "registers": 52},
            "probes": {"waits at 8 SMs": residency(markers, launches),
                       "idle": {"error": "DriverError: refused"}},
            "green": {8: {"error": "refused"}}, "timeline": {}}


def test_the_table_has_a_row_per_variant_with_errors_and_missing_figures_shown():
    result = _result()
    text = levers.table(result)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(result["records"])
    assert "refused" in text and "| – |" in text
    assert re.search(r"\| 50\.0 % \|", text)
    text = levers.markdown(result)
    assert "probe waits at 8 SMs: 48 blocks" in text and "probe idle: failed" in text
    assert "need two GPUs" in text


@pytest.mark.skipif(importlib.util.find_spec("cuda") is None, reason="cuda-bindings not installed")
def test_the_study_kernels_compile_with_hoccls_templates():
    """NVRTC compiles without a GPU: the traced sum wraps hoccl's reduce_body unchanged."""
    from hoccl.testing import nvrtc_ptx
    try:
        ptx = nvrtc_ptx(levers.study_source(), levers.study_options(256, 2))
    except (ImportError, OSError) as error:  # no libnvrtc on this machine
        pytest.skip(str(error))
    assert b".entry hoccl_levers_traced_sum" in ptx and b"%globaltimer" in ptx
    assert b".maxntid 256" in ptx


def test_the_pipeline_lever_runs_each_setting_per_chunk_and_in_one_launch():
    found = [v for v in variants(arguments(["--pipeline", "8:32M,16:128M"]))
             if v.lever == "pipeline"]
    assert [(v.sms, v.chunk_bytes, v.fused) for v in found] == [
        (8, 32 * MiB, False), (8, 32 * MiB, True), (16, 128 * MiB, False), (16, 128 * MiB, True)]
    assert "1 launch/call waiting on the device" in found[1].label
    assert "a stream wait + a launch per chunk" in found[0].label
    # the pipeline's unfused row is not the sms lever's row of the same cap and chunk
    assert Variant("sms", 8, 32 * MiB) in variants(arguments(["--pipeline", "8:32M"]))
    with pytest.raises(ValueError, match="pipeline of chunks"):
        Variant("pipeline", 8, 0)
    with pytest.raises(ValueError, match="fused only in the pipeline lever"):
        Variant("sms", 8, 32 * MiB, fused=True)
