"""The host's large folds and moves on several threads (``hoccl._threads``): the same bits
as on one thread, readers read from several threads at once, moves in pieces (in this
process and through cross-memory attach), errors of a piece raised once every piece is
done, and ``HOCCL_HOST_THREADS``."""

import ctypes
import mmap
import os
import sys
import threading
import time

import numpy as np
import pytest

from hoccl import _dtypes, _threads
from hoccl._dtypes import FLOATING, NAMES, numpy_dtype, reduce_arrays, reduce_into
from hoccl._errors import HocclError, InvalidArgumentError
from hoccl.backends import _cross_memory, host
from hoccl.backends._cross_memory import RemotePtr, move
from hoccl.backends.host import _reduce_now
from hoccl.config import host_threads

OPS = ("sum", "avg", "prod", "max", "min")
BLOCK_BYTES = 40
THREADS = 3


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 40 bytes and moves split from 2 KiB up: a few thousand elements make
    parts of many blocks, each part's last block not whole."""
    monkeypatch.setattr(_dtypes, "REDUCE_BLOCK_BYTES", BLOCK_BYTES)
    monkeypatch.setattr(_cross_memory, "MOVE_PIECE_BYTES", 1024)
    for module in (host, _cross_memory):
        monkeypatch.setattr(module, "host_threads", lambda: THREADS)


def _random(rng, dtype: np.dtype, count: int) -> np.ndarray:
    """Integers of the whole range (sums and products wrap); floats that round and, in
    16-bit storage, overflow, but hold no NaN (numpy's vector and scalar loops may give
    NaNs of different signs, and a part's edges move elements between those loops)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    values = rng.standard_normal(count) * rng.choice([1e-3, 1.0, 1e3], count)
    return values.astype(np.float32).astype(dtype) if dtype.itemsize == 2 else values.astype(dtype)


def _poisoned(dtype: np.dtype, count: int, byte: int) -> np.ndarray:
    out = np.empty(count, dtype)
    out.view(np.uint8)[...] = byte
    return out


def _same_bytes(got: np.ndarray, want: np.ndarray) -> None:
    differ = np.nonzero((got.view(np.uint8) != want.view(np.uint8)))[0] // got.dtype.itemsize
    assert differ.size == 0, (np.unique(differ), got[differ], want[differ])


def _counted(record: list):
    """``run_parts`` that also records each call's bounds."""
    run = _threads.run_parts

    def run_parts(task, bounds):
        record.append(list(bounds))
        run(task, bounds)
    return run_parts


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("op", OPS)
def test_folds_in_parts_give_the_bits_of_one_thread_and_of_reduce_arrays(name, op, monkeypatch):
    rng = np.random.default_rng()
    dtype = numpy_dtype(name)
    splits = []
    monkeypatch.setattr(_threads, "run_parts", _counted(splits))
    for count in (2000, 2003):
        for inputs in (1, 2, 5):
            parts = [_random(rng, dtype, count) for _ in range(inputs)]
            for divisor in ((None, 3) if op == "avg" else (None,)):
                for scale in ((None, 0.37) if op == "sum" and name in FLOATING else (None,)):
                    want = reduce_arrays(parts, op, dtype, divisor, scale)
                    alone = _poisoned(dtype, count, 0x00)
                    reduce_into(alone, parts, op, divisor, scale)
                    _same_bytes(alone, want)
                    for poison in (0xFF, 0x00):  # an unwritten element shows in one of them
                        split = _poisoned(dtype, count, poison)
                        reduce_into(split, parts, op, divisor, scale, threads=THREADS)
                        _same_bytes(split, alone)
    assert splits and all(len(bounds) == THREADS for bounds in splits)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64"])
def test_an_in_place_fold_in_parts_gives_the_bits_of_reduce_arrays(name):
    rng = np.random.default_rng()
    dtype = numpy_dtype(name)
    for where in range(3):
        for op in OPS:
            parts = [_random(rng, dtype, 1999) for _ in range(3)]
            want = reduce_arrays(parts, op, dtype)
            reduce_into(parts[where], parts, op, threads=THREADS)
            _same_bytes(parts[where], want)


def test_a_small_fold_stays_on_the_calling_thread(monkeypatch):
    """Under two blocks for each of two threads, the fold is not split."""
    splits = []
    monkeypatch.setattr(_threads, "run_parts", _counted(splits))
    per_block = BLOCK_BYTES // 4
    parts = [np.ones(2 * per_block * 2 - 1, np.float32)] * 2
    out = np.empty_like(parts[0])
    reduce_into(out, parts, "sum", threads=THREADS)
    assert (out == 2).all() and splits == []
    reduce_into(out, parts, "sum", threads=1)
    assert splits == []


