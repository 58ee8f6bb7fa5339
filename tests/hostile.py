"""Hostile inputs shared by the one-process and the mpiexec tiers: ranks that disagree.

``scenarios(world_size)`` lists (name, collective, deviation, deviants): every rank
makes ``collective`` with agreed arguments except the ``deviants``, which change one
thing (count, dtype, root, op, or the collective itself).  ``make_call`` builds one
rank's buffers inside guard regions (random bytes before and after, outputs
poisoned) so that a test can prove afterwards that nothing was written anywhere.
``check_disagreement`` runs one scenario on the ranks of one process (host or GPU
backend) and asserts all of that.
"""

import numpy as np

import hoccl
from hoccl.testing import check_collective

GUARD = 64  # elements of random data on each side of every buffer
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
               "gather", "scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")


def scenarios(world_size):
    out = []
    deviant_sets = sorted({(0,), (world_size - 1,), tuple(range(1, world_size))})
    for collective in COLLECTIVES:
        changes = ["count", "dtype", "collective"]
        if collective in ROOTED:
            changes.append("root")
        if collective in REDUCING:
            changes.append("op")
        for change in changes:
            for deviants in deviant_sets:
                out.append((f"{collective}-{change}-{'-'.join(map(str, deviants))}", collective,
                            change, deviants))
    return out


class Guarded:
    """An array of ``count`` elements in the middle of a larger one; the rest is guard.
    ``device``: a CUDA ordinal (the array is then a cupy array on that GPU)."""

    def __init__(self, rng, count, dtype, fill=None, device=None):
        whole = rng.integers(0, 256, (count + 2 * GUARD) * np.dtype(dtype).itemsize,
                             dtype=np.uint8).view(dtype)
        if fill is not None:
            whole[GUARD:GUARD + count] = fill
        self.before = whole.view(np.uint8).copy()
        self.device = device
        if device is None:
            self.whole = whole
        else:
            import cupy
            with cupy.cuda.Device(device):
                self.whole = cupy.asarray(whole)
        self.view = self.whole[GUARD:GUARD + count]

    def untouched(self):
        whole = self.whole
        if self.device is not None:
            import cupy
            with cupy.cuda.Device(self.device):
                cupy.cuda.Device(self.device).synchronize()
                whole = cupy.asnumpy(whole)
        return np.array_equal(whole.view(np.uint8), self.before)


def _counts(collective, count, n):
    """(send elements, recv elements) for NCCL's ``count``."""
    return {"all_gather": (count, count * n), "reduce_scatter": (count * n, count),
            "all_reduce": (count, count), "all_to_all": (count * n, count * n),
            "broadcast": (count, count), "reduce": (count, count), "gather": (count, count * n),
            "scatter": (count * n, count)}[collective]


def make_call(rng, rank, world_size, collective, change, deviants, device=None):
    """(callable taking a communicator, [Guarded buffers]) for this rank."""
    deviant = rank in deviants
    count, dtype, root, op = 5, np.float32, 0, "sum"
    if deviant:
        if change == "count":
            count = 5 + 997  # far larger: a peer's plan would write past the others' buffers
        elif change == "dtype":
            dtype = np.float64
        elif change == "root":
            root = world_size - 1 if world_size > 1 else 0
        elif change == "op":
            op = "max"
        elif change == "collective":
            collective = "all_reduce" if collective != "all_reduce" else "all_gather"
    n_send, n_recv = _counts(collective, count, world_size)
    send = Guarded(rng, n_send, dtype, fill=rng.standard_normal(n_send).astype(dtype),
                   device=device)
    recv = Guarded(rng, n_recv, dtype, fill=np.array(np.nan, dtype), device=device)
    buffers = [send, recv]

    def call(comm):
        if collective in ("broadcast", "gather", "scatter"):
            getattr(comm, collective)(send.view, recv.view, root)
        elif collective == "reduce":
            comm.reduce(send.view, recv.view, root, op)
        elif collective in ("reduce_scatter", "all_reduce"):
            getattr(comm, collective)(send.view, recv.view, op)
        else:
            getattr(comm, collective)(send.view, recv.view)
    return call, buffers


def check_disagreement(comms, rng, name, collective, change, deviants):
    """Scenario ``name`` on ``comms``, the ranks of one process (``init_local``), each rank's
    buffers on its ``comm.device``: every rank raises MismatchError once, from its call or
    from ``synchronize``, naming the call and the ranks; no byte in or around any buffer
    changes; and the communicators complete a checked all_reduce afterwards."""
    world_size = len(comms)
    calls = [make_call(rng, comm.rank, world_size, collective, change, deviants,
                       device=comm.device) for comm in comms]
    errors = {}
    for comm, (call, _) in zip(comms, calls):
        try:
            call(comm)
        except hoccl.MismatchError as error:
            errors[comm.rank] = str(error)
    for comm in comms:
        try:
            comm.synchronize()
        except hoccl.MismatchError as error:
            assert comm.rank not in errors, "a rank got the same mismatch twice"
            errors[comm.rank] = str(error)
    assert sorted(errors) == list(range(world_size)), f"ranks without an error: {errors}"
    for text in errors.values():
        assert ": " in text and text.split(":")[0] in (collective, "all_reduce",
                                                        "all_gather"), text
        assert "rank" in text and "called (" in text, text
    for rank, (_, buffers) in enumerate(calls):
        for buffer in buffers:
            assert buffer.untouched(), f"rank {rank}: bytes changed in or around a buffer"
    check_collective(comms, "all_reduce", count=1001, dtype="float32", seed=len(name))
