"""How the CUDA reduce splits more inputs than one launch takes (``_kernels.reduce_launches``),
run on CPU: the launches are replayed on numpy memory the way the kernel runs them (every
element read from all the launch's inputs, then written to the output), in place included.
"""

import numpy as np
import pytest

from hoccl._errors import InvalidArgumentError
from hoccl.backends import host
from hoccl.backends._kernels import MAX_INPUTS, reduce_launches

COUNT = 257


def _replay(launches, output, memory):
    """Run ``launches`` over ``memory`` (address -> int64 array) as the kernel would: int64
    sums, so the fold order cannot change the result."""
    for launch in launches:
        assert 1 <= len(launch) <= MAX_INPUTS
        memory[output] = np.sum([memory[address] for address in launch], axis=0)


def _folded(launches):
    """The inputs in the order the launches fold them, without the carried partial results."""
    return launches[0] + [address for launch in launches[1:] for address in launch[1:]]


def _chunked_in_order(output, inputs):
    """The split before in-place inputs were moved: a planted fault for the replay check."""
    launches = [list(inputs[:MAX_INPUTS])]
    for start in range(MAX_INPUTS, len(inputs), MAX_INPUTS - 1):
        launches.append([output] + list(inputs[start:start + MAX_INPUTS - 1]))
    return launches


def _case(rng, total, in_place_at):
    """``total`` distinct input addresses with random data; the output is a fresh address or,
    at the positions ``in_place_at``, one of the inputs."""
    addresses = [0x1000 * (k + 1) for k in range(total)]
    output = addresses[in_place_at[0]] if in_place_at else 0x1000 * (total + 1)
    inputs = [output if k in in_place_at else address for k, address in enumerate(addresses)]
    memory = {address: rng.integers(-1 << 40, 1 << 40, COUNT) for address in set(inputs)}
    memory.setdefault(output, np.full(COUNT, -7))  # poison: an out-of-place output is only written
    want = np.sum([memory[address] for address in inputs], axis=0)
    return output, inputs, memory, want


@pytest.mark.parametrize("total, in_place_at", [
    (2, ()), (MAX_INPUTS, ()), (MAX_INPUTS + 1, ()), (3 * MAX_INPUTS, ()),
    (MAX_INPUTS, (MAX_INPUTS - 1,)), (MAX_INPUTS + 1, (0,)), (MAX_INPUTS + 1, (MAX_INPUTS,)),
    (2 * MAX_INPUTS + 5, (2 * MAX_INPUTS + 4,)), (200, (3, 70, 199)), (130, (64, 127, 128)),
])
def test_launches_compute_the_sum_of_every_input(total, in_place_at):
    rng = np.random.default_rng()
    output, inputs, memory, want = _case(rng, total, in_place_at)
    launches = reduce_launches(output, inputs)
    assert len(launches[0]) == min(total, MAX_INPUTS)
    assert len(launches) == 1 + max(0, -(-(total - MAX_INPUTS) // (MAX_INPUTS - 1)))
    assert all(launch[0] == output for launch in launches[1:])
    assert sorted(_folded(launches)) == sorted(inputs)
    _replay(launches, output, memory)
    assert np.array_equal(memory[output], want)


def test_order_is_kept_unless_an_in_place_input_lies_beyond_the_first_launch():
    inputs = list(range(1, 2 * MAX_INPUTS + 1))
    for output in (0, inputs[0], inputs[MAX_INPUTS - 1]):
        assert _folded(reduce_launches(output, inputs)) == inputs
    output = inputs[MAX_INPUTS + 3]
    first = reduce_launches(output, inputs)[0]
    assert first[0] == output and first[1:] == inputs[:MAX_INPUTS - 1]


def test_replay_catches_an_in_place_input_read_after_it_was_overwritten():
    rng = np.random.default_rng()
    output, inputs, memory, want = _case(rng, MAX_INPUTS + 10, (MAX_INPUTS + 5,))
    _replay(_chunked_in_order(output, inputs), output, memory)
    assert not np.array_equal(memory[output], want)


def test_more_in_place_inputs_than_one_launch_reads_are_refused():
    inputs = [0x10] * (MAX_INPUTS + 1) + [0x20]
    with pytest.raises(InvalidArgumentError, match=f"reduce: expected at most {MAX_INPUTS}"):
        reduce_launches(0x10, inputs)
    assert len(reduce_launches(0x10, [0x10] * MAX_INPUTS + [0x20])) == 2


def test_host_reduce_in_place_reads_every_input_before_writing():
    """The host backend reduces all inputs at once (``reduce_arrays``), whatever their
    number: in place it has no launches to order."""
    rng = np.random.default_rng()
    device = host.open_device(0, max_sms=8, copy_sms=8)
    try:
        stream = device.create_stream()
        data = [rng.integers(-1 << 40, 1 << 40, COUNT) for _ in range(MAX_INPUTS + 10)]
        buffers = [np.array(x) for x in data]
        addresses = [b.ctypes.data for b in buffers]
        output = addresses[MAX_INPUTS + 5]
        device.reduce(stream, output, addresses, COUNT, "int64", "sum")
        device.synchronize_stream(stream, 10)
        assert np.array_equal(buffers[MAX_INPUTS + 5], np.sum(data, axis=0))
    finally:
        device.close()


@pytest.mark.parametrize("dtype", ["int32", "float16", "bfloat16", "float32"])
def test_host_reduce_divides_in_place_by_a_given_divisor(dtype):
    """One input and ``divisor``: the in-place division an average across hosts ends
    with.  Integers truncate toward zero like C; 16-bit floats divide in float32."""
    from hoccl._dtypes import numpy_dtype
    from hoccl.testing import assert_exact, random_array
    rng = np.random.default_rng()
    values = random_array(rng, COUNT, dtype) * (5 if dtype == "int32" else 1)
    buffer = values.copy()
    if dtype == "int32":
        want = (np.sign(values) * (np.abs(values) // 3)).astype(np.int32)
    else:
        wide = values.astype(np.float32) / np.float32(3)
        want = wide.astype(numpy_dtype(dtype))
    device = host.open_device(0, max_sms=8, copy_sms=8)
    try:
        stream = device.create_stream()
        device.reduce(stream, buffer.ctypes.data, [buffer.ctypes.data], COUNT, dtype, "avg",
                      divisor=3)
        device.synchronize_stream(stream, 10)
        assert_exact(f"{dtype} / 3", want, buffer)
        with pytest.raises(InvalidArgumentError, match="divisor"):
            device.reduce(stream, buffer.ctypes.data, [buffer.ctypes.data], COUNT, dtype,
                          "sum", divisor=3)
    finally:
        device.close()