@pytest.fixture
def switch_often():
    """Threads switch every microsecond: a buffer shared between readers is overwritten
    before its reader's fold has read it."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_readers_read_from_several_threads_at_once_give_the_right_bits(name, switch_often):
    rng = np.random.default_rng()
    dtype = numpy_dtype(name)
    count = 6007
    parts = [_random(rng, dtype, count) for _ in range(3)]
    readers = set()

    def reader(array):
        bounces = threading.local()

        def read(start, stop):
            readers.add(threading.get_ident())
            if getattr(bounces, "array", None) is None:
                bounces.array = np.empty(count, dtype)
            bounces.array[:stop - start] = array[start:stop]
            return bounces.array[:stop - start]
        return read
    out = _poisoned(dtype, count, 0xFF)
    reduce_into(out, [parts[0], reader(parts[1]), reader(parts[2])], "avg", threads=THREADS)
    _same_bytes(out, reduce_arrays(parts, "avg", dtype))
    assert len(readers) > 1


@pytest.mark.parametrize("name", ["float32", "float16", "int32"])
def test_the_host_backends_fold_reads_peers_through_buffers_of_each_thread(name, switch_often):
    """``_reduce_now`` with inputs in "another process" (this one, through cross-memory
    attach): each thread reads a peer's blocks into a buffer of its own."""
    rng = np.random.default_rng()
    dtype = numpy_dtype(name)
    count = 8011
    for op in OPS:
        parts = [_random(rng, dtype, count) for _ in range(3)]
        out = _poisoned(dtype, count, 0xFF)
        addresses = [parts[0].ctypes.data] + [RemotePtr(os.getpid(), x.ctypes.data)
                                              for x in parts[1:]]
        _reduce_now(out.ctypes.data, addresses, count, name, op, None, None)
        _same_bytes(out, reduce_arrays(parts, op, dtype))


@pytest.mark.parametrize("route", ["local", "read", "write", "both"])
def test_a_large_move_in_pieces_moves_every_byte_and_no_other(route, monkeypatch):
    """Through memmove, cross-memory reads, writes, and both (this process standing for
    the peers); the bytes around the target keep their poison."""
    rng = np.random.default_rng()
    nbytes, guard, here = 10_007, 256, os.getpid()
    pieces = []
    move_piece = _cross_memory.move_piece

    def recorded(dst, src, length):
        pieces.append((threading.get_ident(), length))
        move_piece(dst, src, length)
    monkeypatch.setattr(_cross_memory, "move_piece", recorded)
    for poison in (0x00, 0xFF):  # an unmoved byte shows against one of them
        source = rng.integers(0, 256, nbytes, dtype=np.uint8)
        memory = np.full(nbytes + 2 * guard, poison, np.uint8)
        target = memory[guard:guard + nbytes]
        dst, src = target.ctypes.data, source.ctypes.data
        move(RemotePtr(here, dst) if route in ("write", "both") else dst,
              RemotePtr(here, src) if route in ("read", "both") else src, nbytes)
        _same_bytes(target, source)
        assert (memory[:guard] == poison).all() and (memory[-guard:] == poison).all()
    assert sorted(length for _, length in pieces) == sorted([10_007 - 2 * 3392, 3392, 3392] * 2)
    assert len({thread for thread, _ in pieces}) > 1


def test_an_overlapping_move_is_one_memmove():
    """Pieces of a move onto its own source shifted would read bytes already written."""
    rng = np.random.default_rng()
    memory = rng.integers(0, 256, 20_000, dtype=np.uint8)
    for shift in (8, -8):
        want = memory.copy()
        want[1000 + shift:11_000 + shift] = memory[1000:11_000]
        move(memory[1000 + shift:].ctypes.data, memory[1000:].ctypes.data, 10_000)
        _same_bytes(memory, want)
        memory = rng.integers(0, 256, 20_000, dtype=np.uint8)


