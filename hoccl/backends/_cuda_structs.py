"""ctypes mirrors of the kernel argument structs of ``_kernels`` (``ReduceArgs``,
``ChunkArgs``, ``CopyArgs``, ``DirectOp``, ``DirectInput``, ``DirectArgs``), passed by value
to the launches, and ``_pack_direct``, which fills ``DirectArgs`` from a direct program."""

from __future__ import annotations

import ctypes
from typing import Any, List, Tuple

from .._errors import InvalidArgumentError
from . import _kernels
from ._base import DIRECT_COPY, DIRECT_REDUCE, DIRECT_SIGNAL, DIRECT_WAIT, DirectProgram


class _ReduceArgs(ctypes.Structure):
    """Mirror of ``ReduceArgs`` in ``_kernels``; passed by value to every reduce launch."""
    _fields_ = [("output", ctypes.c_void_p),
                ("inputs", ctypes.c_void_p * _kernels.MAX_INPUTS),
                ("count", ctypes.c_uint64),
                ("head", ctypes.c_uint64),
                ("vectors", ctypes.c_uint64),
                ("num_inputs", ctypes.c_uint32),
                ("divisor", ctypes.c_uint32),
                ("scaled", ctypes.c_uint32),
                ("scale", ctypes.c_double)]


class _ChunkArgs(ctypes.Structure):
    """Mirror of ``ChunkArgs`` in ``_kernels``: ``reduce_chunks``'s one launch."""
    _fields_ = [("first", _ReduceArgs),
                ("flags", ctypes.c_void_p * _kernels.CHUNK_FLAGS),
                ("num_flags", ctypes.c_uint64),
                ("value", ctypes.c_uint64),
                ("chunks", ctypes.c_uint64),
                ("stride", ctypes.c_uint64),
                ("last_count", ctypes.c_uint64),
                ("last_vectors", ctypes.c_uint64)]


class _CopyArgs(ctypes.Structure):
    """Mirror of ``CopyArgs`` in ``_kernels``."""
    _fields_ = [("dst", ctypes.c_void_p),
                ("src", ctypes.c_void_p),
                ("nbytes", ctypes.c_uint64),
                ("head", ctypes.c_uint64)]


class _DirectOp(ctypes.Structure):
    """Mirror of ``DirectOp`` in ``_kernels``."""
    _fields_ = [("a", ctypes.c_uint64), ("b", ctypes.c_uint64), ("c", ctypes.c_uint64),
                ("sa", ctypes.c_uint64), ("sb", ctypes.c_uint64),
                ("kind", ctypes.c_uint32), ("n", ctypes.c_uint32)]


class _DirectInput(ctypes.Structure):
    """Mirror of ``DirectInput`` in ``_kernels``."""
    _fields_ = [("address", ctypes.c_uint64), ("shift", ctypes.c_uint64)]


class _DirectArgs(ctypes.Structure):
    """Mirror of ``DirectArgs`` in ``_kernels``."""
    _fields_ = [("counter", ctypes.c_uint64),
                ("completion", ctypes.c_uint64),
                ("host_word", ctypes.c_uint64),
                ("value", ctypes.c_uint64),
                ("error", ctypes.c_uint64),
                ("signature", ctypes.c_uint64),
                ("sig_shift", ctypes.c_uint64),
                ("sig_half", ctypes.c_uint64),
                ("num_ops", ctypes.c_uint32),
                ("divisor", ctypes.c_uint32),
                ("scaled", ctypes.c_uint32),
                ("unused", ctypes.c_uint32),
                ("scale", ctypes.c_double),
                ("ops", _DirectOp * _kernels.DIRECT_OPS),
                ("inputs", _DirectInput * _kernels.DIRECT_INPUTS)]


def _pack_direct(program: DirectProgram) -> Tuple[_DirectArgs, Any]:
    """``program`` as the kernel's argument struct and the launch's parameter array."""
    ops = program.ops
    if len(ops) > _kernels.DIRECT_OPS:
        raise InvalidArgumentError(f"direct: a direct kernel takes at most {_kernels.DIRECT_OPS} "
                                   f"steps, the plan has {len(ops)}; lower kernel_bytes")
    args = _DirectArgs()
    args.counter = int(program.counter)
    args.completion = int(program.completion or 0)
    args.host_word = int(program.host_word or 0)
    args.error = int(program.error or 0)
    args.signature = program.signature
    args.sig_shift, args.sig_half = program.signature_shift, program.signature_half
    args.num_ops = len(ops)
    divisor = 1
    inputs: List[Tuple[int, int]] = []
    for index, op in enumerate(ops):
        entry = args.ops[index]
        entry.kind = op[0]
        if op[0] in (DIRECT_SIGNAL, DIRECT_WAIT):
            entry.a, entry.c = int(op[1]), op[2]
        elif op[0] == DIRECT_COPY:
            entry.a, entry.b, entry.c, entry.sa, entry.sb = (int(op[1]), int(op[2]), op[3],
                                                             op[4], op[5])
        else:
            assert op[0] == DIRECT_REDUCE
            entry.a, entry.b, entry.c, entry.n, entry.sa = (int(op[1]), len(inputs), op[3],
                                                            len(op[2]), op[4])
            inputs.extend((int(address), shift) for address, shift in op[2])
            divisor = len(op[2])
    if len(inputs) > _kernels.DIRECT_INPUTS:
        raise InvalidArgumentError(f"direct: a direct kernel reads at most "
                                   f"{_kernels.DIRECT_INPUTS} inputs, the plan has "
                                   f"{len(inputs)}; lower kernel_bytes")
    for index, (address, shift) in enumerate(inputs):
        args.inputs[index].address, args.inputs[index].shift = address, shift
    args.divisor = divisor
    args.scaled = program.scale is not None
    args.scale = 1.0 if program.scale is None else program.scale
    parameters = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    return args, parameters
