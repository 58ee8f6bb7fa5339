"""The staged engine's shared stage memory (``hoccl.backends._segments``): a segment is
named by the offers of pieces inside it, a peer maps it and reads the owner's bytes, a
piece outside any segment (or in a segment that is gone) is left to cross-memory
attach, and a system without memfd gets plain memory.  This process stands for the
peer (it maps its own segments through ``/proc/self``'s pid)."""

import gc
import os
import sys
from unittest import mock

import numpy as np
import pytest

from hoccl.backends._segments import NO_SEGMENT, PeerSegments, segment_words, shared_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux's")


def test_a_peer_reads_the_owners_bytes_where_it_maps_them():
    rng = np.random.default_rng()
    memory = shared_bytes(10_000)
    memory[...] = rng.integers(0, 256, memory.nbytes, dtype=np.uint8)
    piece = memory[1234:5678]
    words = segment_words(piece)
    assert words != NO_SEGMENT
    seen = PeerSegments().view(os.getpid(), words, piece.ctypes.data, piece.nbytes)
    assert seen is not None and seen.ctypes.data != piece.ctypes.data  # a mapping of its own
    assert np.array_equal(seen, piece)
    piece[7] ^= 0xFF  # the owner's later writes show through the mapping
    assert seen[7] == piece[7]


def test_a_piece_outside_every_segment_is_left_to_cross_memory_attach():
    plain = np.zeros(64, np.uint8)
    assert segment_words(plain) == NO_SEGMENT
    assert PeerSegments().view(os.getpid(), NO_SEGMENT, plain.ctypes.data, 64) is None
    memory = shared_bytes(64)
    words = segment_words(memory)
    outside = memory.ctypes.data + 4096  # past the segment's end
    assert PeerSegments().view(os.getpid(), words, outside, 8) is None


def test_a_segment_whose_file_is_another_now_is_not_mapped():
    memory = shared_bytes(64)
    fd, inode, base, length = segment_words(memory)
    wrong = (fd, inode + 1, base, length)
    assert PeerSegments().view(os.getpid(), wrong, memory.ctypes.data, 64) is None


def test_a_segment_no_array_uses_is_freed():
    memory = shared_bytes(64)
    fd = segment_words(memory)[0]
    address = memory.ctypes.data
    del memory
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
    assert segment_words(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 1)
                                               .from_address(address))) == NO_SEGMENT


def test_without_memfd_the_memory_is_plain_and_named_by_no_offer():
    with mock.patch.object(os, "memfd_create", side_effect=OSError(38, "not implemented")):
        memory = shared_bytes(100)
    memory[...] = 3
    assert memory.nbytes == 100 and segment_words(memory) == NO_SEGMENT


# -- the host backend across processes: a child process owns the arrays -----------------

_OWNER = r"""
import gc, sys
import numpy as np
import hoccl
from hoccl.backends.host import open_device
device = open_device(max_sms=1, copy_sms=1)
arrays = {}
for line in sys.stdin:
    word, *rest = line.split()
    if word == "make":  # make NAME COUNT: a shared int64 array holding 0..COUNT-1
        name, count = rest[0], int(rest[1])
        arrays[name] = hoccl.host_empty(count, "int64")
        arrays[name][...] = np.arange(count)
        print(*device.export(arrays[name].ctypes.data, arrays[name].nbytes), flush=True)
    elif word == "plain":  # plain NAME COUNT: the same in memory of the process's own
        name, count = rest[0], int(rest[1])
        arrays[name] = np.arange(count, dtype=np.int64)
        print(*device.export(arrays[name].ctypes.data, arrays[name].nbytes), flush=True)
    elif word == "sum":
        print(int(arrays[rest[0]].sum()), flush=True)
    elif word == "drop":
        del arrays[rest[0]]
        gc.collect()
        print("dropped", flush=True)
"""


class _Owner:
    """A child process that makes arrays and exports them, on command."""

    def __init__(self):
        import subprocess
        self.process = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def ask(self, line):
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().split()

    def export(self, line):
        kind, *numbers = self.ask(line)
        return (kind, *(int(n) for n in numbers))

    def close(self):
        self.process.stdin.close()
        self.process.wait(30)


@pytest.fixture
def owner():
    process = _Owner()
    yield process
    process.close()


def _host_device():
    from hoccl.backends.host import open_device
    return open_device(max_sms=1, copy_sms=1)


