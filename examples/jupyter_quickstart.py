# %% [markdown]
# # hoccl in a notebook: every rank from one process
#
# Every `# %%` block below is a notebook cell (VS Code and JupyterLab with jupytext
# open this file as a notebook); `python examples/jupyter_quickstart.py` runs it top to
# bottom.
#
# With two GPUs (and `pip install -e '.[cuda]'`) the ranks are the GPUs and the arrays
# are cupy arrays.  Without them it runs on hoccl's host backend: the ranks are worker
# threads and the arrays are numpy arrays, with the same calls and the same rules, so
# `pip install -e .` is all it needs.
#
# In a notebook there is no `mpirun`: one Python process drives every rank.
# `hoccl.init_local` returns one communicator per rank, and you make each collective
# call once per rank.

# %%
import contextlib

import numpy

import hoccl
from hoccl.backends import cuda_device_count

ON_GPU = cuda_device_count() >= 2
if ON_GPU:
    import cupy as xp
    comms = hoccl.init_local([0, 1], timeout=5)   # rank 0 on GPU 0, rank 1 on GPU 1
else:
    xp = numpy
    comms = hoccl.init_local(2, backend="host", timeout=5)
for comm in comms:
    print(comm)


def on_device(comm):
    """Where new arrays of ``comm``'s rank go: its GPU, or host memory."""
    return xp.cuda.Device(comm.device) if ON_GPU else contextlib.nullcontext()


def to_numpy(array):
    return array.get() if ON_GPU else array


# %% [markdown]
# ## A first all_reduce
#
# Arrays live on their rank's device.  Make the call on **every** rank first, then
# wait: `comm.synchronize()` blocks until that rank's work is done.

# %%
count = 1 << 16
x, y = [], []
for comm in comms:
    with on_device(comm):
        x.append(xp.full(count, comm.rank + 1, dtype=xp.float32))
        y.append(xp.empty(count, dtype=xp.float32))

for comm in comms:                         # 1. every rank's call (each returns at once)
    comm.all_reduce(x[comm.rank], y[comm.rank], "sum")
for comm in comms:                         # 2. then wait
    comm.synchronize()

for comm in comms:
    print(f"rank {comm.rank}: y[:4] = {to_numpy(y[comm.rank])[:4]}")   # 1 + 2 = 3 everywhere
    assert (to_numpy(y[comm.rank]) == 3).all()

# %% [markdown]
# ## What "no call may wait for another rank's call" means
#
# A hoccl call only *enqueues* work and returns.  Rank 0's all_reduce cannot start
# before rank 1 has made the matching call, because hoccl needs both buffers, and in
# one process rank 1's call comes later on the same thread.  So:
#
# * make every rank's call of one collective before anything that waits for it:
#   `comm.synchronize()`, and on GPUs `array.get()`, `print(array)`,
#   `float(array.sum())`, `stream.synchronize()`, torch's `.item()`;
# * on GPUs, do not launch a kernel for the first time (cupy and torch compile or load
#   kernels lazily) between two ranks' calls of one collective: loading a module may
#   synchronize the device, and the device is waiting for the collective;
# * the safe shape is phases: every rank's producing kernels, then every rank's hoccl
#   call, then every rank's consuming kernels.
#
# `synchronize()` notices the first mistake and says which ranks have not called (after
# the communicator's `timeout`, 5 s here):

# %%
comms[0].all_reduce(x[0], y[0])            # rank 0 calls ...
try:
    comms[0].synchronize()                 # ... and waits before rank 1 called
except hoccl.HocclTimeoutError as error:
    print("HocclTimeoutError:", error)
comms[1].all_reduce(x[1], y[1])            # rank 1's call: now both ranks' work runs
for comm in comms:
    comm.synchronize()
print("after rank 1's call: y[0][:4] =", to_numpy(y[0])[:4])

