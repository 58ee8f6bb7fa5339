"""The checker of ``hoccl.testing`` itself: its poison cannot be produced, its comparisons
are exact, its reduction reference follows the backends' arithmetic, and it fails on
every planted fault (a flipped bit, shifted blocks, a block left unwritten) for every
collective and dtype before any tier trusts it."""

import ctypes

import numpy as np
import pytest

import hoccl
from hoccl._dtypes import reduce_arrays
from hoccl.backends.host import HostDevice
from hoccl.testing import (FAULTS, IN_PLACE_FORMS, POISON_BITS, ArrayModule, PlantedFault,
                           assert_exact, check_collective, expected, is_poison, poison,
                           random_array, reduced)

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
               "gather", "scatter", "send_recv")
COPIES = ("all_gather", "all_to_all", "broadcast", "gather", "scatter", "send_recv")
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTEGERS = ("int8", "uint8", "int32", "int64")
DTYPES = FLOATS + INTEGERS


@pytest.fixture(scope="module")
def comms():
    comms = hoccl.init_local(3, backend="host")
    yield comms
    for comm in comms:
        comm.close()


# -- poison and exact comparison ---------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
def test_float_poison_is_a_signalling_nan_with_an_a5_payload(dtype):
    value = poison(3, dtype)
    bits = int(value.view(f"u{value.itemsize}")[0])
    assert bits == POISON_BITS[dtype]
    mantissa_bits = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}[dtype]
    exponent_bits = 8 * value.itemsize - 1 - mantissa_bits
    mantissa = bits & ((1 << mantissa_bits) - 1)
    assert bits >> mantissa_bits == (1 << exponent_bits) - 1 and mantissa, "not a NaN"
    assert not mantissa >> (mantissa_bits - 1), "the quiet bit is set: arithmetic can make it"


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_inputs_are_never_the_poison_never_nan_and_never_a_float_zero(dtype):
    values = random_array(np.random.default_rng(1), 1 << 20, dtype)
    assert not is_poison(values).any()
    if dtype in FLOATS:
        wide = values.astype(np.float64)
        assert not np.isnan(wide).any() and not (wide == 0).any()
    else:
        assert values.min() >= (0 if dtype == "uint8" else -8) and values.max() < 8


@pytest.mark.parametrize("want,got", [
    (np.array([0.0], np.float32), np.array([-0.0], np.float32)),
    (np.array([0x7FC00000], np.uint32).view(np.float32),
     np.array([0x7FC00001], np.uint32).view(np.float32)),
    (np.array([1.0], np.float16), np.array([1.0], np.float16).view(np.uint16) ^ np.uint16(1))])
def test_exact_comparison_tells_signed_zeros_nan_payloads_and_low_bits_apart(want, got):
    got = got.view(want.dtype)
    with pytest.raises(AssertionError, match="1 of 1 elements wrong"):
        assert_exact("copy", want, got)


def test_a_flipped_low_bit_is_within_any_rounding_tolerance_but_fails_the_exact_check():
    want = random_array(np.random.default_rng(2), 61, "float16")
    got = (want.view(np.uint16) ^ np.uint16(1)).view(np.float16)
    assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=2e-2)
    with pytest.raises(AssertionError, match="61 of 61 elements wrong"):
        assert_exact("all_gather: rank 0", want, got)


def test_elements_still_poison_are_reported_as_unwritten():
    want = random_array(np.random.default_rng(3), 10, "bfloat16")
    got = want.copy()
    got[4:7] = poison(3, "bfloat16")
    with pytest.raises(AssertionError) as info:
        assert_exact("scatter: rank 2", want, got)
    message = str(info.value)
    assert message.startswith("scatter: rank 2: 3 of 10 elements wrong, 3 of them unwritten")
    assert "first at 4" in message and "0x7fa5, unwritten" in message


# -- the reduction reference -------------------------------------------------------------
def test_integer_averages_truncate_toward_zero_even_at_the_type_minimum():
    sums = np.array([-128, -7, 7, 127], np.int8)
    got = reduce_arrays([sums, np.zeros(4, np.int8)], "avg", np.dtype(np.int8))
    assert_exact("avg", np.array([-64, -3, 3, 63], np.int8), got)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_the_cuda_reference_rounds_16_bit_partials_between_chained_launches(op):
    """More inputs than one kernel launch takes: launch 1 reduces 64, launch 2 the rounded
    partial and the other 6 (dividing by all 70 for avg)."""
    rng = np.random.default_rng(4)
    inputs = [random_array(rng, 1000, "float16") for _ in range(70)]
    partial = reduce_arrays(inputs[:64], "sum" if op == "avg" else op, np.dtype(np.float16))
    if op == "avg":
        total = reduce_arrays([partial] + inputs[64:], "sum", np.dtype(np.float32))
        want = (total / np.float32(70)).astype(np.float16)
    else:
        want = reduce_arrays([partial] + inputs[64:], op, np.dtype(np.float16))
    chained = reduced(inputs, op, inputs_per_launch=64)
    assert_exact(f"chained {op}", want, chained)
    single = reduced(inputs, op)
    if op != "max":  # a maximum is one of the inputs, whatever the launches
        assert not np.array_equal(single.view(np.uint16), chained.view(np.uint16))
    assert_exact(f"{op} of 64 inputs", reduced(inputs[:64], op),
                 reduced(inputs[:64], op, inputs_per_launch=64))
    assert_exact(f"all_reduce {op} on the CUDA backend", chained,
                 expected("all_reduce", inputs, op=op, inputs_per_launch=64)[0])


