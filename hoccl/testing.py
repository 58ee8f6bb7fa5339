"""Reference semantics and a checker shared by the tests, the examples and the benchmarks.

``expected(...)`` is the naive numpy program each collective must equal.
``check_collective(...)`` runs one collective on real communicators (every rank in
this process for ``init_local``, or this process's rank under mpirun) with fresh
random inputs drawn from ``seed`` (the same on every process) and poisoned outputs,
and compares each local rank's output with ``expected``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from ._dtypes import numpy_dtype, reduce_arrays

__all__ = ["expected", "random_array", "poison", "check_collective", "ArrayModule",
           "array_module_for", "IN_PLACE_FORMS"]

#: collectives that have an in-place form
IN_PLACE_FORMS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "gather",
                  "scatter")


def random_array(rng: np.random.Generator, count: int, dtype: str) -> np.ndarray:
    """Fresh random values: small integers for integer types (sums stay exact), normals for floats."""
    np_dtype = numpy_dtype(dtype)
    if np_dtype.kind in "iu":
        low, high = (0, 8) if np_dtype.kind == "u" else (-8, 8)
        return rng.integers(low, high, count).astype(np_dtype)
    return rng.standard_normal(count).astype(np.float32).astype(np_dtype)


def poison(count: int, dtype: str) -> np.ndarray:
    """An array whose every byte is 0xA5: NaN-like for floats, an unlikely integer otherwise."""
    return np.full(count * numpy_dtype(dtype).itemsize, 0xA5, np.uint8).view(numpy_dtype(dtype))


def expected(collective: str, inputs: Sequence[Optional[np.ndarray]], *, op: str = "sum",
             root: int = 0) -> List[Optional[np.ndarray]]:
    """What each rank's receive buffer must hold; ``inputs[r]`` is rank r's send data
    (None where a rank sends nothing).  None where a rank receives nothing."""
    n = len(inputs)
    dtype = next(x for x in inputs if x is not None).dtype
    if collective == "all_gather":
        return [np.concatenate(inputs) for _ in range(n)]
    if collective == "all_reduce":
        total = reduce_arrays(list(inputs), op, dtype)
        return [total.copy() for _ in range(n)]
    if collective == "reduce_scatter":
        count = inputs[0].size // n
        return [reduce_arrays([x[r * count:(r + 1) * count] for x in inputs], op, dtype)
                for r in range(n)]
    if collective == "all_to_all":
        count = inputs[0].size // n
        return [np.concatenate([inputs[p][r * count:(r + 1) * count] for p in range(n)])
                for r in range(n)]
    if collective == "broadcast":
        return [inputs[root].copy() for _ in range(n)]
    if collective == "reduce":
        return [reduce_arrays(list(inputs), op, dtype) if r == root else None for r in range(n)]
    if collective == "gather":
        return [np.concatenate(inputs) if r == root else None for r in range(n)]
    if collective == "scatter":
        count = inputs[root].size // n
        return [inputs[root][r * count:(r + 1) * count].copy() for r in range(n)]
    raise ValueError(f"expected: unknown collective {collective!r}")


class ArrayModule:
    """Allocates test arrays for a backend: numpy on the host, cupy or torch on GPUs."""

    def __init__(self, kind: str = "numpy"):
        self.kind = kind

    def asarray(self, data: np.ndarray, device: Optional[int]) -> Any:
        if self.kind == "numpy":
            return np.ascontiguousarray(data).copy()
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

    def to_numpy(self, array: Any, dtype: str) -> np.ndarray:
        if self.kind == "numpy":
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


def array_module_for(backend: str, dtype: str = "float32") -> ArrayModule:
    if backend == "host":
        return ArrayModule("numpy")
    return ArrayModule("torch" if dtype == "bfloat16" else "cupy")


def _tolerance(dtype: str, op: str, world_size: int) -> tuple:
    np_dtype = numpy_dtype(dtype)
    if np_dtype.kind in "iu" or op in ("max", "min"):
        return 0.0, 0.0
    eps = {2: 1e-2, 4: 1e-5, 8: 1e-12}[np_dtype.itemsize]
    return eps * world_size, eps * world_size


def check_collective(comms: Sequence[Any], collective: str, *, count: int, dtype: str,
                     op: str = "sum", root: int = 0, in_place: bool = False, seed: int = 0,
                     arrays: Optional[ArrayModule] = None, streams: Optional[Sequence[Any]] = None,
                     synchronize: bool = True) -> None:
    """Run ``collective`` on every communicator in ``comms`` and assert each output.

    ``count`` is NCCL's count (see ``hoccl.sched.Shape``).  Raises AssertionError
    naming the rank, the collective and the first wrong element.
    """
    n = comms[0].world_size
    arrays = arrays or array_module_for(comms[0].backend, dtype)
    rng = np.random.default_rng(seed)
    send_count = {"all_gather": count, "reduce_scatter": count * n, "all_reduce": count,
                  "all_to_all": count * n, "broadcast": count, "reduce": count, "gather": count,
                  "scatter": count * n}[collective]
    recv_count = {"all_gather": count * n, "reduce_scatter": count, "all_reduce": count,
                  "all_to_all": count * n, "broadcast": count, "reduce": count,
                  "gather": count * n, "scatter": count}[collective]
    inputs = [random_array(rng, send_count, dtype) for _ in range(n)]
    if collective in ("broadcast", "scatter"):
        inputs = [x if r == root else None for r, x in enumerate(inputs)]
    want = expected(collective, inputs, op=op, root=root)
    outputs = []
    for index, comm in enumerate(comms):
        r, device = comm.rank, comm.device
        receives = want[r] is not None or (collective == "scatter" and r == root)
        recv = arrays.asarray(poison(recv_count, dtype), device) if receives else None
        send = arrays.asarray(inputs[r], device) if inputs[r] is not None else None
        if in_place:
            send, recv = _in_place_buffers(collective, r, root, n, count, inputs[r], send, recv,
                                           arrays, device, dtype)
        outputs.append((comm, send, recv))
    for index, (comm, send, recv) in enumerate(outputs):
        stream = streams[index] if streams is not None else None
        call = getattr(comm, collective)
        if collective in ("broadcast", "reduce", "gather", "scatter"):
            if collective == "reduce":
                call(send, recv, root, op, stream=stream)
            else:
                call(send, recv, root, stream=stream)
        elif collective in ("reduce_scatter", "all_reduce"):
            call(send, recv, op, stream=stream)
        else:
            call(send, recv, stream=stream)
    if not synchronize:
        return
    for comm, _, _ in outputs:
        comm.synchronize()
    rtol, atol = _tolerance(dtype, op, n)
    for comm, send, recv in outputs:
        r = comm.rank
        if want[r] is None:
            continue
        got_array = recv
        if in_place and collective == "reduce_scatter":
            got = arrays.to_numpy(send, dtype)[r * count:(r + 1) * count]
        elif in_place and collective == "scatter" and r == root:
            got = arrays.to_numpy(send, dtype)[r * count:(r + 1) * count]
        else:
            got = arrays.to_numpy(got_array, dtype)
        _assert_close(collective, r, want[r], got, rtol, atol)


def _in_place_buffers(collective, r, root, n, count, data, send, recv, arrays, device, dtype):
    """The in-place form of rank r's buffers: one array, the send data at its place in it."""
    if collective == "all_gather":
        full = poison(count * n, dtype)
        full[r * count:(r + 1) * count] = data
        recv = arrays.asarray(full, device)
        return recv[r * count:(r + 1) * count], recv
    if collective == "reduce_scatter":
        return send, send[r * count:(r + 1) * count]
    if collective == "all_reduce":
        return send, send
    if collective == "broadcast":
        if r == root:
            return send, send
        return None, recv
    if collective == "reduce":
        return (send, send) if r == root else (send, None)
    if collective == "gather":
        if r != root:
            return send, None
        full = poison(count * n, dtype)
        full[r * count:(r + 1) * count] = data
        recv = arrays.asarray(full, device)
        return recv[r * count:(r + 1) * count], recv
    if collective == "scatter":
        if r != root:
            return None, recv
        return send, send[r * count:(r + 1) * count]
    raise ValueError(f"check_collective: {collective} has no in-place form")


def _assert_close(collective: str, rank: int, want: np.ndarray, got: np.ndarray,
                  rtol: float, atol: float) -> None:
    if want.shape != got.shape:
        raise AssertionError(f"{collective}: rank {rank} output has {got.size} elements, "
                             f"expected {want.size}")
    w = want.astype(np.float64) if want.dtype.kind not in "iu" else want
    g = got.astype(np.float64) if got.dtype.kind not in "iu" else got
    if rtol == 0 and atol == 0:
        bad = np.flatnonzero(~((w == g) | (np.isnan(w) & np.isnan(g)) if w.dtype.kind == "f"
                               else (w == g)))
    else:
        bad = np.flatnonzero(~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True))
    if bad.size:
        i = int(bad[0])
        raise AssertionError(f"{collective}: rank {rank} has {bad.size} wrong elements of "
                             f"{want.size}; first at {i}: got {got[i]!r}, expected {want[i]!r}")
