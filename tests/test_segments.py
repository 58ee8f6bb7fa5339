"""The staged engine's shared stage memory (``hoccl._hierarchy.segments``): a segment is
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

from hoccl._hierarchy.segments import NO_SEGMENT, PeerSegments, segment_words, shared_bytes

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
