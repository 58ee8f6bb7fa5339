"""Reference semantics and a checker shared by the tests, the examples and the benchmarks.

``expected(...)`` is the naive numpy program each collective must equal.
``check_collective(...)`` runs one collective on real communicators (every rank in
this process for ``init_local``, or this process's rank under mpirun) with fresh
random inputs drawn from ``seed`` (the same on every process) and poisoned outputs,
and compares each local rank's output with ``expected``.

Every comparison is exact: outputs and references are compared as unsigned integers
of the element's width (``assert_exact``), so ``-0.0`` differs from ``0.0``, one NaN
payload from another, and a flipped low mantissa bit from the right value.  Copies
must be exact by definition.  Reductions are exact because the reference computes
what the backends compute, in the same order and precision:

- every plan reduces each element's inputs in rank order (``hoccl.sched.algorithms``,
  ``_reducing``: input q is rank q's block, whichever rank owns the result), and
  ``expected`` folds them in rank order with ``reduce_arrays``;
- the host backend's reduce is ``reduce_into``: ``reduce_arrays``, block by block;
- the CUDA kernel (``hoccl.backends._kernels``) folds its inputs left to right,
  ``acc = op(acc, x[i])``, with float16/bfloat16 loaded into a float32 accumulator
  and every other type in its own; ``+``, ``*`` and ``/`` are single IEEE operations
  rounded to nearest (NVRTC's defaults: IEEE division, no flush to zero; no multiply
  feeds an add, so no fused multiply-add can form); ``avg`` divides the sum once by
  the number of inputs; the result is rounded once to the storage type, to nearest
  even -- the operations ``reduce_arrays`` performs in numpy.  ``max``/``min`` keep the
  accumulator only when it is greater (smaller) or NaN, as numpy does for float32 and
  float64; ``random_array`` draws no zero and no NaN, so ties between ``+0.0`` and
  ``-0.0`` and NaN payloads never arise.  One launch takes up to
  ``MAX_INPUTS`` (64) inputs; beyond that the kernel chains launches and rounds
  16-bit partial sums to their storage type in between, which ``reduced`` and
  ``expected`` model when given ``inputs_per_launch``.  (A chained reduce whose output
  is also one of its inputs past the first launch folds the inputs equal to the output
  first instead, a case ``reduced`` does not model: ``_kernels.reduce_launches``.)

Across hosts every engine follows one rule (``hoccl._hierarchy.folding``), which
``hierarchical_reduced`` computes: ``expected(..., local_size=L)`` checks exactly too.

Poison (``poison``) is a value no input equals, nor any result but the few that
``POISON_BITS`` names (the checker then runs twice), so an element still equal to it
was never written, and the checker says so.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import from_numpy, numpy_dtype, reduce_arrays
from ..backends._kernels import MAX_INPUTS

__all__ = ["expected", "reduced", "hierarchical_reduced", "random_array", "poison", "is_poison", "assert_exact",
           "check_collective", "check_interleaved", "PlantedFault", "FAULTS", "ArrayModule", "RegisteredArrays",
           "array_module_for", "run_or_abort", "nvrtc_ptx",
           "IN_PLACE_FORMS", "POISON_BITS"]

#: collectives that have an in-place form
IN_PLACE_FORMS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "gather",
                  "scatter")

#: The poison of each dtype, as the bits of one element.  Floats: a signalling NaN
#: whose payload is the byte A5 repeated.  ``random_array`` draws no NaN, and arithmetic
#: never returns a signalling NaN (an operation on a NaN gives a quiet one), so no copy,
#: sum or average of inputs equals it.  Integers: the byte A5 repeated (int8 -91, uint8
#: 165, int32 -1515870811, int64 -6510615555426900571), outside ``random_array``'s
#: ranges [-8, 8) and [0, 8); sums, averages, maxima and minima of fewer than 12 ranks
#: stay inside [-96, 96).  Products wrap (1-byte ones from 3 ranks on, 32-bit ones from
#: 11) and can then equal the poison, as can int8 sums of 12 ranks or more: where an
#: expected element equals it, ``check_collective`` runs a second time with the
#: complement poison, so that every element is checked against a poison it does not
#: equal.
POISON_BITS = {"float16": 0x7DA5, "bfloat16": 0x7FA5, "float32": 0x7FA5A5A5,
               "float64": 0x7FF5A5A5A5A5A5A5, "int8": 0xA5, "uint8": 0xA5,
               "int32": 0xA5A5A5A5, "int64": 0xA5A5A5A5A5A5A5A5}

def run_or_abort(main: Callable[[], Any]) -> None:
    """Run an MPI program's ``main``; if it raises, print the error and abort every rank
    (``MPI_Abort``), so that no peer is left waiting in a collective for ever."""
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)


#: the planted faults ``PlantedFault`` knows
FAULTS = ("flip", "shift", "unwritten")


def _bits(array: np.ndarray) -> np.ndarray:
    """``array``'s elements as unsigned integers of the same width (no conversion)."""
    array = np.ascontiguousarray(array)
    return array.view(f"u{array.dtype.itemsize}")