def test_a_reduction_whose_result_can_equal_the_poison_is_checked_against_a_second_one(
        init_local):
    """int8 products of 5 ranks wrap and can reach -91 (the poison byte): every element must
    still be checked against a poison it does not equal, so the checker runs twice, and an
    output written only on the first run is caught."""
    comms = init_local(5, backend="host")

    def inputs(seed):  # as check_collective draws them
        rng = np.random.default_rng(seed)
        return [random_array(rng, 64, "int8") for _ in range(5)]
    seed = next(seed for seed in range(10000)
                if is_poison(expected("all_reduce", inputs(seed), op="prod")[0]).any())
    check_collective(comms, "all_reduce", count=64, dtype="int8", op="prod", seed=seed)
    runs = []
    original = comms[0].all_reduce

    def first_run_only(send, recv, op, *, scale=None, stream=None):  # all_reduce's signature
        runs.append(recv)
        original(send, recv if len(runs) == 1 else send.copy(), op, scale=scale, stream=stream)
    comms[0].all_reduce = first_run_only
    with pytest.raises(AssertionError, match="all_reduce: rank 0: .* unwritten"):
        check_collective(comms, "all_reduce", count=64, dtype="int8", op="prod", seed=seed)
    assert len(runs) == 2


# -- planted faults ------------------------------------------------------------------------
def _variants(collective, n):
    for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
        for root in ([0, n - 1] if collective in ("broadcast", "reduce", "gather", "scatter")
                     else [0]):
            yield in_place, root


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_planted_output_fault_fails_the_check(comms, collective, fault):
    n, count, caught = comms[0].world_size, 7, 0
    for seed, dtype in enumerate(DTYPES):
        for in_place, root in _variants(collective, n):
            arrays = PlantedFault(ArrayModule("numpy"), fault, block=count)
            with pytest.raises(AssertionError) as info:
                check_collective(comms, collective, count=count, dtype=dtype, root=root,
                                 in_place=in_place, seed=seed, arrays=arrays)
            assert str(info.value).startswith(f"{collective}: rank ")
            assert ("unwritten (still poison)" in str(info.value)) == (fault == "unwritten")
            caught += 1
    assert caught == len(DTYPES) * len(list(_variants(collective, n)))


@pytest.fixture
def flipping_copies(monkeypatch):
    """The host backend's copies flip bit 0 of the first byte they write."""
    copy = HostDevice.copy

    def flip(address):
        byte = ctypes.c_uint8.from_address(address)
        byte.value ^= 1

    def flipping_copy(self, stream, dst, src, nbytes):
        copy(self, stream, dst, src, nbytes)
        if nbytes:
            stream.enqueue(lambda: flip(dst))
    monkeypatch.setattr(HostDevice, "copy", flipping_copy)


@pytest.mark.parametrize("collective", COPIES + ("all_reduce",))
def test_a_copy_that_flips_a_bit_fails_the_check(init_local, flipping_copies, collective):
    """The fault in the data path itself, on every copy of the plan.  all_reduce's second
    phase copies reduced blocks into the peers' outputs; reduce_scatter and reduce copy
    only into scratch, where a flipped bit can vanish in the sum's rounding (the output
    faults above cover them)."""
    comms = init_local(3, backend="host")
    for seed, dtype in enumerate(DTYPES):
        for in_place, root in _variants(collective, 3):
            with pytest.raises(AssertionError):
                check_collective(comms, collective, count=7, dtype=dtype, root=root,
                                 in_place=in_place, seed=seed)


def test_the_checker_passes_the_same_calls_without_a_fault(comms):
    n = comms[0].world_size
    for collective in COLLECTIVES:
        for seed, dtype in enumerate(DTYPES):
            for in_place, root in _variants(collective, n):
                check_collective(comms, collective, count=7, dtype=dtype, root=root,
                                 in_place=in_place, seed=seed)