# %% [markdown]
# ## In place
#
# In the in-place form of all_gather, the send buffer is this rank's own block of the
# receive buffer.  On GPUs nothing then has to be copied within a GPU, so every byte
# travels on copy engines and no SM is used.  Out of place, a rank's own block is
# copied locally on at most `copy_sms` SMs (`self_route="local"`, the default) or
# travels to a peer and back on copy engines (`self_route="peer"`: zero SMs).

# %%
gathered = []
for comm in comms:
    with on_device(comm):
        full = xp.zeros(2 * count, dtype=xp.float32)
        full[comm.rank * count:(comm.rank + 1) * count] = comm.rank + 1
        gathered.append(full)
for comm in comms:
    own_block = gathered[comm.rank][comm.rank * count:(comm.rank + 1) * count]
    comm.all_gather(own_block, gathered[comm.rank])
for comm in comms:
    comm.synchronize()
    print(f"rank {comm.rank}: {to_numpy(gathered[comm.rank])[::count]}")   # [1. 2.]
    assert list(to_numpy(gathered[comm.rank])[::count]) == [1, 2]

# %% [markdown]
# ## Streams (GPUs)
#
# `stream=None` (the default) means the current stream of the arrays' framework, here
# cupy's current stream of the array's device.  Pass `stream=` to use another one: a
# cupy or torch stream, a raw `CUstream` handle as an int, or any object with
# `__cuda_stream__`.  The collective is ordered after the work already on that stream
# and before the work enqueued on it later, so kernels before and after it on the same
# stream need no host synchronisation at all.  The host backend has no streams: its
# calls run in call order.

# %%
if ON_GPU:
    streams = []
    for comm in comms:
        with on_device(comm):
            streams.append(xp.cuda.Stream(non_blocking=True))
    for comm in comms:                     # warm-up: compile the kernels used below
        with on_device(comm), streams[comm.rank]:
            xp.multiply(x[comm.rank], 2, out=y[comm.rank])
            (y[comm.rank] + 1).sum()
        streams[comm.rank].synchronize()
    sums = []
    for comm in comms:                     # phase 1: producers
        with on_device(comm), streams[comm.rank]:
            xp.multiply(x[comm.rank], 2, out=y[comm.rank])
    for comm in comms:                     # phase 2: hoccl calls only
        comm.all_gather(y[comm.rank], gathered[comm.rank], stream=streams[comm.rank])
    for comm in comms:                     # phase 3: consumers, on the same streams
        with on_device(comm), streams[comm.rank]:
            sums.append((gathered[comm.rank] + 1).sum())
    for comm in comms:
        print(f"rank {comm.rank}: sum = {float(sums[comm.rank])}")  # (2+1)·count + (4+1)·count
        assert float(sums[comm.rank]) == 8 * count
else:
    print("streams: GPU only; the host backend runs its calls in call order")

# %% [markdown]
# Options are set for all later calls with `set_options` (or passed to `init_local`):
# `self_route`, `chunk_bytes`, `copy_lanes` and `max_sms` among them.

# %%
for comm in comms:
    comm.set_options(self_route="peer", max_sms=16)
    print(comm.options)

# %% [markdown]
# ## send / recv
#
# A send completes only once the receiver has reached the matching recv (as in NCCL
# without a group).  Calls on one rank run in order, so order the pairs to avoid a
# cycle: here rank 0 sends first and rank 1 receives first.

# %%
with on_device(comms[1]):
    inbox = xp.zeros(8, dtype=xp.int32)
with on_device(comms[0]):
    message = xp.arange(8, dtype=xp.int32)
comms[0].send(message, 1)
comms[1].recv(inbox, 0)
for comm in comms:
    comm.synchronize()
print("rank 1 received", to_numpy(inbox))
assert list(to_numpy(inbox)) == list(range(8))

# %% [markdown]
# ## Done
#
# `close()` releases what a communicator holds; it is idempotent, and communicators
# also work as context managers.

# %%
for comm in comms:
    comm.close()
print("walkthrough finished on", "2 GPUs" if ON_GPU else "the host backend")
