"""Which stream ``stream=`` and the arrays stand for (``hoccl.backends._caller_stream``, the
pure half of ``CudaDevice.resolve_stream``), checked with fake streams, arrays and
frameworks: objects are recognised by protocol and by ``isinstance`` against frameworks
already imported, never by the name of their type's module, and nothing is imported to
recognise them."""

import importlib.abc
import random
import sys
import types

import numpy as np
import pytest

from hoccl._errors import InvalidArgumentError
from hoccl.backends._caller_stream import array_framework, stream_handle


def _handle():
    return random.randrange(1, 1 << 47)


def _wait_event(event):
    pass


# -- fake frameworks -----------------------------------------------------------------------
@pytest.fixture
def fake_torch(monkeypatch):
    module = types.ModuleType("torch")
    module.Tensor = type("Tensor", (), {})
    monkeypatch.setitem(sys.modules, "torch", module)
    return module


@pytest.fixture
def fake_cupy(monkeypatch):
    module = types.ModuleType("cupy")
    module.ndarray = type("ndarray", (), {})
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


@pytest.fixture
def no_frameworks(monkeypatch):
    """torch and cupy not imported, and any attempt to import them recorded (and refused)."""
    attempts = []

    class Recorder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "cupy"):
                attempts.append(name)
                raise ImportError(f"{name} is made unimportable by this test")

    for name in ("torch", "cupy"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [Recorder()] + sys.meta_path)
    return attempts


# -- stream=None: the arrays' framework ----------------------------------------------------
def test_first_framework_array_decides(fake_torch, fake_cupy):
    host = np.zeros(3)
    assert array_framework([host, fake_torch.Tensor(), fake_cupy.ndarray()]) == "torch"
    assert array_framework([host, fake_cupy.ndarray(), fake_torch.Tensor()]) == "cupy"
    assert array_framework([host, host]) is None
    assert array_framework([]) is None


def test_subclasses_count_as_their_framework(fake_torch, fake_cupy):
    parameter = type("Parameter", (fake_torch.Tensor,), {})  # defined outside "torch"
    view = type("View", (fake_cupy.ndarray,), {})
    assert parameter.__module__ != "torch"
    assert array_framework([parameter()]) == "torch"
    assert array_framework([view()]) == "cupy"


def test_module_names_alone_do_not_make_a_framework_array(fake_torch, fake_cupy):
    class CudaArray:
        def __init__(self):
            self.__cuda_array_interface__ = {"version": 3, "stream": _handle()}

    for module in ("torch", "torch.nn", "cupy", "cupy._core.core"):
        claimant = type("Claimant", (), {"__module__": module})()
        assert array_framework([claimant, CudaArray()]) is None


def test_frameworks_are_not_imported_to_recognise_arrays(no_frameworks):
    assert array_framework([np.zeros(2), object()]) is None
    assert no_frameworks == []
    assert "torch" not in sys.modules and "cupy" not in sys.modules


def test_real_torch_tensors_and_parameters_are_torch():
    torch = pytest.importorskip("torch")
    assert array_framework([np.zeros(1), torch.zeros(2)]) == "torch"
    assert array_framework([torch.nn.Parameter(torch.zeros(2))]) == "torch"


def test_only_loaded_framework_is_consulted(fake_cupy, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert array_framework([object(), fake_cupy.ndarray()]) == "cupy"


# -- stream given: its handle --------------------------------------------------------------
def test_int_handles_pass_through():
    handle = _handle()
    assert stream_handle(handle) == handle
    assert stream_handle(0) == 0


@pytest.mark.parametrize("value", [True, False, 1.0, "0x10", None, np.int64(4)])
def test_non_int_scalars_are_refused(value):
    with pytest.raises(InvalidArgumentError, match="resolve_stream: expected None"):
        stream_handle(value)


def test_cuda_stream_protocol_wins_over_attributes():
    handle = _handle()

    class Stream:
        cuda_stream = handle + 1
        ptr = handle + 2
        wait_event = _wait_event

        def __cuda_stream__(self):
            return (0, handle)

    assert stream_handle(Stream()) == handle


def test_cuda_stream_protocol_of_another_version_is_refused():
    class FutureStream:
        def __cuda_stream__(self):
            return (1, _handle())

    with pytest.raises(InvalidArgumentError, match="version 0, got version 1"):
        stream_handle(FutureStream())


def test_stream_objects_without_the_protocol_give_ptr_or_cuda_stream():
    handle = _handle()
    cupy_stream = types.SimpleNamespace(ptr=handle, wait_event=_wait_event)
    torch_stream = types.SimpleNamespace(cuda_stream=handle, wait_event=_wait_event)
    assert stream_handle(cupy_stream) == handle
    assert stream_handle(torch_stream) == handle


@pytest.mark.parametrize("attributes", [
    {"ptr": 0x7f00, "device_id": 0},  # a cupy.cuda.MemoryPointer
    {"cuda_stream": 0x7f00},  # no stream methods
    {"ptr": "0x7f00", "wait_event": _wait_event},  # a handle that is no int
    {"cuda_stream": True, "wait_event": _wait_event},
])
def test_objects_that_are_not_streams_are_refused(attributes):
    with pytest.raises(InvalidArgumentError, match="got types.SimpleNamespace"):
        stream_handle(types.SimpleNamespace(**attributes))


def test_module_names_alone_do_not_make_a_stream():
    for module in ("torch.cuda.streams", "cupy.cuda.stream"):
        claimant = type("Stream", (), {"__module__": module})()
        with pytest.raises(InvalidArgumentError, match=f"got {module}.Stream"):
            stream_handle(claimant)