def test_the_host_backend_maps_a_peers_shared_array_and_reads_and_writes_it(owner):
    from hoccl.backends._cross_memory import RemotePtr
    device = _host_device()
    try:
        count = int(np.random.default_rng().integers(1000, 5000))
        descriptor = owner.export(f"make a {count}")
        assert descriptor[0] == "host" and descriptor[1] == owner.process.pid
        assert descriptor[4], "a shared array is exported with its segment's words"
        local = device.import_(descriptor)
        assert isinstance(local, int) and device.mapped_segments == 1
        seen = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * count).from_address(local))
        assert np.array_equal(seen, np.arange(count))
        seen[...] = 3  # a store lands in the owner's array
        assert int(owner.ask("sum a")[0]) == 3 * count
        assert device.import_(descriptor) == local and device.mapped_segments == 1
        plain = owner.export(f"plain b {count}")
        assert plain[3:] == (0, 0, 0, 0)
        assert device.import_(plain) == RemotePtr(owner.process.pid, plain[2])
    finally:
        device.close()


def test_a_buffer_reaching_past_its_segment_is_exported_without_it():
    from hoccl.backends.host import open_device
    import hoccl
    device = open_device(max_sms=1, copy_sms=1)
    try:
        array = hoccl.host_empty(100, "int32")
        inside = device.export(array.ctypes.data + 40, 360)
        assert inside[3:] != NO_SEGMENT
        assert device.export(array.ctypes.data + 40, 1 << 20)[3:] == NO_SEGMENT
        assert device.export(array.ctypes.data, 0)[3:] == NO_SEGMENT  # size unknown
    finally:
        device.close()


def test_a_peers_segment_is_kept_while_it_lives_and_dropped_once_freed(owner):
    device = _host_device()
    try:
        device._peer_segments.KEEP = 2  # no bound for segments their owner still has
        descriptors = [owner.export(f"make m{i} 64") for i in range(4)]
        addresses = [device.import_(d) for d in descriptors]
        assert device.mapped_segments == 4  # every owner still has them: none dropped
        for i in (1, 2):
            assert owner.ask(f"drop m{i}") == ["dropped"]
        device.import_(owner.export("make m4 64"))
        assert device.mapped_segments == 3  # the freed two went, the live three stay
        for address, i in ((addresses[0], 0), (addresses[3], 3)):
            seen = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * 64).from_address(address))
            assert np.array_equal(seen, np.arange(64)), i
    finally:
        device.close()


def test_host_empty_gives_zeroed_shared_arrays_and_refuses_bad_requests():
    import hoccl
    from hoccl.backends._segments import segment_of
    array = hoccl.host_empty((3, 5), np.float32)
    assert array.shape == (3, 5) and array.dtype == np.float32 and not array.any()
    assert segment_of(array.ctypes.data, array.nbytes) != NO_SEGMENT
    with pytest.raises(hoccl.InvalidArgumentError, match="host_empty: expected a dtype"):
        hoccl.host_empty(4, "complex64")
    with pytest.raises(hoccl.InvalidArgumentError, match="host_empty: shape"):
        hoccl.host_empty((2, -1), "int32")
    with pytest.raises(hoccl.InvalidArgumentError, match="host_empty: framework"):
        hoccl.host_empty(4, "int32", framework="cupy")
    torch = pytest.importorskip("torch")
    tensor = hoccl.host_empty(6, torch.bfloat16, framework="torch")
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (6,) and not tensor.any()
    assert segment_of(tensor.data_ptr(), 12) != NO_SEGMENT
    assert hoccl.host_empty((0, 4), "int8", framework="torch").shape == (0, 4)


def test_each_piece_is_named_by_the_segment_that_holds_it_among_many():
    from hoccl.backends._segments import segment_of
    rng = np.random.default_rng()
    sizes = rng.integers(1, 3 * 4096, 40)
    memories = [shared_bytes(int(size)) for size in sizes]
    for memory in memories:
        words = segment_words(memory)
        assert words != NO_SEGMENT and words[2] == memory.ctypes.data
        start = int(rng.integers(0, memory.nbytes))
        length = int(rng.integers(0, memory.nbytes - start + 1))
        assert segment_of(memory.ctypes.data + start, length) == words
        assert segment_of(memory.ctypes.data, memory.nbytes + 1) == NO_SEGMENT  # past its end
    base = memories[7].ctypes.data
    del memories[7], memory
    gc.collect()
    assert segment_of(base, 1) == NO_SEGMENT  # released: no segment holds it now
