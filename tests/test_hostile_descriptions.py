"""Array descriptions that lie: a null data pointer, negative or overflowing shapes,
strides that do not describe the shape, absurd dtypes, malformed entries.  Each is
refused with ``InvalidArgumentError`` naming the call, the argument, what was expected
and what was given, before anything is enqueued; nothing a description says can make
hoccl touch memory outside the range it describes.  (Whether that range is memory the
process owns cannot be checked on the host: docs/troubleshooting.md.)

``__cuda_array_interface__`` objects here carry no device, so the host backend takes
their address as host memory: exactly what a segfault needed before these checks."""

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from hoccl._buffers import as_buffer
from hoccl._errors import InvalidArgumentError

from test_buffers import CUDA, FakeDLPack

GOOD_ADDRESS = 1 << 20  # never dereferenced: every case below is refused first


def _interface(**entries):
    """An object whose ``__cuda_array_interface__`` is a valid description of 5 float32
    at ``GOOD_ADDRESS`` with ``entries`` changed (an entry of ``...`` is removed)."""
    interface = {"shape": (5,), "typestr": "<f4", "data": (GOOD_ADDRESS, False),
                 "version": 3, "strides": None}
    interface.update(entries)
    interface = {key: value for key, value in interface.items() if value is not ...}
    return type("Described", (), {"__cuda_array_interface__": interface})()


class LyingDLPack(FakeDLPack):
    """A DLPack producer over a real array whose tensor struct then says otherwise:
    ``ndim``, ``shape``, ``data`` (an int address; 0 is null) or ``byte_offset``."""

    def __init__(self, array, dtype, *, ndim=None, shape=None, data=None, byte_offset=0,
                 **kwargs):
        super().__init__(array, dtype, **kwargs)
        if shape is not None and ndim is None:
            ndim = len(shape)
        self.lie_ndim, self.lie_data, self.lie_offset = ndim, data, byte_offset
        if shape is not None:
            self.shape = (ctypes.c_int64 * len(shape))(*shape)
            self.strides = None

    def _tensor(self):
        tensor = super()._tensor()
        if self.lie_ndim is not None:
            tensor.ndim = self.lie_ndim
        if self.lie_data is not None:
            tensor.data = self.lie_data or None
        tensor.byte_offset = self.lie_offset
        return tensor


def _refused(call, name, case, *fragments, writable=True):
    with pytest.raises(InvalidArgumentError) as raised:
        as_buffer(call, name, case, writable=writable)
    message = str(raised.value)
    assert message.startswith(f"{call}: {name}"), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# -- __cuda_array_interface__ --------------------------------------------------------------
def test_a_null_data_pointer_is_refused_unless_the_array_is_empty():
    _refused("all_reduce", "sendbuf", _interface(data=(0, False)),
             "null data pointer for shape (5,) (20 bytes)", "expected the address")
    _refused("recv", "buf", _interface(shape=(2, 3), data=(None, False), typestr="<i8"),
             "data address None", "expected an int address")
    empty = as_buffer("all_reduce", "recvbuf", _interface(shape=(0, 4), data=(0, False)))
    assert (empty.address, empty.count, empty.nbytes) == (0, 0, 0)


@pytest.mark.parametrize("shape", [(-5,), (3, -1), (-2, -2), ("5",), (2.0,), (True,),
                                   (None,), 5, None])
def test_shapes_that_are_not_sizes_are_refused(shape):
    _refused("all_gather", "recvbuf", _interface(shape=shape), f"shape {shape!r}",
             "expected a sequence of ints >= 0")


@pytest.mark.parametrize("shape", [(1 << 62, 1 << 62), (1 << 61,), (1 << 31,) * 3,
                                   (1 << 64,)])
def test_shapes_past_the_address_space_are_refused(shape):
    _refused("broadcast", "recvbuf", _interface(shape=shape), "past 2**63",
             f"shape {shape}")


