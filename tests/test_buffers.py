"""Buffer resolution: every dtype through every array interface, read-only memory, bool,
contiguity, and error messages that name the call and the argument.

CUDA arrays are emulated on host memory: objects exposing ``__cuda_array_interface__``, and
DLPack producers that build their capsules here with ctypes from the struct layouts of
dlpack.h (written out independently of hoccl's reader) and say the memory is on a GPU.
"""

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from hoccl._buffers import as_buffer
from hoccl._dtypes import ITEMSIZE, NAMES, numpy_dtype
from hoccl._errors import InvalidArgumentError
from hoccl.testing import random_array

#: (type code, bits) of each dtype in dlpack.h's DLDataType
DLPACK_TYPES = {"float16": (2, 16), "bfloat16": (4, 16), "float32": (2, 32), "float64": (2, 64),
                "int8": (0, 8), "uint8": (1, 8), "int32": (0, 32), "int64": (0, 64),
                "bool": (6, 8)}
CPU, CUDA = 1, 2
READ_ONLY, IS_COPIED = 1, 2


def _rng():
    return np.random.default_rng()


def _torch():
    """torch when it is installed, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _host_array(rng, dtype: str, shape=None) -> np.ndarray:
    shape = shape or (int(rng.integers(1, 5)), int(rng.integers(1, 7)))
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    return random_array(rng, int(np.prod(shape)), dtype).reshape(shape)


# -- emulated producers ------------------------------------------------------------------
class FakeCudaArray:
    """``__cuda_array_interface__`` (version 3) over host memory, built from numpy's own
    ``__array_interface__``; ``ordinal`` becomes a cupy-like ``device.id``."""

    class _Device:
        def __init__(self, ordinal):
            self.id = ordinal

    def __init__(self, array: np.ndarray, *, read_only=False, strides=None, ordinal=None,
                 typestr=None):
        self.array = array
        source = array.__array_interface__
        self.__cuda_array_interface__ = {
            "shape": source["shape"], "typestr": typestr or source["typestr"],
            "data": (source["data"][0], read_only), "version": 3,
            "strides": strides if strides is not None else source["strides"]}
        if ordinal is not None:
            self.device = self._Device(ordinal)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", _DLTensor)]


_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
# a capsule keeps the pointer to its name: these outlive every capsule
_VERSIONED_NAME = ctypes.create_string_buffer(b"dltensor_versioned")
_LEGACY_NAME = ctypes.create_string_buffer(b"dltensor")
_USED_NAME = ctypes.create_string_buffer(b"used_dltensor_versioned")


class FakeDLPack:
    """A DLPack 1.0 producer over ``array``'s memory that reports ``device`` (CUDA GPU 0 by
    default) and the DLDataType ``code``/``bits``/``lanes``.  Its capsules have no
    destructor: the structs live as long as the producer.  ``requests`` records the
    keyword arguments of every ``__dlpack__`` call."""

    def __init__(self, array: np.ndarray, dtype: str, *, device=(CUDA, 0), flags=0,
                 strides=None, byte_offset=0, version=(1, 0), lanes=1):
        self.array, self.device, self.flags, self.version = array, device, flags, version
        self.code, self.bits = DLPACK_TYPES[dtype]
        self.lanes, self.byte_offset = lanes, byte_offset
        itemsize = array.dtype.itemsize
        self.shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        element_strides = strides if strides is not None else [s // itemsize for s in array.strides]
        self.strides = (ctypes.c_int64 * array.ndim)(*element_strides)
        self.requests = []
        self.capsule_name = _VERSIONED_NAME

    def __dlpack_device__(self):
        return self.device

    def _tensor(self) -> _DLTensor:
        return _DLTensor(self.array.ctypes.data - self.byte_offset, _DLDevice(*self.device),
                         self.array.ndim, _DLDataType(self.code, self.bits, self.lanes),
                         self.shape, self.strides, self.byte_offset)

    def __dlpack__(self, *, stream=None, max_version=None, copy=None):
        self.requests.append({"stream": stream, "max_version": max_version, "copy": copy})
        assert max_version is not None and max_version[0] >= 1
        self.managed = _DLManagedTensorVersioned(_DLPackVersion(*self.version), None, None,
                                                 self.flags, self._tensor())
        return _capsule_new(ctypes.addressof(self.managed), self.capsule_name, None)


class LegacyDLPack(FakeDLPack):
    """A producer older than DLPack 1.0: ``__dlpack__(stream=None)`` only, an unversioned
    ``DLManagedTensor`` without flags."""

    def __dlpack__(self, stream=None):
        self.requests.append({"stream": stream})
        self.managed = _DLManagedTensor(self._tensor(), None, None)
        return _capsule_new(ctypes.addressof(self.managed), _LEGACY_NAME, None)


class DLPackOnly:
    """Hides every interface of ``inner`` but DLPack (numpy arrays and torch tensors would
    be recognised as themselves)."""

    def __init__(self, inner):
        self.inner = inner

    def __dlpack__(self, **kwargs):
        return self.inner.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()


# -- every dtype through every interface ---------------------------------------------------
@pytest.mark.parametrize("dtype", NAMES)
def test_numpy_arrays_resolve_to_their_address_count_and_dtype(dtype):
    array = _host_array(_rng(), dtype)
    buffer = as_buffer("all_gather", "recvbuf", array)
    assert (buffer.address, buffer.count, buffer.dtype, buffer.device) == \
        (array.ctypes.data, array.size, dtype, None)
    assert buffer.owner is array and buffer.nbytes == array.nbytes


def test_numpy_dtype_aliases_resolve_to_the_same_name():
    assert as_buffer("c", "a", np.zeros(3, np.longlong)).dtype == "int64"
    assert as_buffer("c", "a", np.zeros(3, np.intc)).dtype == "int32"
    assert as_buffer("c", "a", np.zeros(3, np.half)).dtype == "float16"
    assert as_buffer("c", "a", np.zeros(3, np.double)).dtype == "float64"


@pytest.mark.parametrize("dtype", NAMES)
def test_cuda_array_interface_resolves_every_dtype(dtype):
    rng = _rng()
    array = _host_array(rng, dtype)
    ordinal = int(rng.integers(0, 8))
    buffer = as_buffer("all_reduce", "recvbuf", FakeCudaArray(array, ordinal=ordinal))
    assert (buffer.address, buffer.count, buffer.dtype, buffer.device) == \
        (array.ctypes.data, array.size, dtype, ordinal)


def test_cuda_array_interface_without_a_device_resolves_to_no_device():
    array = _host_array(_rng(), "float32")
    assert as_buffer("all_reduce", "recvbuf", FakeCudaArray(array)).device is None


@pytest.mark.parametrize("dtype", NAMES)
@pytest.mark.parametrize("producer", [FakeDLPack, LegacyDLPack])
def test_dlpack_resolves_every_dtype(dtype, producer):
    rng = _rng()
    array = _host_array(rng, dtype)
    ordinal = int(rng.integers(0, 8))
    fake = producer(array, dtype, device=(CUDA, ordinal))
    buffer = as_buffer("broadcast", "recvbuf", fake)
    assert (buffer.address, buffer.count, buffer.dtype, buffer.device) == \
        (array.ctypes.data, array.size, dtype, ordinal)
    assert buffer.owner[0] is fake


def test_dlpack_export_stays_alive_with_the_buffer():
    array = _host_array(_rng(), "float32")
    buffer = as_buffer("c", "a", DLPackOnly(array))
    exported = buffer.owner[1]
    assert ctypes.pythonapi.PyCapsule_IsValid(ctypes.py_object(exported), b"dltensor_versioned")


def test_dlpack_on_the_host_resolves_to_no_device():
    array = _host_array(_rng(), "int32")
    buffer = as_buffer("broadcast", "recvbuf", FakeDLPack(array, "int32", device=(CPU, 0)))
    assert (buffer.address, buffer.device) == (array.ctypes.data, None)


def test_dlpack_byte_offset_is_added_to_the_data_pointer():
    array = _host_array(_rng(), "float64")
    buffer = as_buffer("c", "a", FakeDLPack(array, "float64", byte_offset=24))
    assert buffer.address == array.ctypes.data


def test_dlpack_request_asks_for_no_synchronisation_and_no_copy():
    array = _host_array(_rng(), "float32")
    on_gpu, on_host = FakeDLPack(array, "float32"), FakeDLPack(array, "float32", device=(CPU, 0))
    legacy = LegacyDLPack(array, "float32")
    for fake in (on_gpu, on_host, legacy):
        as_buffer("c", "a", fake)
    assert on_gpu.requests == [{"stream": -1, "max_version": (1, 0), "copy": False}]
    assert on_host.requests == [{"stream": None, "max_version": (1, 0), "copy": False}]
    assert legacy.requests == [{"stream": -1}]


@pytest.mark.parametrize("dtype", [d for d in NAMES if d != "bfloat16"])
def test_numpy_as_a_dlpack_producer_resolves_every_dtype_it_exports(dtype):
    array = _host_array(_rng(), dtype)
    buffer = as_buffer("all_gather", "recvbuf", DLPackOnly(array))
    assert (buffer.address, buffer.count, buffer.dtype, buffer.device) == \
        (array.ctypes.data, array.size, dtype, None)


def _torch_tensor(torch, dtype: str):
    """A CPU tensor of fresh random values (made through bytes: numpy has no bfloat16 for
    torch.from_numpy)."""
    return torch.from_numpy(_host_array(_rng(), dtype).view(np.uint8)).view(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", NAMES)
def test_torch_cpu_tensors_resolve_every_dtype(dtype):
    tensor = _torch_tensor(pytest.importorskip("torch"), dtype)
    buffer = as_buffer("all_gather", "recvbuf", tensor)
    assert (buffer.address, buffer.count, buffer.dtype, buffer.device) == \
        (tensor.data_ptr(), tensor.numel(), dtype, None)
    assert buffer.owner is tensor


@pytest.mark.parametrize("dtype", NAMES)
def test_torch_as_a_dlpack_producer_resolves_every_dtype(dtype):
    tensor = _torch_tensor(pytest.importorskip("torch"), dtype)
    buffer = as_buffer("all_gather", "recvbuf", DLPackOnly(tensor))
    assert (buffer.address, buffer.count, buffer.dtype) == \
        (tensor.data_ptr(), tensor.numel(), dtype)


@pytest.mark.parametrize("dtype", NAMES)
def test_torch_cuda_array_interface_typestrs_resolve_to_the_same_dtype(dtype):
    torch = pytest.importorskip("torch")
    typestr_of = getattr(torch._tensor, "_dtype_to_typestr", None)  # what CUDA tensors export
    if typestr_of is None:
        pytest.skip("this torch keeps its typestr table elsewhere")
    array = _host_array(_rng(), dtype)
    fake = FakeCudaArray(array, typestr=typestr_of(getattr(torch, dtype)))
    assert as_buffer("all_gather", "recvbuf", fake).dtype == dtype


def test_resolving_a_numpy_array_imports_neither_torch_nor_ml_dtypes():
    probe = ("import sys, numpy; from hoccl._buffers import as_buffer; "
             "b = as_buffer('c', 'a', numpy.zeros(4, numpy.float32)); "
             "print(b.dtype, 'torch' in sys.modules, 'ml_dtypes' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["float32", "False", "False"], result.stderr


# -- unknown types -------------------------------------------------------------------------
def test_unsupported_dtypes_are_refused_by_every_interface():
    rng = _rng()
    int16 = rng.integers(-9, 9, 6).astype(np.int16)
    cases = [np.zeros(3, ">f4"), int16, np.zeros(3, np.complex64),
             FakeCudaArray(int16), FakeCudaArray(np.zeros(3, "V2"))]
    fake = FakeDLPack(int16, "int8")
    fake.code, fake.bits = 0, 16
    vector = FakeDLPack(np.zeros(4, np.float32), "float32", lanes=2)
    cases += [fake, vector]
    for case in cases:
        with pytest.raises(InvalidArgumentError, match=r"^reduce: sendbuf has dtype .*expected "
                                                       r"one of float16, bfloat16"):
            as_buffer("reduce", "sendbuf", case, writable=False)


def test_torch_dtypes_hoccl_has_no_name_for_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgumentError, match=r"^reduce: sendbuf has dtype torch.int16"):
        as_buffer("reduce", "sendbuf", torch.zeros(3, dtype=torch.int16))


# -- read-only memory ----------------------------------------------------------------------
def _read_only_numpy(rng):
    array = _host_array(rng, "float32")
    array.flags.writeable = False
    return array


def _read_only_cases(rng):
    """(label, read-only object, address it must resolve to when only read)"""
    array = _host_array(rng, "int32")
    frozen = _read_only_numpy(rng)
    from_bytes = np.frombuffer(rng.bytes(32), np.float32)
    cases = [("numpy writeable=False", frozen, frozen.ctypes.data),
             ("numpy writeable=False", from_bytes, from_bytes.ctypes.data),
             ("__cuda_array_interface__ data[1] is True", FakeCudaArray(array, read_only=True),
              array.ctypes.data),
             ("DLPack flag READ_ONLY", FakeDLPack(array, "int32", flags=READ_ONLY),
              array.ctypes.data),
             ("DLPack flag READ_ONLY", DLPackOnly(frozen), frozen.ctypes.data)]
    return cases


def test_read_only_memory_is_refused_where_hoccl_writes_and_accepted_where_it_reads():
    for reason, case, address in _read_only_cases(_rng()):
        with pytest.raises(InvalidArgumentError) as raised:
            as_buffer("all_gather", "recvbuf", case, writable=True)
        assert str(raised.value) == (f"all_gather: recvbuf is read-only ({reason}); hoccl "
                                     f"writes into it: pass a writable array")
        assert as_buffer("all_gather", "sendbuf", case, writable=False).address == address


def test_buffers_must_be_writable_when_the_caller_does_not_say():
    frozen = _read_only_numpy(_rng())
    with pytest.raises(InvalidArgumentError, match="read-only"):
        as_buffer("all_gather", "recvbuf", frozen)


def test_torch_tensor_requiring_grad_is_refused_as_an_output_while_grad_mode_is_on():
    torch = pytest.importorskip("torch")
    leaf = torch.randn(5, requires_grad=True)
    with pytest.raises(InvalidArgumentError, match=r"^all_reduce: recvbuf requires grad .*"
                                                   r"tensor.detach\(\)"):
        as_buffer("all_reduce", "recvbuf", leaf, writable=True)
    # torch refuses the same in-place write to a leaf, and allows it under no_grad
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf.add_(1)
    assert as_buffer("all_reduce", "sendbuf", leaf, writable=False).address == leaf.data_ptr()
    with torch.no_grad():
        assert as_buffer("all_reduce", "recvbuf", leaf, writable=True).address == leaf.data_ptr()
    detached = leaf.detach()
    assert as_buffer("all_reduce", "recvbuf", detached, writable=True).address == leaf.data_ptr()


# -- bool ----------------------------------------------------------------------------------
def _bool_sources(array: np.ndarray):
    sources = [array, FakeCudaArray(array), FakeDLPack(array, "bool"),
               LegacyDLPack(array, "bool"), DLPackOnly(array)]
    torch = _torch()
    if torch is not None:
        sources.append(torch.from_numpy(array))
    return sources


def test_bool_moves_as_uint8_bytes_through_every_interface_in_copies():
    array = _host_array(_rng(), "bool")
    for source in _bool_sources(array):
        buffer = as_buffer("all_gather", "recvbuf", source, reduction=False)
        assert (buffer.address, buffer.count, buffer.dtype) == \
            (array.ctypes.data, array.size, "uint8"), type(source).__name__


def test_bool_is_refused_in_reductions_with_one_message_for_every_interface():
    array = _host_array(_rng(), "bool")
    messages = set()
    for source in _bool_sources(array):
        for reduction in (True, None):  # None: the caller does not say
            keywords = {} if reduction is None else {"reduction": reduction}
            with pytest.raises(InvalidArgumentError) as raised:
                as_buffer("all_reduce", "sendbuf", source, writable=False, **keywords)
            messages.add(str(raised.value))
    assert len(messages) == 1
    assert messages.pop().startswith("all_reduce: sendbuf is a bool array; hoccl does not "
                                     "reduce bools")


# -- contiguity ----------------------------------------------------------------------------
def test_non_contiguous_arrays_are_refused_by_every_interface():
    rng = _rng()
    wide = _host_array(rng, "float32", shape=(4, 6))
    strided = wide[:, ::2]
    cases = [strided, FakeCudaArray(strided), FakeDLPack(wide, "float32", strides=[6, 2]),
             DLPackOnly(strided), wide.T]
    torch = _torch()
    if torch is not None:
        cases.append(torch.from_numpy(wide).t())
    for case in cases:
        with pytest.raises(InvalidArgumentError, match=r"^scatter: recvbuf must be C-contiguous"):
            as_buffer("scatter", "recvbuf", case)


def test_strides_of_extent_one_dimensions_and_empty_arrays_do_not_matter():
    rng = _rng()
    column = _host_array(rng, "int64", shape=(1, 5))
    cai = FakeCudaArray(column, strides=(999, 8))
    dlpack = FakeDLPack(column, "int64", strides=[123, 1])
    empty = FakeCudaArray(np.zeros((0, 3), np.int64), strides=(8, 64))
    assert as_buffer("c", "a", cai).count == 5 and as_buffer("c", "a", dlpack).count == 5
    assert as_buffer("c", "a", empty).count == 0


# -- DLPack capsules hoccl cannot use --------------------------------------------------------
def test_dlpack_copies_consumed_capsules_newer_versions_and_other_devices_are_refused():
    array = _host_array(_rng(), "float32")
    consumed = FakeDLPack(array, "float32")
    consumed.capsule_name = _USED_NAME
    with pytest.raises(InvalidArgumentError, match=r"^gather: sendbuf.__dlpack__\(\) returned a "
                                                   r"capsule named b'used_dltensor_versioned'"):
        as_buffer("gather", "sendbuf", consumed)
    with pytest.raises(InvalidArgumentError, match=r"^gather: sendbuf was exported as a copy"):
        as_buffer("gather", "sendbuf", FakeDLPack(array, "float32", flags=IS_COPIED))
    with pytest.raises(InvalidArgumentError, match=r"^gather: sendbuf was exported as DLPack 2.0"):
        as_buffer("gather", "sendbuf", FakeDLPack(array, "float32", version=(2, 0)))
    with pytest.raises(InvalidArgumentError, match=r"^gather: sendbuf is a DLPack array on "
                                                   r"device type 13"):
        as_buffer("gather", "sendbuf", FakeDLPack(array, "float32", device=(13, 0)))


def test_a_producer_refusing_to_export_is_reported_with_the_call_and_the_argument():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgumentError, match=r"^all_reduce: sendbuf cannot be exported "
                                                   r"through DLPack: .*require gradient"):
        as_buffer("all_reduce", "sendbuf", DLPackOnly(torch.ones(3, requires_grad=True)),
                  writable=False)


# -- every error names the call and the argument ---------------------------------------------
def test_every_refusal_names_the_call_and_the_argument():
    rng = _rng()
    strided = _host_array(rng, "float32", shape=(2, 4))[:, ::2]
    cases = [object(), strided, np.zeros(2, np.int16), _read_only_numpy(rng),
             np.zeros(2, bool), FakeCudaArray(strided),
             FakeDLPack(_host_array(rng, "int8"), "int8", flags=READ_ONLY)]
    calls = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
             "gather", "scatter", "send", "recv")
    for case in cases:
        call = calls[int(rng.integers(len(calls)))]
        name = ("sendbuf", "recvbuf", "buf")[int(rng.integers(3))]
        with pytest.raises(InvalidArgumentError) as raised:
            as_buffer(call, name, case)
        assert str(raised.value).startswith(f"{call}: {name} "), str(raised.value)


def test_blocks_are_consecutive_slices_of_the_resolved_buffer():
    for dtype in NAMES:
        array = _host_array(_rng(), dtype, shape=(6,))
        block = as_buffer("all_gather", "recvbuf", array).block(2, 2)
        assert (block.address, block.count, block.dtype) == \
            (array[4:].ctypes.data, 2, dtype)
        assert block.nbytes == 2 * ITEMSIZE[dtype] == array[4:].nbytes
        assert numpy_dtype(dtype) == array.dtype
