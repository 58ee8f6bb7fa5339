"""Under mpiexec (host backend): a caller's stream is fenced only after the peers' buffers
are mapped.  Mapping an IPC handle (and closing a stale one) may synchronize a CUDA
context; done while the caller's stream waits for the call, it waits for itself (two
ranks on one GPU hung so).  The host device's calls are logged in order and checked:
no ``import_`` between a fence of the caller's stream and the end of the issue; every
call still fenced before it returns; results exact.  Prints ``fence order: ok``."""


import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import assert_exact, random_array, run_or_abort


def main():
    comm = hoccl.init(backend="host", timeout=60)
    engine, device = comm._engine, comm._engine.device
    lanes = engine.streams.lanes
    log = []
    for name in ("import_", "hold_import"):
        original = getattr(device, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            log.append(_name)
            return _original(*args, **kwargs)
        setattr(device, name, wrapper)
    original_wait = device.wait_value
    # a call's steps on its caller's stream wait there: not a fence; the lanes' issue
    # fences the callers of calls enqueued unfenced (a process group's) as it starts
    issuing = []

    def wait_value(stream, address, value):
        if issuing[-1:] != ["issue_on_caller"] and not any(stream is lane for lane in lanes):
            log.append("fence")
        return original_wait(stream, address, value)
    device.wait_value = wait_value
    for name in ("issue", "issue_on_caller"):
        original = getattr(engine.executor, name)

        def issue(*args, _original=original, _name=name, **kwargs):
            issuing.append(_name)
            try:
                _original(*args, **kwargs)
            finally:
                issuing.pop()
            log.append("issued")
        setattr(engine.executor, name, issue)

    n, r = comm.world_size, comm.rank
    rng = np.random.default_rng(3)
    for round_ in range(3):
        data = [random_array(rng, 100, "float32") for _ in range(n)]
        # fresh buffers each round: their descriptors are new, so they are imported
        full = np.zeros(100 * n, np.float32)
        full[r * 100:(r + 1) * 100] = data[r]
        total = np.array(data[r])
        with_group = round_ == 2
        if with_group:
            hoccl.group_start()
        comm.all_gather(full[r * 100:(r + 1) * 100], full)
        comm.all_reduce(total, total, "max")
        if with_group:
            hoccl.group_end()
        comm.synchronize()
        assert_exact(f"round {round_} all_gather", np.concatenate(data), full)
        assert_exact(f"round {round_} all_reduce", np.maximum.reduce(data), total)
    fenced, imports, fences, issues = False, 0, 0, 0
    for what in log:
        if what == "fence":
            fenced, fences = True, fences + 1
        elif what == "issued":
            fenced, issues = False, issues + 1
        elif fenced:
            raise AssertionError(f"rank {r}: {what} while a caller's stream was fenced: {log}")
        else:
            imports += 1
    # the one-lane calls (all_gather of 2 ranks) run on the callers' streams, unfenced
    assert imports >= 3 and issues >= 5 and fences >= 1, (imports, fences, issues, log)
    comm.close()
    ok = MPI.COMM_WORLD.allreduce(1)
    if r == 0:
        print(f"fence order: ok ({ok} ranks)", flush=True)


if __name__ == "__main__":
    run_or_abort(main)
