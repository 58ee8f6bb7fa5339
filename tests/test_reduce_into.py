"""``reduce_into`` (the host backend's and the hierarchy's fold, block by block) against
``reduce_arrays`` (the reference): the same bits for every dtype, op, divisor and scale,
in place and out of place, with inputs read through readers, across block edges."""

import numpy as np
import pytest

from hoccl import _dtypes
from hoccl._dtypes import NAMES, FLOATING, numpy_dtype, reduce_arrays, reduce_into

OPS = ("sum", "avg", "prod", "max", "min")


def assert_same_bits(out: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, except that a NaN's sign and payload are left open: numpy's vector
    and scalar loops give ``inf + -inf`` NaNs of either sign (``hoccl.testing``'s
    random inputs hold no NaN for this reason)."""
    width = np.dtype(f"u{out.dtype.itemsize}")
    nan = np.isnan(want.astype(np.float64)) if want.dtype.kind in "fV" else np.zeros(
        want.shape, bool)
    got_nan = np.isnan(out.astype(np.float64)) if out.dtype.kind in "fV" else nan
    assert (got_nan == nan).all(), np.nonzero(got_nan != nan)[0]
    differ = np.nonzero((out.view(width) != want.view(width)) & ~nan)[0]
    assert differ.size == 0, (differ, out[differ], want[differ])


def _random(rng, dtype: np.dtype, count: int) -> np.ndarray:
    """Values that overflow, round and (for floats) hold NaN and infinities."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    values = (rng.standard_normal(count) * rng.choice([1e-3, 1.0, 3e4, 1e38], count))
    values[rng.random(count) < 0.02] = np.nan
    values[rng.random(count) < 0.02] = np.inf
    with np.errstate(over="ignore"):
            return (values.astype(np.float32).astype(dtype) if dtype.itemsize == 2
                else values.astype(dtype))


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 40 bytes: every count below crosses several block edges, and a last
    block that is not whole."""
    monkeypatch.setattr(_dtypes, "REDUCE_BLOCK_BYTES", 40)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("inputs", [1, 2, 5])
def test_the_same_bits_as_reduce_arrays(name, op, inputs):
    rng = np.random.default_rng()
    dtype = numpy_dtype(name)
    for count in (0, 1, 7, 103):
        parts = [_random(rng, dtype, count) for _ in range(inputs)]
        for divisor in ((None, 3) if op == "avg" else (None,)):
            for scale in ((None, 0.37) if op == "sum" and name in FLOATING else (None,)):
                want = reduce_arrays(parts, op, dtype, divisor, scale)
                out = _random(rng, dtype, count)  # poisoned
                reduce_into(out, parts, op, divisor, scale)
                assert_same_bits(out, want)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int32", "float16"])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_in_place_on_any_input(name, where):
    """The output is one of the inputs (an in-place reduction)."""
    rng = np.random.default_rng()
    dtype = numpy_dtype(name)
    for op in OPS:
        parts = [_random(rng, dtype, 57) for _ in range(3)]
        want = reduce_arrays(parts, op, dtype)
        reduce_into(parts[where], parts, op)
        assert_same_bits(parts[where], want)


@pytest.mark.parametrize("shift", [-5, 3])
def test_an_output_that_overlaps_an_input_at_another_offset(shift):
    """Folded whole, as the reference does, not block by block over what it wrote."""
    rng = np.random.default_rng()
    memory = _random(rng, np.dtype(np.float32), 80)
    a, b = memory[10:60], _random(rng, np.dtype(np.float32), 50)
    want = reduce_arrays([a, b], "sum", np.dtype(np.float32))
    out = memory[10 + shift:60 + shift]
    reduce_into(out, [a, b], "sum")
    assert_same_bits(out, want)


def test_readers_are_read_block_by_block():
    rng = np.random.default_rng()
    dtype = numpy_dtype("bfloat16")
    parts = [_random(rng, dtype, 101) for _ in range(3)]
    asked = []

    def reader(array):
        bounce = np.empty(101, dtype)

        def read(start, stop):
            asked.append((start, stop))
            bounce[:stop - start] = array[start:stop]
            return bounce[:stop - start]
        return read
    out = np.empty(101, dtype)
    reduce_into(out, [parts[0], reader(parts[1]), reader(parts[2])], "avg")
    assert_same_bits(out, reduce_arrays(parts, "avg", dtype))
    assert max(stop - start for start, stop in asked) == 20  # 40 bytes of bfloat16
    assert len(asked) == 2 * 6


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="reduce_into: unknown op 'xor'"):
        reduce_into(np.zeros(3, np.float32), [np.zeros(3, np.float32)], "xor")