def random_array(rng: np.random.Generator, count: int, dtype: str) -> np.ndarray:
    """Fresh random values: integers in [-8, 8) ([0, 8) unsigned: sums stay exact), normals
    for floats.  Never the poison; floats are never NaN and never zero (a float16 normal
    under 3e-8 would round to a signed zero: it is drawn as 1 instead)."""
    np_dtype = numpy_dtype(dtype)
    if np_dtype.kind in "iu":
        low, high = (0, 8) if np_dtype.kind == "u" else (-8, 8)
        return rng.integers(low, high, count).astype(np_dtype)
    values = rng.standard_normal(count).astype(np.float32).astype(np_dtype)
    values[values == 0] = 1
    return values


def poison(count: int, dtype: str, bits: Optional[int] = None) -> np.ndarray:
    """``count`` elements of ``dtype`` that are all the poison (``POISON_BITS``), or ``bits``."""
    np_dtype = numpy_dtype(dtype)
    bits = POISON_BITS[dtype] if bits is None else bits
    return np.full(count, bits, dtype=f"u{np_dtype.itemsize}").view(np_dtype)


def is_poison(array: np.ndarray, bits: Optional[int] = None) -> np.ndarray:
    """Which elements of ``array`` are still the poison (``POISON_BITS``, or ``bits``)."""
    if bits is None:
        found = from_numpy(array.dtype)
        assert found is not None, f"is_poison: no hoccl dtype for {array.dtype}"
        bits = POISON_BITS[found.name]
    return _bits(array) == bits


def assert_exact(what: str, want: np.ndarray, got: np.ndarray,
                 poison_bits: Optional[int] = None) -> None:
    """Raise AssertionError unless ``got`` holds ``want``'s bits exactly.

    The message names ``what``, how many elements differ, how many of those are still
    the poison (``unwritten``), and the first difference with its bits.
    """
    if want.shape != got.shape or want.dtype != got.dtype:
        raise AssertionError(f"{what}: output has {got.size} elements of {got.dtype}, "
                             f"expected {want.size} of {want.dtype}")
    wrong = np.flatnonzero(_bits(want) != _bits(got))
    if not wrong.size:
        return
    unwritten = is_poison(got, poison_bits)
    still_poison = int(np.count_nonzero(unwritten[wrong]))
    first = int(wrong[0])
    digits = 2 * want.dtype.itemsize + 2
    raise AssertionError(
        f"{what}: {wrong.size} of {want.size} elements wrong"
        f"{f', {still_poison} of them unwritten (still poison)' if still_poison else ''}; "
        f"first at {first}: got {got[first]!r} ({int(_bits(got)[first]):#0{digits}x}"
        f"{', unwritten' if unwritten[first] else ''}), expected {want[first]!r} "
        f"({int(_bits(want)[first]):#0{digits}x})")


