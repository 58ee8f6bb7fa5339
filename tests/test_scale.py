"""A sum's ``scale`` (torch's PREMUL_SUM): multiplied by the reduction as it rounds, on
every rank that reduces, in every reducing collective; refused where it has no meaning."""

import numpy as np
import pytest

from hoccl import InvalidArgumentError, MismatchError
from hoccl.sched import Options, Shape, build_plan, simulate
from hoccl.testing import check_collective, poison, random_array

FLOATS = ["float16", "bfloat16", "float32", "float64"]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce", "reduce"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_scaled_sums_match_the_reference_bit_for_bit(init_local, n, collective, dtype):
    comms = init_local(n, backend="host")
    for in_place, scale in ((False, 0.125), (True, 1 / 3)):
        check_collective(comms, collective, count=101, dtype=dtype, root=n - 1,
                         in_place=in_place, scale=scale, seed=int(1e6 * scale) + n)


def test_a_scale_changes_the_result_and_is_applied_once(init_local):
    """Not a no-op, and not applied per input: 3 ranks of ones, scale 0.5 give 1.5."""
    comms = init_local(3, backend="host")
    outputs = [poison(4, "float32") for _ in comms]
    for comm, out in zip(comms, outputs):
        comm.all_reduce(np.ones(4, np.float32), out, scale=0.5)
    for comm in comms:
        comm.synchronize()
    for out in outputs:
        assert np.array_equal(out, np.full(4, 1.5, np.float32))


def test_the_simulated_plan_scales_like_the_backend():
    rng = np.random.default_rng()
    shape = Shape("reduce_scatter", 2, 64, "float32", 4, scale=0.25)
    plan = build_plan(shape, Options())
    sends = [random_array(rng, 128, "float32") for _ in range(2)]
    arrays = [{"send": sends[r].view(np.uint8).copy(),
               "recv": poison(64, "float32").view(np.uint8)} for r in range(2)]
    out = simulate(plan, arrays)
    total = (sends[0] + sends[1]) * np.float32(0.25)
    for r in range(2):
        got = out[r]["recv"].view(np.float32)
        assert np.array_equal(got, total[r * 64:(r + 1) * 64])


@pytest.mark.parametrize("call, arguments, message", [
    ("all_reduce", dict(op="max", scale=0.5), "scale applies to a sum"),
    ("all_reduce", dict(op="avg", scale=0.5), "scale applies to a sum"),
    ("all_reduce", dict(scale=float("nan")), "finite"),
    ("all_reduce", dict(scale="half"), "finite"),
    ("all_reduce", dict(scale=True), "finite"),
])
def test_bad_scales_are_refused_before_anything_runs(init_local, call, arguments, message):
    comms = init_local(2, backend="host")
    out = poison(4, "float32")
    with pytest.raises(InvalidArgumentError, match=message):
        getattr(comms[0], call)(np.ones(4, np.float32), out, **arguments)
    assert np.array_equal(out.view(np.uint32), poison(4, "float32").view(np.uint32))


def test_integer_sums_take_no_scale(init_local):
    comms = init_local(2, backend="host")
    with pytest.raises(InvalidArgumentError, match="floating dtype"):
        comms[0].reduce_scatter(np.ones(4, np.int32), np.zeros(2, np.int32), scale=0.5)


def test_ranks_that_disagree_on_the_scale_get_a_mismatch(init_local):
    comms = init_local(2, backend="host")
    outputs = [poison(4, "float32") for _ in comms]
    with pytest.raises(MismatchError, match="scale"):
        for comm, out, scale in zip(comms, outputs, (0.5, 0.25)):
            comm.all_reduce(np.ones(4, np.float32), out, scale=scale)
        for comm in comms:
            comm.synchronize()
    for comm in comms:  # still usable
        try:
            comm.synchronize()
        except MismatchError:
            pass
    check_collective(comms, "all_reduce", count=8, dtype="float32", scale=0.5)
    for out in outputs:
        assert np.array_equal(out.view(np.uint32), poison(4, "float32").view(np.uint32))


def test_a_scale_is_taken_for_exactly_the_floating_dtypes_of_the_dtype_table():
    """The API's check and the backends' check agree with the one dtype table: a scale
    for each floating dtype, refused for every other."""
    from hoccl import _validate as check
    from hoccl._dtypes import FLOATING, NAMES
    from hoccl.backends._base import check_reduce_extras
    assert FLOATING == tuple(FLOATS)
    for dtype in NAMES:
        if dtype in FLOATING:
            assert check.scale("all_reduce", 0.5, "sum", dtype) == 0.5
            check_reduce_extras("sum", dtype, None, 0.5)
            continue
        with pytest.raises(InvalidArgumentError, match="floating dtype"):
            check.scale("all_reduce", 0.5, "sum", dtype)
        with pytest.raises(InvalidArgumentError, match="floating dtype"):
            check_reduce_extras("sum", dtype, None, 0.5)
