"""hoccl.torch's RegisteredPool (FSDP2's all-gather ``allocate``) on the host backend:
offsets that depend only on the order of requests and releases, slots reused when their
tensor is gone, slabs registered as needed, shadows that keep a call's memory without
keeping the slot, reuse ordered after the last call, close.  The pool under FSDP2
across processes is in tests/torch_programs/run_training.py (through test_torch.py)."""

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hoccl  # noqa: E402
from hoccl.torch._pool import RegisteredPool  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def comm():
    (only,) = hoccl.init_local(1, backend="host")
    yield only
    only.close()


def base(pool, tensor):
    """The tensor's offset in the pool's slabs (slab index, byte offset)."""
    address = tensor.untyped_storage().data_ptr()
    for index, slab in enumerate(pool._slabs):
        start = slab.tensor.data_ptr()
        if start <= address < start + slab.nbytes:
            return index, address - start
    return None


def test_offsets_follow_requests_and_releases_only(comm):
    """Two pools given the same requests and releases hand out the same offsets, and a
    released slot of the size is taken before new memory."""
    def script(pool):
        seen, live = [], {}
        for step, (name, numel, dtype) in enumerate([
                ("a", 1000, torch.float32), ("b", 333, torch.bfloat16),
                ("c", 1000, torch.float32), ("-a", 0, None), ("d", 1000, torch.float32),
                ("-b", 0, None), ("e", 333, torch.bfloat16), ("f", 1, torch.uint8),
                ("-c", 0, None), ("-d", 0, None), ("g", 1000, torch.float32)]):
            if name.startswith("-"):
                del live[name[1:]]
                continue
            live[name] = pool.allocate((numel,), dtype=dtype, device=CPU)
            assert live[name].shape == (numel,) and live[name].dtype == dtype
            seen.append((name, base(pool, live[name])))
        return seen, live
    first, second = RegisteredPool(comm), RegisteredPool(comm)
    seen, _ = script(first)
    assert seen == script(second)[0]
    offsets = dict(seen)
    assert offsets["d"] == offsets["a"]          # a's slot, released, of d's size
    assert offsets["e"] == offsets["b"]
    assert offsets["g"] == offsets["a"]          # a/d's slot comes before c's
    assert len({offsets[name] for name in "abcf"}) == 4
    assert first.stats["reused"] == 3 and first.stats["carved"] == 4
    assert all(offset % 512 == 0 for _, (_, offset) in seen)


def test_a_view_keeps_the_slot_taken(comm):
    pool = RegisteredPool(comm)
    tensor = pool.allocate((256,), dtype=torch.float32, device=CPU)
    view = tensor[128:]
    del tensor
    gc.collect()
    again = pool.allocate((256,), dtype=torch.float32, device=CPU)
    assert base(pool, again) != base(pool, view)  # a new slot: the view still uses the old
    del view
    third = pool.allocate((256,), dtype=torch.float32, device=CPU)
    assert base(pool, third)[1] == 0


def test_slabs_are_registered_as_they_are_needed(comm):
    pool = RegisteredPool(comm, slab_bytes=4096)
    assert comm.windows == []
    held = [pool.allocate((1024,), dtype=torch.uint8, device=CPU) for _ in range(4)]
    assert len(comm.windows) == 1 and pool.stats["slabs"] == 1  # 4 slots of 1 KiB
    held.append(pool.allocate((1024,), dtype=torch.uint8, device=CPU))
    assert len(comm.windows) == 2
    big = pool.allocate((10000,), dtype=torch.uint8, device=CPU)  # larger than a slab
    assert len(comm.windows) == 3 and pool._slabs[-1].nbytes == 10240
    small = pool.allocate((1000,), dtype=torch.uint8, device=CPU)  # the second slab's room
    assert len(comm.windows) == 3 and base(pool, small) == (1, 1024)
    held.append(small)
    for tensor in held + [big]:  # every tensor lies in a registered window
        assert comm._engine.windows.find(tensor.data_ptr(), tensor.numel()) is not None
    # the memory is what the tensors show: writes through one appear in the slab
    held[1].fill_(7)
    slab, offset = base(pool, held[1])
    assert bool((pool._slabs[slab].tensor[offset:offset + 1024] == 7).all())


def test_shadows_do_not_keep_the_slot_and_reuse_waits_for_the_last_call(comm):
    pool = RegisteredPool(comm)
    tensor = pool.allocate((64,), dtype=torch.float32, device=CPU)
    shadow, slot = pool.shadow(tensor[16:32])
    assert shadow.data_ptr() == tensor[16:32].data_ptr() and shadow.shape == (16,)
    assert pool.shadow(torch.empty(4)) is None                    # not the pool's

    class Call:  # a hoccl.torch Work: reuse must be ordered after it
        waited = False

        def is_completed(self):
            return False

        def block_current_stream(self):
            Call.waited = True
    pool.used(slot, Call())
    del tensor
    assert pool.in_use() == 0 and slot.free() and not slot.idle()
    again = pool.allocate((64,), dtype=torch.float32, device=CPU)
    assert Call.waited and again.data_ptr() == shadow.data_ptr() - 64
    assert pool.stats["reused"] == 1


def test_close_deregisters_and_later_requests_are_plain(comm):
    pool = RegisteredPool(comm)
    kept = pool.allocate((32,), dtype=torch.float32, device=CPU)
    kept.copy_(torch.arange(32.0))
    pool.close()
    assert comm.windows == []
    np.testing.assert_array_equal(kept.numpy(), np.arange(32.0))  # still its memory
    later = pool.allocate((8,), dtype=torch.float32, device=CPU)
    assert pool.shadow(later) is None and pool.stats["plain"] == 1


def test_other_devices_get_plain_tensors(comm):
    pool = RegisteredPool(comm)
    tensor = pool.allocate((8,), dtype=torch.float32, device=torch.device("meta"))
    assert tensor.device.type == "meta" and pool.stats == dict(pool.stats, plain=1,
                                                              registered=0)
    assert comm.windows == []


def test_reduce_scatter_hook_registers_only_the_sizes_that_pull():
    """FSDP2's reduce-scatter ``allocate``: plain tensors while the communicator pushes
    (pull_bytes 0); registered memory for sizes up to pull_bytes once it pulls, where the
    peers read the input where it lies."""
    from hoccl.torch._fsdp import ReduceScatter
    (only,) = hoccl.init_local(1, backend="host")
    try:
        hook = ReduceScatter(only)
        first = hook.allocate((64,), dtype=torch.float32, device=CPU)
        assert hook.pool.shadow(first) is None and hook.pool.stats["registered"] == 0
        only.set_options(pull_bytes=1024)
        small = hook.allocate((256,), dtype=torch.float32, device=CPU)  # 1024 bytes: pulls
        large = hook.allocate((257,), dtype=torch.float32, device=CPU)  # larger: pushes
        assert hook.pool.shadow(small) is not None and hook.pool.shadow(large) is None
        assert hook.pool.stats["registered"] == 1 and len(only.windows) == 1
        assert ReduceScatter(only, registered=False).pool is None
        # a direct kernel reads its peers' inputs too: sizes up to kernel_bytes register
        only.set_options(pull_bytes=0, kernel_bytes=2048)
        direct = hook.allocate((512,), dtype=torch.float32, device=CPU)  # 2048 bytes
        above = hook.allocate((513,), dtype=torch.float32, device=CPU)
        assert hook.pool.shadow(direct) is not None and hook.pool.shadow(above) is None
        hook.pool.close()
    finally:
        only.close()