def reduced(inputs: Sequence[np.ndarray], op: str, *,
            inputs_per_launch: Optional[int] = None, scale: Optional[float] = None
            ) -> np.ndarray:
    """``op`` over ``inputs`` in order as the backends compute it (see the module docstring).

    With ``inputs_per_launch`` (the CUDA kernel's ``MAX_INPUTS``) more inputs than that
    are reduced in launches: the first takes ``inputs_per_launch``, each later one the
    partial result and ``inputs_per_launch - 1`` more; every launch but the last rounds
    the partial result to the inputs' dtype (and sums, for ``avg``); the last divides by
    the number of all the inputs.  A sum's ``scale`` multiplies the last launch's result.
    Only 16-bit floats notice: every other type accumulates in its own precision.
    """
    dtype = inputs[0].dtype
    if (inputs_per_launch is None or len(inputs) <= inputs_per_launch
            or dtype.kind in "iu" or dtype.itemsize != 2):
        return reduce_arrays(list(inputs), op, dtype, scale=scale)
    partial_op = "sum" if op == "avg" else op
    partial = reduce_arrays(list(inputs[:inputs_per_launch]), partial_op, dtype)
    rest = list(inputs[inputs_per_launch:])
    while len(rest) >= inputs_per_launch:
        partial = reduce_arrays([partial] + rest[:inputs_per_launch - 1], partial_op, dtype)
        rest = rest[inputs_per_launch - 1:]
    if op != "avg":
        return reduce_arrays([partial] + rest, op, dtype, scale=scale)
    total = reduce_arrays([partial] + rest, "sum", np.dtype(np.float32))
    return (total / np.float32(len(inputs))).astype(dtype)


def hierarchical_reduced(inputs: Sequence[np.ndarray], op: str, local_size: int
                         ) -> np.ndarray:
    """``op`` over ``inputs`` as across hosts of ``local_size`` ranks: each host's inputs
    folded and rounded, then the hosts' results, then "avg" divided once."""
    from ..sched.hierarchical import divide_in_place
    dtype = inputs[0].dtype
    step = "sum" if op == "avg" else op
    total = reduce_arrays([reduce_arrays(list(inputs[first:first + local_size]), step, dtype)
                           for first in range(0, len(inputs), local_size)], step, dtype)
    if op == "avg":
        divide_in_place(total, len(inputs))
    return total


def expected(collective: str, inputs: Sequence[Any], *, op: str = "sum",
             root: int = 0, inputs_per_launch: Optional[int] = None,
             scale: Optional[float] = None, local_size: Optional[int] = None
             ) -> List[Optional[np.ndarray]]:
    """What each rank's receive buffer must hold; ``inputs[r]`` is rank r's send data
    (None where a rank sends nothing).  None where a rank receives nothing.

    ``send_recv`` is a ring: rank r sends to rank r+1 and receives from rank r-1.
    Reductions fold the ranks' data in rank order (see the module docstring);
    ``inputs_per_launch`` models a backend whose reduce chains launches of that many;
    ``local_size`` (fewer than the ranks) a world across hosts of that many ranks each.
    """
    n = len(inputs)

    def reduce(blocks):
        if local_size is not None and local_size < n:
            return hierarchical_reduced(blocks, op, local_size)
        return reduced(blocks, op, inputs_per_launch=inputs_per_launch, scale=scale)
    if collective == "all_gather":
        return [np.concatenate(inputs) for _ in range(n)]
    if collective == "all_reduce":
        total = reduce(inputs)
        return [total.copy() for _ in range(n)]
    if collective == "reduce_scatter":
        count = inputs[0].size // n
        return [reduce([x[r * count:(r + 1) * count] for x in inputs]) for r in range(n)]
    if collective == "all_to_all":
        count = inputs[0].size // n
        return [np.concatenate([inputs[p][r * count:(r + 1) * count] for p in range(n)])
                for r in range(n)]
    if collective == "broadcast":
        return [inputs[root].copy() for _ in range(n)]
    if collective == "reduce":
        return [reduce(inputs) if r == root else None for r in range(n)]
    if collective == "gather":
        return [np.concatenate(inputs) if r == root else None for r in range(n)]
    if collective == "scatter":
        count = inputs[root].size // n
        return [inputs[root][r * count:(r + 1) * count].copy() for r in range(n)]
    if collective == "send_recv":
        return [inputs[(r - 1) % n].copy() if n > 1 else None for r in range(n)]
    raise ValueError(f"expected: unknown collective {collective!r}")


