"""The cuda backend's cache of imported IPC mappings, with the driver calls replaced
(no GPU here): a peer's freed allocation whose addresses a new allocation reuses must not
block the new one's import (CUDA_ERROR_ALREADY_MAPPED, seen with two ranks on one GPU
and under split), and windows' holds release only mappings no call made."""

import pytest

cuda = pytest.importorskip("hoccl.backends.cuda")
driver = cuda.driver


class FakeDriver:
    """cuIpcOpenMemHandle that refuses a handle whose exporter range overlaps a range
    still mapped here (what the driver did on one GPU), and maps everything else."""

    def __init__(self):
        self.mapped = {}   # local address -> (exporter base, size)
        self.closed = []
        self.next = 0x7000_0000

    def open(self, handle, flags):
        base, size = self.ranges[cuda._handle_bytes(handle)]
        for other_base, other_size in self.mapped.values():
            if other_base < base + size and base < other_base + other_size:
                return (driver.CUresult.CUDA_ERROR_ALREADY_MAPPED, 0)
        address = self.next
        self.next += 1 << 24
        self.mapped[address] = (base, size)
        return (driver.CUresult.CUDA_SUCCESS, address)

    def close(self, address):
        self.closed.append(address)
        del self.mapped[address]
        return (driver.CUresult.CUDA_SUCCESS,)


@pytest.fixture
def device(monkeypatch):
    fake = FakeDriver()
    fake.ranges = {}
    monkeypatch.setattr(driver, "cuIpcOpenMemHandle", fake.open)
    monkeypatch.setattr(driver, "cuIpcCloseMemHandle", fake.close)
    device = cuda.CudaDevice.__new__(cuda.CudaDevice)
    device._owned = cuda._Owned(None)
    device._called, device._holds = set(), {}
    device._make_current = lambda: None
    device.fake = fake
    return device


def descriptor(device, handle: bytes, base: int, size: int, buffer_id: int, offset=0):
    handle = handle.ljust(64, b"\0")
    assert cuda._handle_bytes(cuda._handle_from(handle)) == handle
    device.fake.ranges[handle] = (base, size)
    return cuda.CudaIpcDescriptor("cuda-ipc", handle, base, size, buffer_id, offset)


def test_a_new_allocation_over_a_freed_one_closes_the_stale_mapping(device):
    old = descriptor(device, b"old", 0x1000_0000, 1 << 20, buffer_id=1, offset=16)
    first = device.import_(old)
    assert device.import_(old) == first and not device.fake.closed  # cached
    new = descriptor(device, b"new", 0x1000_0000, 2 << 20, buffer_id=2)
    second = device.import_(new)
    assert device.fake.closed == [first - 16]
    assert second != first - 16 and len(device._owned.imports) == 1
    elsewhere = descriptor(device, b"other", 0x3000_0000, 1 << 20, buffer_id=3)
    device.import_(elsewhere)  # no overlap: both stay
    assert len(device._owned.imports) == 2 and len(device.fake.closed) == 1


def test_window_holds_release_only_what_no_call_mapped(device):
    held = descriptor(device, b"held", 0x1000_0000, 1 << 20, buffer_id=1)
    device.hold_import(held)
    device.hold_import(held)
    device.drop_import(held)
    assert not device.fake.closed          # one hold left
    device.drop_import(held)
    assert len(device.fake.closed) == 1    # unmapped
    shared = descriptor(device, b"shared", 0x2000_0000, 1 << 20, buffer_id=2)
    device.hold_import(shared)
    device.import_(shared)                 # a call maps it too: its programs may use it
    device.drop_import(shared)
    assert len(device.fake.closed) == 1 and len(device._owned.imports) == 1
