"""Bad and unusual arguments under mpiexec (any rank count):
``python run_arguments.py``.  ``synchronize()`` inside a group names the group, not
init_local, and the group's call, abandoned on every rank, runs on none; a repeated call
rank 0 abandons raises MismatchError on the others; numpy and torch integer roots are
ranks; a bad stream names the public call.
Every rank checks its outputs against numpy and prints ``rank R: arguments: N passed, M
failed``."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import hoccl  # noqa: E402
from hoccl.testing import expected, poison, random_array  # noqa: E402


def main():
    comm = hoccl.init(backend="host", timeout=60)
    rank, n = comm.rank, comm.world_size
    rng = np.random.default_rng(12345)  # the same inputs on every rank
    passed, failures = 0, []

    def checked_all_reduce(label):
        inputs = [random_array(rng, 11, "int32") for _ in range(n)]
        out = poison(11, "int32")
        comm.all_reduce(inputs[rank], out)
        comm.synchronize()
        return (1, None) if np.array_equal(out, expected("all_reduce", inputs)[rank]) else \
            (0, f"{label}: all_reduce wrong: {out}")

    def record(result):
        nonlocal passed
        passed += result[0]
        if result[1]:
            failures.append(result[1])

    x = np.ones(4, np.float32)
    try:
        with hoccl.group():
            comm.all_reduce(x, x)
            comm.synchronize()
        failures.append("synchronize inside a group: no error")
    except hoccl.InvalidArgumentError as error:
        message = str(error)
        if message.startswith("synchronize:") and "synchronize after the group" in message \
                and "init_local" not in message:
            passed += 1
        else:
            failures.append(f"synchronize inside a group: {message}")
    # every rank abandoned the group's all_reduce: it ran on none, and synchronize is quiet
    try:
        comm.synchronize()
        if np.array_equal(x, np.ones(4, np.float32)):
            passed += 1
        else:
            failures.append(f"the all_reduce every rank abandoned ran: {x}")
    except hoccl.HocclError as error:
        failures.append(f"synchronize after a group every rank abandoned: {error!r}")
    record(checked_all_reduce("after the abandoned group"))
    # rank 0 abandons a repeated call (its description was sent before) that the others
    # make: they raise MismatchError naming it, at once, and the communicator goes on
    data = np.full(4, rank + 1, np.float32)
    gathered = poison(4 * n, "float32")
    comm.all_gather(data, gathered)
    comm.synchronize()
    try:
        if rank == 0:
            try:
                with hoccl.group():
                    comm.all_gather(data, gathered)
                    raise RuntimeError("body")
            except RuntimeError:
                pass
        else:
            comm.all_gather(data, gathered)
        comm.synchronize()
        if rank == 0:
            passed += 1
        else:
            failures.append("a repeated call rank 0 abandoned: no error")
    except hoccl.MismatchError as error:
        if rank != 0 and "abandoned" in str(error):
            passed += 1
        else:
            failures.append(f"a repeated call rank 0 abandoned: {error!r}")
    record(checked_all_reduce("after a call rank 0 abandoned"))
    roots = [np.int64(n - 1), np.int32(0)]
    try:
        import torch
        roots.append(torch.tensor(n - 1))
    except ImportError:
        pass
    for root in roots:
        inputs = [random_array(rng, 6, "float64") for _ in range(n)]
        out = poison(6, "float64")
        comm.broadcast(inputs[rank] if rank == int(root) else None, out, root)
        comm.synchronize()
        if np.array_equal(out.view(np.uint64), inputs[int(root)].view(np.uint64)):
            passed += 1
        else:
            failures.append(f"broadcast root={root!r}: {out}")
    try:
        comm.all_reduce(x, x, stream="foo")
        failures.append("stream='foo': no error")
    except hoccl.InvalidArgumentError as error:
        if str(error).startswith("all_reduce: ") and "resolve_stream" not in str(error):
            passed += 1
        else:
            failures.append(f"stream='foo': {error}")
    record(checked_all_reduce("at the end"))
    for failure in failures:
        print(f"rank {rank}: FAILED {failure}", flush=True)
    print(f"rank {rank}: arguments: {passed} passed, {len(failures)} failed", flush=True)
    comm.close()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