class ArrayModule:
    """Allocates test arrays for a backend: numpy on the host (``"shared"``: numpy arrays
    in host memory the peers map, ``hoccl.host_empty``), cupy or torch on GPUs."""

    def __init__(self, kind: str = "numpy"):
        self.kind = kind

    def asarray(self, data: np.ndarray, device: Optional[int]) -> Any:
        if self.kind == "numpy":
            return np.ascontiguousarray(data).copy()
        if self.kind == "shared":
            from .._arrays import host_empty
            array = host_empty(data.shape, data.dtype)
            array[...] = data
            return array
        if self.kind == "cupy":
            import cupy
            with cupy.cuda.Device(device):
                if str(data.dtype) == "bfloat16":
                    raise TypeError("cupy has no bfloat16; use torch arrays for bfloat16")
                return cupy.asarray(data)
        import torch
        if str(data.dtype) == "bfloat16":
            tensor = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(data.copy())
        return tensor.to(f"cuda:{device}")

    def fill(self, array: Any, values: np.ndarray) -> None:
        """``values`` into ``array`` where it lies, its address kept (a registered buffer
        stays the same buffer)."""
        if self.kind in ("numpy", "shared"):
            array[...] = values
        elif self.kind == "cupy":
            array.set(values)
        else:
            import torch
            if str(values.dtype) == "bfloat16":  # torch takes no ml_dtypes array: its bits
                array.view(torch.int16).copy_(torch.from_numpy(values.view(np.int16)))
            else:
                array.copy_(torch.from_numpy(values))

    def to_numpy(self, array: Any, dtype: str) -> np.ndarray:
        if self.kind in ("numpy", "shared"):
            return np.asarray(array)
        if self.kind == "cupy":
            return array.get()
        import torch
        if array.dtype == torch.bfloat16:
            return array.view(torch.int16).cpu().numpy().view(numpy_dtype("bfloat16"))
        return array.cpu().numpy()

    def synchronize(self, device: Optional[int]) -> None:
        if self.kind == "cupy":
            import cupy
            cupy.cuda.Device(device).synchronize()
        elif self.kind == "torch":
            import torch
            torch.cuda.synchronize(device)