def test_a_failed_piece_raises_naming_the_call_the_process_and_the_bytes():
    """The last piece reads memory of which a page is not mapped any more."""
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    base = libc.mmap(None, 4 * page, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(base + 3 * page, page) == 0
    target = np.empty(4 * page, np.uint8)
    try:
        with pytest.raises(HocclError, match=rf"process_vm_readv: moving \d+ bytes with "
                                             rf"process {os.getpid()} failed: Bad address"):
            move(target.ctypes.data, RemotePtr(os.getpid(), base), 4 * page)
    finally:
        libc.munmap(base, 3 * page)


def test_an_error_is_raised_after_every_other_piece_has_finished(monkeypatch):
    finished = []

    def piece(dst, src, nbytes):
        if dst == 0:
            raise HocclError(f"process_vm_writev: moving {nbytes} bytes with process 1 failed")
        time.sleep(0.05)
        finished.append(dst)
    monkeypatch.setattr(_cross_memory, "move_piece", piece)
    with pytest.raises(HocclError, match="process_vm_writev: moving 3392 bytes"):
        move(0, 1 << 20, 10_000)
    assert sorted(finished) == [3392, 6784]


def test_a_part_that_splits_again_runs_its_parts_on_its_own_thread(monkeypatch):
    """Every pool thread busy with a part that splits again: waiting for the pool, they
    would wait for ever; their parts run in turn on each pool thread instead."""
    monkeypatch.setattr(_threads, "_POOL", None)  # a pool of THREADS - 1 threads
    monkeypatch.setattr(_threads, "_POOL_WORKERS", 0)
    started = threading.Barrier(THREADS)
    seen = []

    def outer(start, stop):
        started.wait(10)  # every thread of the pool is busy
        mine = threading.current_thread().name
        _threads.run_parts(lambda *_: seen.append((mine, threading.current_thread().name)),
                           _threads.split(2, 2))
    calling = threading.Thread(target=_threads.run_parts,
                               args=(outer, _threads.split(THREADS, THREADS)), daemon=True)
    calling.start()
    calling.join(10)
    assert not calling.is_alive()
    _threads._POOL.shutdown()
    on_pool = [inner for outer_thread, inner in seen if outer_thread.startswith("hoccl-host")]
    assert len(seen) == 2 * THREADS and len(on_pool) == 2 * (THREADS - 1)
    assert all(inner == outer_thread for outer_thread, inner in seen
               if outer_thread.startswith("hoccl-host"))


@pytest.mark.parametrize("total,parts,align", [(10, 3, 1), (10_007, 3, 64), (5, 8, 1),
                                               (0, 3, 1), (129, 2, 64)])
def test_split_covers_the_range_in_order_in_at_most_the_parts_asked(total, parts, align):
    bounds = _threads.split(total, parts, align)
    assert [start for start, _ in bounds] == [0, *(stop for _, stop in bounds)][:len(bounds)]
    assert (bounds[-1][1] if bounds else 0) == total
    assert len(bounds) <= parts and all(start % align == 0 for start, _ in bounds)
    assert all(stop > start for start, stop in bounds)


@pytest.fixture
def threads_unread():
    host_threads.cache_clear()
    yield
    host_threads.cache_clear()


def test_host_threads_default_to_at_most_four_cores_of_the_affinity(monkeypatch, threads_unread):
    monkeypatch.delenv("HOCCL_HOST_THREADS", raising=False)
    assert host_threads() == min(4, len(os.sched_getaffinity(0)))
    host_threads.cache_clear()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert host_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert host_threads() == 1  # read once
    host_threads.cache_clear()
    assert host_threads() == 4
    monkeypatch.setenv("HOCCL_HOST_THREADS", "6")
    host_threads.cache_clear()
    assert host_threads() == 6


@pytest.mark.parametrize("text", ["0", "-2", "two", "2.5"])
def test_a_bad_host_threads_value_names_the_variable_and_what_it_got(text, monkeypatch,
                                                                     threads_unread):
    monkeypatch.setenv("HOCCL_HOST_THREADS", text)
    monkeypatch.setattr(host, "host_threads", host_threads)
    with pytest.raises(InvalidArgumentError, match=rf"HOCCL_HOST_THREADS must be a positive "
                                                   rf"int .*; got '{text}'"):
        host_threads()
    with pytest.raises(InvalidArgumentError, match="HOCCL_HOST_THREADS"):
        host.HostDevice(max_sms=1, copy_sms=1)


def test_callers_at_once_each_get_their_parts_run_at_once():
    """Two levels of a pipelined call split their folds and reads at the same time: every
    part of both starts at once (none waits for the other caller's parts to finish)."""
    everyone = threading.Barrier(2 * THREADS, timeout=5)
    met = []

    def part(start, stop):
        everyone.wait()  # breaks (BrokenBarrierError) unless all 2 * THREADS parts run
        met.append(start)
    callers = [threading.Thread(target=_threads.run_parts,
                                args=(part, _threads.split(THREADS, THREADS)), daemon=True)
               for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert sorted(met) == sorted(list(range(THREADS)) * 2)