def test_addresses_past_the_address_space_or_negative_are_refused():
    _refused("all_reduce", "recvbuf", _interface(data=((1 << 63) - 8, False)), "past 2**63")
    _refused("all_reduce", "recvbuf", _interface(data=(-4096, False)), "data address -4096")
    _refused("all_reduce", "recvbuf", _interface(data=("0x1000", False)), "'0x1000'")


@pytest.mark.parametrize("strides", [(4,), (12, 4, 4), ("4", 4), (12, None), 4])
def test_strides_that_do_not_describe_the_shape_are_refused(strides):
    """Strides must be one int per dimension (a short tuple once slipped through: only
    the dimensions it named were checked)."""
    _refused("scatter", "recvbuf", _interface(shape=(2, 3), strides=strides),
             f"strides {strides!r}", "expected 2 ints")


@pytest.mark.parametrize("strides", [(-12, 4), (12, -4), (4, 12), (1 << 62, 4)])
def test_strides_that_are_not_c_order_are_refused(strides):
    _refused("scatter", "recvbuf", _interface(shape=(2, 3), strides=strides),
             "must be C-contiguous")


@pytest.mark.parametrize("typestr", ["<f99999999", "<f0", "<i3", "|V0", ["<f4"], 4, None])
def test_absurd_dtypes_are_refused(typestr):
    _refused("reduce", "sendbuf", _interface(typestr=typestr), f"typestr {typestr!r}",
             "expected one of float16", writable=False)


def test_malformed_interfaces_are_refused():
    _refused("gather", "sendbuf", type("Described", (), {"__cuda_array_interface__": [1]})(),
             "must be a dict; got list")
    _refused("gather", "sendbuf", _interface(data=...), "has no 'data'")
    _refused("gather", "sendbuf", _interface(shape=..., typestr=...), "'typestr', 'shape'")
    _refused("gather", "sendbuf", _interface(data=GOOD_ADDRESS),
             "data must be a pair (address, read_only)")
    _refused("gather", "sendbuf", _interface(mask=np.ones(5, bool)), "expected mask None")
    _refused("gather", "sendbuf", _interface(device="gpu0"), "device must be a CUDA ordinal",
             "'gpu0'")
    _refused("gather", "sendbuf", _interface(device=-1), "got -1")


def test_numpy_integers_in_a_description_are_ints():
    array = np.arange(6, dtype=np.float32)
    described = _interface(shape=(np.int64(2), np.int32(3)),
                           data=(np.uint64(array.ctypes.data), False), device=np.int64(0))
    buffer = as_buffer("all_gather", "recvbuf", described)
    assert (buffer.address, buffer.count, buffer.device) == (array.ctypes.data, 6, 0)
    assert type(buffer.address) is int and type(buffer.count) is int


# -- DLPack --------------------------------------------------------------------------------
def test_a_null_dlpack_data_pointer_is_refused_unless_the_tensor_is_empty():
    array = np.arange(5, dtype=np.float32)
    for offset in (0, 64):
        _refused("all_reduce", "sendbuf", LyingDLPack(array, "float32", data=0,
                                                      byte_offset=offset),
                 "DLPack tensor has a null data pointer for shape (5,) (20 bytes)")
    empty = as_buffer("all_reduce", "recvbuf",
                      LyingDLPack(np.zeros(0, np.float32), "float32", data=0))
    assert (empty.address, empty.count) == (0, 0)


@pytest.mark.parametrize("shape", [(-5,), (4, -1), (1 << 62, 1 << 62), ((1 << 63) - 1,)])
def test_dlpack_shapes_that_are_negative_or_overflow_are_refused(shape):
    lying = LyingDLPack(np.arange(5, dtype=np.float32), "float32", shape=shape)
    message = _refused("all_gather", "recvbuf", lying, "DLPack tensor")
    assert "expected a sequence of ints >= 0" in message or "past 2**63" in message, message


