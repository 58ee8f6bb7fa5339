"""The cuda backend's SM work: the kernels of ``_kernels.source()`` loaded in a GPU's
primary context, and ``CudaDevice``'s launches (the direct kernel, the capped same-GPU
copy, the reductions), which it takes from ``_SmWork``."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from cuda.bindings import driver

from .._dtypes import ITEMSIZE as _ITEMSIZE
from .._errors import DriverError, InvalidArgumentError
from . import _kernels
from ._base import DTYPES, OPS, DirectProgram, check_reduce_extras
from ._cuda_driver import _ACTIVE, _call, _keep
from ._cuda_structs import _ChunkArgs, _CopyArgs, _pack_direct, _ReduceArgs

#: the most argument lists of ``reduce`` (and of ``local_copy``) a device keeps launches for
#: (``_reduce_launches``, ``_copy_launches``)
_REDUCE_LAUNCHES = 256


def _function(module: Any, name: str) -> Any:
    """``name`` from a cupy ``RawModule``, loaded onto the GPU now.

    Under CUDA's lazy loading a kernel may otherwise be loaded at its first launch, and a
    load may synchronize the context: inside a collective, with this GPU's copy lanes
    waiting on a peer that is itself still issuing, that wait would never end."""
    function = driver.CUfunction(module.get_function(name).kernel.ptr)
    if hasattr(driver, "cuFuncLoad"):  # CUDA >= 12.4
        _call(driver.cuFuncLoad, function)
    return function


class _Kernels:
    """The kernels of ``_kernels.source()`` in one GPU's primary context.

    cupy's ``RawModule`` compiles them with NVRTC for the GPU's architecture and keeps
    the binary in its on-disk kernel cache (``CUPY_CACHE_DIR``, ``~/.cupy/kernel_cache``
    by default) keyed by source, options and compiler; the loaded module lives as long
    as the process, like cupy's own kernels.
    """

    def __init__(self, ordinal: int):
        try:
            import cupy
        except ImportError as error:
            raise DriverError(
                "compile kernels: hoccl's reduction and copy kernels are built with cupy, "
                "which is not installed: pip install 'hoccl[cuda]'") from error
        with cupy.cuda.Device(ordinal):
            module = cupy.RawModule(code=_kernels.source(),
                                    options=tuple(_kernels.compile_options()))
            try:
                self.reduce = {(dtype, op): _function(module, _kernels.reduce_kernel_name(dtype, op))
                               for dtype in DTYPES for op in OPS}
                self.reduce_chunks = {
                    (dtype, op): _function(module, _kernels.reduce_chunks_kernel_name(dtype, op))
                    for dtype in DTYPES for op in OPS}
                self.copy = {width: _function(module, _kernels.copy_kernel_name(width))
                             for width in _kernels.COPY_WIDTHS}
            except cupy.cuda.compiler.CompileException as error:
                raise DriverError(f"compile kernels: NVRTC failed: {error}") from error
        self.module = module
        _ACTIVE.context = None  # cupy restored its own current device: set ours again


class _SmWork:
    """``CudaDevice``'s kernel launches (the state they use is the device's)."""

    ordinal: int
    sm_count: int
    max_sms: int
    copy_sms: int
    _owned: Any
    _kernel_lock: threading.Lock
    _make_current: Callable[[], None]
    #: a ``reduce`` argument list -> its launches (``_reduce_launches_of``), oldest first out
    _reduce_launches: Dict[tuple, List[tuple]]
    _copy_launches: Dict[tuple, tuple]

    def _kernels(self) -> _Kernels:
        kernels = self._owned.kernels
        if kernels is None:
            with self._kernel_lock:
                if self._owned.kernels is None:
                    self._make_current()
                    self._owned.kernels = _Kernels(self.ordinal)
                kernels = self._owned.kernels
        return kernels

    def prepare_direct(self, dtype: str, op: str) -> None:
        """Compile (NVRTC through cupy, cached on disk) and load the direct kernel of
        ``dtype`` and ``op``, once per device."""
        key = (dtype, op)
        if key in self._owned.direct:
            return
        try:
            import cupy
        except ImportError as error:
            raise DriverError("compile kernels: hoccl's direct kernel is built with cupy, "
                              "which is not installed: pip install 'hoccl[cuda]'") from error
        with self._kernel_lock:
            if key in self._owned.direct:
                return
            self._make_current()
            with cupy.cuda.Device(self.ordinal):
                module = cupy.RawModule(code=_kernels.direct_source(dtype, op),
                                        options=tuple(_kernels.direct_compile_options()))
                try:
                    function = _function(module, _kernels.direct_kernel_name(dtype, op))
                except cupy.cuda.compiler.CompileException as error:
                    raise DriverError(f"compile kernels: NVRTC failed: {error}") from error
            _ACTIVE.context = None  # cupy restored its own current device: set ours again
            self._owned.direct[key] = (module, function)

    def direct(self, stream: Any, program: DirectProgram, value: int = 0) -> None:
        """One launch of the direct kernel: ``program.blocks`` blocks, its steps packed
        once into the argument struct (passed by value: the driver copies it during the
        call, so the call's completion value is set in place)."""
        packed = program.packed
        if packed is None:
            packed = program.packed = _pack_direct(program)
        packed[0].value = value
        entry = self._owned.direct.get((program.dtype, program.op))
        if entry is None:  # prepared by ``Executor.reserve``; here only if that was skipped
            self.prepare_direct(program.dtype, program.op)
            entry = self._owned.direct[(program.dtype, program.op)]
        self._make_current()
        _call(driver.cuLaunchKernel, entry[1], program.blocks, 1, 1, _kernels.DIRECT_THREADS,
              1, 1, 0, stream, ctypes.addressof(packed[1]), 0)

    def _blocks(self, work_items: int, threads: int, cap: int) -> int:
        return max(1, min(cap, self.sm_count, -(-work_items // threads)))

    def _launch(self, function: Any, blocks: int, threads: int, stream: Any,
                args: ctypes.Structure) -> None:
        # The driver copies the argument struct during the call: no lifetime to manage.
        parameters = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        _call(driver.cuLaunchKernel, function, blocks, 1, 1, threads, 1, 1, 0, stream,
              ctypes.addressof(parameters), 0)

    def local_copy(self, stream: Any, dst: Any, src: Any, nbytes: int,
                   sms: Optional[int] = None) -> None:
        """A same-GPU copy on at most ``sms`` (default ``copy_sms``) SMs (``cuMemcpyAsync``
        would take them all).  Its launch is kept per argument list, as ``reduce``'s: a
        repeated call's copy is one driver call."""
        if not nbytes:
            return
        key = (int(dst), int(src), nbytes, self.copy_sms if sms is None else sms)
        launch = self._copy_launches.get(key)
        if launch is None:
            launch = _keep(self._copy_launches, key, self._copy_launch_of(*key),
                           _REDUCE_LAUNCHES)
        function, blocks, threads, parameters, _ = launch
        self._make_current()
        _call(driver.cuLaunchKernel, function, blocks, 1, 1, threads, 1, 1, 0, stream,
              ctypes.addressof(parameters), 0)

    def _copy_launch_of(self, dst: int, src: int, nbytes: int, sms: int) -> tuple:
        """(function, blocks, threads, parameter array, the argument struct it points to)
        of one ``local_copy``: the widest access both addresses allow, after a head of
        bytes that brings ``dst`` to it."""
        width = next(width for width in _kernels.COPY_WIDTHS if dst % width == src % width)
        head = min(nbytes, -dst % width)
        kernels = self._kernels()
        threads = _kernels.TUNING["copy_threads"]
        blocks = self._blocks((nbytes - head) // width, threads, sms)
        args = _CopyArgs(dst, src, nbytes, head)
        parameters = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        return kernels.copy[width], blocks, threads, parameters, args

    def reduce(self, stream: Any, output: Any, inputs: Sequence[Any], count: int,
               dtype: str, op: str, divisor: Optional[int] = None,
               sms: Optional[int] = None, scale: Optional[float] = None) -> None:
        """``output = op(*inputs)`` on at most ``sms`` (default ``max_sms``) SMs; ``output``
        may be an input.  ``avg`` divides by ``divisor`` (default: the number of inputs);
        a ``sum`` with ``scale`` is multiplied by it before rounding.

        Up to 64 inputs per launch; more are chained (the output joins the next launch
        as its first input; ``avg`` sums until the last launch divides by the total, and
        only the last launch scales).
        The first launch overwrites ``output``: when an input equal to it lies beyond the
        first launch, the inputs equal to ``output`` are moved to the front, so that the
        first launch reads them (``_kernels.reduce_launches``).
        """
        key = (int(output), tuple(int(address) for address in inputs), count, dtype, op,
               divisor, self.max_sms if sms is None else sms, scale)
        launches = self._reduce_launches.get(key)
        if launches is None:
            launches = _keep(self._reduce_launches, key,
                             self._reduce_launches_of(output, inputs, count, dtype, op, divisor,
                                                      sms, scale),
                             _REDUCE_LAUNCHES)
        if launches:
            self._make_current()
        for function, blocks, threads, parameters, _ in launches:
            _call(driver.cuLaunchKernel, function, blocks, 1, 1, threads, 1, 1, 0, stream,
                  ctypes.addressof(parameters), 0)

    def _reduce_launches_of(self, output: Any, inputs: Sequence[Any], count: int, dtype: str,
                            op: str, divisor: Optional[int], sms: Optional[int],
                            scale: Optional[float]) -> List[tuple]:
        """The launches of one ``reduce`` (its arguments checked): (function, blocks,
        threads, parameter array, the argument struct it points to) each.  Kept per
        argument list (``_reduce_launches``): a repeated call's sums launch without
        building their structs again (the driver copies them at each launch)."""
        if dtype not in _ITEMSIZE:
            raise InvalidArgumentError(f"reduce: expected dtype in {DTYPES}, got {dtype!r}")
        if op not in OPS:
            raise InvalidArgumentError(f"reduce: expected op in {OPS}, got {op!r}")
        if not inputs:
            raise InvalidArgumentError("reduce: expected at least one input, got none")
        check_reduce_extras(op, dtype, divisor, scale)
        if divisor is None:
            divisor = len(inputs)
        if not count:
            return []
        itemsize = _ITEMSIZE[dtype]
        output = int(output)
        inputs = [int(address) for address in inputs]
        misaligned = [address for address in [output] + inputs if address % itemsize]
        if misaligned:
            raise InvalidArgumentError(
                f"reduce: expected addresses aligned to the {itemsize}-byte {dtype} elements, "
                f"got {', '.join(f'{address:#x}' for address in misaligned)}")
        launches = _kernels.reduce_launches(output, inputs)
        kernels = self._kernels()
        last = len(launches) - 1
        built = []
        for index, launch_inputs in enumerate(launches):
            kernel_op = "sum" if op == "avg" and index < last else op
            args, blocks, threads = self._reduce_arguments(
                output, launch_inputs, count, itemsize, divisor,
                self.max_sms if sms is None else sms, scale if index == last else None)
            parameters = (ctypes.c_void_p * 1)(ctypes.addressof(args))
            built.append((kernels.reduce[dtype, kernel_op], blocks, threads, parameters, args))
        return built

    def reduce_chunks(self, stream: Any, flags: Sequence[Any], value: int, output: Any,
                      inputs: Sequence[Any], count: int, last_count: int, chunks: int,
                      stride: int, dtype: str, op: str, sms: Optional[int] = None,
                      scale: Optional[float] = None) -> None:
        """``Device.reduce_chunks`` as one launch of ``hoccl_reduce_chunks_*``: its blocks
        wait on the device for each chunk's signal (``_kernels.ChunkArgs``)."""
        if dtype not in _ITEMSIZE or op not in OPS:
            raise InvalidArgumentError(f"reduce_chunks: expected dtype in {DTYPES} and op in "
                                       f"{OPS}, got {dtype!r}, {op!r}")
        itemsize = _ITEMSIZE[dtype]
        if (not inputs or len(inputs) > _kernels.MAX_INPUTS or (stride * itemsize) % 16
                or not 0 < len(flags) <= _kernels.CHUNK_FLAGS):
            raise InvalidArgumentError(
                f"reduce_chunks: expected 1 to {_kernels.MAX_INPUTS} inputs, 1 to "
                f"{_kernels.CHUNK_FLAGS} flags and a stride of whole 16-byte vectors, got "
                f"{len(inputs)} inputs, {len(flags)} flags and {stride} elements of "
                f"{itemsize} bytes")
        check_reduce_extras(op, dtype, None, scale)
        if not chunks or not count:
            return
        output = int(output)
        inputs = [int(address) for address in inputs]
        first, blocks, threads = self._reduce_arguments(
            output, inputs, count, itemsize, len(inputs), self.max_sms if sms is None else sms,
            scale)
        if first.vectors:
            lead = min(last_count, first.head)
            last_vectors = (last_count - lead) * itemsize // 16
        else:  # mutually misaligned: element by element, in every chunk alike
            last_vectors = 0
        args = _ChunkArgs(first, (ctypes.c_void_p * _kernels.CHUNK_FLAGS)(*map(int, flags)),
                          len(flags), value, chunks, stride, last_count, last_vectors)
        self._make_current()
        self._launch(self._kernels().reduce_chunks[dtype, op], blocks, threads, stream, args)

    def _reduce_arguments(self, output: int, inputs: list, count: int, itemsize: int,
                          divisor: int, sms: int, scale: Optional[float] = None,
                          threads: Optional[int] = None) -> Tuple[_ReduceArgs, int, int]:
        """``(argument struct, blocks, threads)`` of one reduce launch: the struct the
        kernel receives by value and its grid, capped at ``sms`` blocks of ``threads``
        (default ``TUNING["reduce_threads"]``).  Apart from the launch so that programs
        that build kernels on ``reduce_body`` (``benchmarks/levers.py``) size them alike."""
        if threads is None:
            threads = _kernels.TUNING["reduce_threads"]
        offset = output % 16
        if all(address % 16 == offset for address in inputs):
            head = min(count, (-output % 16) // itemsize)
            vectors = (count - head) * itemsize // 16
        else:  # mutually misaligned: element by element
            head, vectors = count, 0
        scalars = count - vectors * 16 // itemsize
        args = _ReduceArgs(output, (ctypes.c_void_p * _kernels.MAX_INPUTS)(*inputs), count,
                           head, vectors, len(inputs), divisor, scale is not None,
                           1.0 if scale is None else scale)
        return args, self._blocks(max(vectors, scalars), threads, sms), threads

    def _launch_reduce(self, function: Any, stream: Any, output: int, inputs: list, count: int,
                       itemsize: int, divisor: int, sms: int,
                       scale: Optional[float] = None, threads: Optional[int] = None) -> None:
        args, blocks, threads = self._reduce_arguments(output, inputs, count, itemsize, divisor,
                                                       sms, scale, threads)
        self._launch(function, blocks, threads, stream, args)