class PlantedFault(ArrayModule):
    """An ``ArrayModule`` that corrupts each output, where it lives (host or GPU memory),
    just before reading it back: how a checker is shown to fail before it is trusted.

    Outputs are seen as blocks of ``block`` elements (a collective's ``count``):

    - ``flip``: bit 0 of the middle element of every block is inverted (a float's lowest
      mantissa bit: a change within any rounding tolerance);
    - ``shift``: every block moves one block on, cyclically (block k holds what block
      k-1 should); an output of one block moves one element on;
    - ``unwritten``: the last block is the poison again, as if its copy never ran.

    Empty outputs stay as they are (there is nothing to corrupt).
    """

    def __init__(self, arrays: ArrayModule, fault: str, block: int):
        if fault not in FAULTS:
            raise ValueError(f"PlantedFault: fault must be one of {FAULTS}, got {fault!r}")
        if block < 1:
            raise ValueError(f"PlantedFault: block must be at least 1 element, got {block}")
        super().__init__(arrays.kind)
        self.fault, self.block = fault, block

    def to_numpy(self, array: Any, dtype: str) -> np.ndarray:
        if len(array):
            self._plant(array, dtype)
        return super().to_numpy(array, dtype)

    def _plant(self, array: Any, dtype: str) -> None:
        if self.kind == "cupy":
            import cupy
            with cupy.cuda.Device(array.device.id):
                self._corrupt(array.view(cupy.uint8), cupy.roll, dtype, array.device.id)
        elif self.kind == "torch":
            import torch
            self._corrupt(array.view(torch.uint8), torch.roll, dtype, array.device.index)
        else:
            self._corrupt(array.view(np.uint8), np.roll, dtype, None)

    def _corrupt(self, raw: Any, roll: Any, dtype: str, device: Optional[int]) -> None:
        """Corrupt ``raw``, the output's bytes, in place (numpy, cupy or torch alike)."""
        itemsize = numpy_dtype(dtype).itemsize
        block_bytes = self.block * itemsize
        blocks = max(1, len(raw) // block_bytes)
        if self.fault == "flip":
            for index in range(blocks):
                first = index * block_bytes + (self.block // 2) * itemsize
                raw[first:first + 1] ^= 1
        elif self.fault == "shift":
            raw[:] = roll(raw, block_bytes if blocks > 1 else itemsize)
        else:
            last = (blocks - 1) * block_bytes
            raw[last:] = self.asarray(poison(len(raw[last:]) // itemsize, dtype).view(np.uint8),
                                      device)


class RegisteredArrays(ArrayModule):
    """An ``ArrayModule`` whose buffers are carved from one registered array per
    communicator (``hoccl.empty``, made on first use: a collective call, so every rank
    must reach it at the same point), at the same offsets on every rank: the symmetric
    buffers that calls on registered memory want.  ``check_collective`` places each
    buffer in a fixed slot (the receive buffer in slot 0, the send buffer in slot 1, an
    in-place form's whole buffer in slot 2) of ``slot_bytes`` each, whether or not a rank
    passes it, so that every rank's slot k is at the same offset."""

    SLOTS = 3

    def __init__(self, arrays: ArrayModule, slot_bytes: int):
        super().__init__(arrays.kind)
        self.slot_bytes = slot_bytes
        self.slabs: Dict[int, Tuple[Any, Any]] = {}  # id(comm) -> (comm, registered array)

    def place(self, comm: Any, slot: int, data: np.ndarray) -> Any:
        """``data`` copied into ``comm``'s slot ``slot``; the view is returned."""
        nbytes = data.nbytes
        if nbytes > self.slot_bytes:
            raise ValueError(f"RegisteredArrays: {nbytes} bytes do not fit a slot of "
                             f"{self.slot_bytes}")
        entry = self.slabs.get(id(comm))
        if entry is None:
            import hoccl
            slab = hoccl.empty(self.SLOTS * self.slot_bytes, "uint8", comm,
                               framework=self.kind)
            entry = self.slabs[id(comm)] = (comm, slab)
        start = slot * self.slot_bytes
        raw = entry[1][start:start + nbytes]
        if self.kind == "torch":
            import torch
            view = raw.view(getattr(torch, str(data.dtype)))
            view.copy_(super().asarray(data, comm.device))
        elif self.kind == "cupy":
            view = raw.view(data.dtype)
            view[...] = super().asarray(data, comm.device)
        else:
            view = raw.view(data.dtype)
            view[...] = data
        return view

    def release(self) -> None:
        """Deregister every slab (collective: every rank at the same point)."""
        for comm, slab in self.slabs.values():
            comm.deregister(slab)
        self.slabs.clear()


def array_module_for(backend: str, dtype: str = "float32") -> ArrayModule:
    if backend == "host":
        return ArrayModule("numpy")
    return ArrayModule("torch" if dtype == "bfloat16" else "cupy")


#: elements each rank sends and receives, in multiples of ``count`` (1 or the world size)
_COUNTS = {"all_gather": (1, "n"), "reduce_scatter": ("n", 1), "all_reduce": (1, 1),
           "all_to_all": ("n", "n"), "broadcast": (1, 1), "reduce": (1, 1), "gather": (1, "n"),
           "scatter": ("n", 1), "send_recv": (1, 1)}


def check_collective(comms: Sequence[Any], collective: str, *, count: int, dtype: str,
                     op: str = "sum", root: int = 0, in_place: bool = False, seed: int = 0,
                     arrays: Optional[ArrayModule] = None, streams: Optional[Sequence[Any]] = None,
                     synchronize: bool = True, rounding: Optional[float] = None,
                     scale: Optional[float] = None, local_size: Optional[int] = None) -> None:
    """Run ``collective`` on every communicator in ``comms`` and assert each output exactly.

    ``scale``: a sum's factor (reduce_scatter, all_reduce, reduce), in the reference too.
    ``local_size``: the communicators span hosts of that many ranks (``expected``'s).
    ``rounding``: for float reductions that add in another order than the reference,
    compare to a relative and absolute error of ``rounding``; unwritten elements fail.

    ``collective`` is a collective's method name, or ``"send_recv"``: a ring where every
    rank sends to rank+1 and receives from rank-1 (even ranks send first, odd ranks
    receive first: a send completes only once its receiver's stream reaches the recv).
    ``count`` is NCCL's count (see ``hoccl.sched.Shape``).  Raises AssertionError naming
    the rank, the collective and the first wrong element (``assert_exact``).  With
    ``synchronize=False`` the call is only issued, and nothing is checked.
    """
    if collective not in _COUNTS:
        raise ValueError(f"check_collective: unknown collective {collective!r}")
    n = comms[0].world_size
    arrays = arrays or array_module_for(comms[0].backend, dtype)
    rng = np.random.default_rng(seed)
    send_count, recv_count = (count * n if times == "n" else count
                              for times in _COUNTS[collective])
    inputs: List[Any] = [random_array(rng, send_count, dtype) for _ in range(n)]
    if collective in ("broadcast", "scatter"):
        inputs = [x if r == root else None for r, x in enumerate(inputs)]
    want = expected(collective, inputs, op=op, root=root, scale=scale, local_size=local_size,
                    inputs_per_launch=MAX_INPUTS if comms[0].backend == "cuda" else None)
    poisons = [POISON_BITS[dtype]]
    if any(w is not None and is_poison(w).any() for w in want):
        poisons.append(POISON_BITS[dtype] ^ ((1 << 8 * numpy_dtype(dtype).itemsize) - 1))
    for bits in poisons:
        buffers = []
        for comm in comms:
            r = comm.rank

            def make(slot: int, data: np.ndarray, comm: Any = comm) -> Any:
                if isinstance(arrays, RegisteredArrays):
                    return arrays.place(comm, slot, data)
                return arrays.asarray(data, comm.device)
            recv = make(0, poison(recv_count, dtype, bits)) if want[r] is not None else None
            send = make(1, inputs[r]) if inputs[r] is not None else None
            if in_place:
                send, recv = _in_place_buffers(collective, r, root, n, count, inputs[r], send,
                                               recv, make, dtype, bits)
            buffers.append((comm, send, recv))
        _issue(collective, buffers, op, root, streams, scale)
        if not synchronize:
            return
        for comm, _, _ in buffers:
            comm.synchronize()
        for comm, _, recv in buffers:
            if want[comm.rank] is None:
                continue
            got = arrays.to_numpy(recv, dtype)
            if rounding is None:
                assert_exact(f"{collective}: rank {comm.rank}", want[comm.rank], got, bits)
            else:
                _assert_rounded(f"{collective}: rank {comm.rank}", want[comm.rank], got, bits,
                                rounding)


def check_interleaved(steps: Sequence[Tuple[Sequence[Any], str, str]], *, count: int,
                      dtype: str, seed: int = 0) -> None:
    """Issue every step, ``(comms, collective, op)`` with ``comms`` as ``check_collective``
    takes them, one after another before anything waits; then synchronize and check
    every output exactly.

    Steps on different communicators of the same ranks (a communicator and those
    ``split`` made from it) are then in flight together: a signal slot, lane or scratch
    buffer they shared would show as a wrong or unwritten element.  Step i draws its
    inputs from ``(seed, i)``, so processes that take no part in some steps (an empty
    ``comms``: not a member of that communicator) still agree on the others' inputs.
    Collectives without a root only (and ``send_recv``)."""
    issued = []
    for index, (comms, collective, op) in enumerate(steps):
        if not comms:
            continue
        if collective not in _COUNTS or collective in ("broadcast", "reduce", "gather",
                                                       "scatter"):
            raise ValueError(f"check_interleaved: expected a collective without a root; got "
                             f"{collective!r}")
        n = comms[0].world_size
        arrays = array_module_for(comms[0].backend, dtype)
        rng = np.random.default_rng([seed, index])
        send_count, recv_count = (count * n if times == "n" else count
                                  for times in _COUNTS[collective])
        inputs = [random_array(rng, send_count, dtype) for _ in range(n)]
        want = expected(collective, inputs, op=op,
                        inputs_per_launch=MAX_INPUTS if comms[0].backend == "cuda" else None)
        buffers = [(comm, arrays.asarray(inputs[comm.rank], comm.device),
                    arrays.asarray(poison(recv_count, dtype), comm.device)) for comm in comms]
        _issue(collective, buffers, op, 0, None)
        issued.append((f"step {index} {collective} {op}", arrays, want, buffers))
    for _, _, _, buffers in issued:
        for comm, _, _ in buffers:
            comm.synchronize()
    for what, arrays, want, buffers in issued:
        for comm, _, recv in buffers:
            if want[comm.rank] is not None:
                assert_exact(f"{what}: rank {comm.rank} of {comm.world_size}", want[comm.rank],
                             arrays.to_numpy(recv, dtype))


def _assert_rounded(what: str, want: np.ndarray, got: np.ndarray, bits: int,
                    rounding: float) -> None:
    unwritten = int(np.count_nonzero(is_poison(got, bits)))
    assert unwritten == 0, f"{what}: {unwritten} of {got.size} elements unwritten"
    close = np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=rounding,
                       atol=rounding)
    if not close.all():
        index = int(np.flatnonzero(~close)[0])
        raise AssertionError(f"{what}: {int(np.count_nonzero(~close))} of {got.size} elements "
                             f"off by more than {rounding:g}; first at {index}: got "
                             f"{got[index]!r}, expected {want[index]!r}")


def _issue(collective: str, buffers: list, op: str, root: int,
           streams: Optional[Sequence[Any]], scale: Optional[float] = None) -> None:
    """Call ``collective`` with each ``(comm, send, recv)`` of ``buffers``, in that order."""
    for index, (comm, send, recv) in enumerate(buffers):
        stream = streams[index] if streams is not None else None
        if collective == "send_recv":
            n, r = comm.world_size, comm.rank
            if n > 1:
                steps = [(comm.send, send, (r + 1) % n), (comm.recv, recv, (r - 1) % n)]
                for call, buffer, peer in (steps if r % 2 == 0 else steps[::-1]):
                    call(buffer, peer, stream=stream)
        elif collective in ("broadcast", "gather", "scatter"):
            getattr(comm, collective)(send, recv, root, stream=stream)
        elif collective == "reduce":
            comm.reduce(send, recv, root, op, scale=scale, stream=stream)
        elif collective in ("reduce_scatter", "all_reduce"):
            getattr(comm, collective)(send, recv, op, scale=scale, stream=stream)
        else:
            getattr(comm, collective)(send, recv, stream=stream)


def _in_place_buffers(collective, r, root, n, count, data, send, recv, make, dtype, bits):
    """The in-place form of rank r's buffers: one array, the send data at its place in it;
    ``recv`` is the part that receives the result.  ``make(slot, data)`` makes an array."""
    if collective == "all_gather" or (collective == "gather" and r == root):
        full = poison(count * n, dtype, bits)
        full[r * count:(r + 1) * count] = data
        recv = make(2, full)
        return recv[r * count:(r + 1) * count], recv
    if collective == "gather":
        return send, None
    if collective == "reduce_scatter":
        return send, send[r * count:(r + 1) * count]
    if collective == "all_reduce" or (collective == "broadcast" and r == root):
        return send, send
    if collective == "broadcast":
        return None, recv
    if collective == "reduce":
        return (send, send) if r == root else (send, None)
    if collective == "scatter":
        return (send, send[r * count:(r + 1) * count]) if r == root else (None, recv)
    raise ValueError(f"check_collective: {collective} has no in-place form")


def nvrtc_ptx(source: str, options: Sequence[str], arch: str = "compute_90") -> bytes:
    """PTX of CUDA C++ ``source`` compiled by NVRTC for ``arch`` (no GPU needed), or
    AssertionError with the compiler's log.  Raises ImportError or OSError (as the
    bindings report a missing library) where NVRTC is not installed: a test skips then."""
    from cuda.bindings import nvrtc
    try:
        _, program = nvrtc.nvrtcCreateProgram(source.encode(), b"hoccl.cu", 0, [], [])
    except RuntimeError as error:  # the library is not found
        raise OSError(str(error)) from error
    flags = [option.encode() for option in options] + [f"--gpu-architecture={arch}".encode()]
    (status,) = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(program, log)
    assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
    _, size = nvrtc.nvrtcGetPTXSize(program)
    ptx = b" " * size
    nvrtc.nvrtcGetPTX(program, ptx)
    return ptx