@pytest.mark.parametrize("ndim", [-1, -(1 << 31), 65, 1 << 30])
def test_dlpack_dimension_counts_out_of_range_are_refused(ndim):
    """A negative ndim once made shape[:ndim] empty (one element); a huge one read that
    many shape entries, far past the struct."""
    lying = LyingDLPack(np.arange(5, dtype=np.float32), "float32", ndim=ndim)
    _refused("reduce_scatter", "sendbuf", lying, f"has ndim {ndim}", "expected 0 to 64",
             writable=False)


def test_dlpack_byte_offsets_past_the_address_space_are_refused():
    lying = LyingDLPack(np.arange(5, dtype=np.float32), "float32", byte_offset=1 << 63)
    _refused("all_reduce", "recvbuf", lying, "past 2**63")


def test_absurd_dlpack_types_are_refused():
    array = np.arange(8, dtype=np.uint8)
    for code, bits, lanes in ((2, 0, 1), (0, 255, 1), (1, 8, 0), (1, 8, 65535), (200, 8, 1)):
        fake = FakeDLPack(array, "uint8", device=(CUDA, 0), lanes=lanes)
        fake.code, fake.bits = code, bits
        _refused("reduce", "sendbuf", fake, f"(code {code}, bits {bits}, lanes {lanes})",
                 "expected one of", writable=False)


# -- through the public API, on a communicator -----------------------------------------
_NULL_POINTER_PROGRAM = """
import hoccl
from hoccl import InvalidArgumentError
null = type("Null", (), {"__cuda_array_interface__": {
    "shape": (6,), "typestr": "<f4", "data": (0, False), "version": 3}})()
comms = hoccl.init_local(2)
refused = []
for comm in comms:
    for call, arguments in (("all_reduce", (null, null)), ("all_gather", (null, null)),
                            ("broadcast", (null, null, 0)), ("send", (null, 1 - comm.rank)),
                            ("recv", (null, 1 - comm.rank))):
        try:
            getattr(comm, call)(*arguments)
        except InvalidArgumentError as error:
            assert str(error).startswith(call + ": "), error
            refused.append(call)
for comm in comms:
    comm.close()
print("refused", len(refused))
"""


def test_a_null_pointer_through_every_kind_of_call_is_refused_not_a_crash():
    """In a process of its own: before these checks, the first call segfaulted (139)."""
    result = subprocess.run([sys.executable, "-c", _NULL_POINTER_PROGRAM], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.split() == ["refused", "10"], result.stdout + result.stderr[-2000:]


class _Producer:
    """A DLPack producer whose methods return what they are given."""

    def __init__(self, device, capsule):
        self.device, self.capsule = device, capsule

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        return self.capsule


@pytest.mark.parametrize("device", [("x", 0), 1, (1,), (1, 0, 0), None, (True, 0)])
def test_dlpack_devices_that_are_not_two_ints_are_refused(device):
    _refused("all_reduce", "sendbuf", _Producer(device, None), "__dlpack_device__() returned",
             "expected (device type, device id), two ints")


@pytest.mark.parametrize("capsule", ["capsule", None, 0x1000, b"dltensor"])
def test_dlpack_exports_that_are_not_capsules_are_refused(capsule):
    _refused("all_reduce", "sendbuf", _Producer((1, 0), capsule), "__dlpack__() returned a",
             "expected a DLPack capsule")


def test_an_array_interface_alone_is_refused_whatever_it_says():
    """``__array_interface__`` (numpy's host protocol) is read only through numpy: an
    object that has nothing else is refused, a null pointer or a negative shape
    included, and never dereferenced."""
    for data, shape in (((0, False), (5,)), ((GOOD_ADDRESS, False), (-5,)),
                        ((GOOD_ADDRESS, False), (1 << 62, 1 << 62))):
        described = type("Host", (), {"__array_interface__": {
            "shape": shape, "typestr": "<f4", "data": data, "version": 3}})()
        _refused("all_reduce", "sendbuf", described, "must be a numpy array", "got Host")
