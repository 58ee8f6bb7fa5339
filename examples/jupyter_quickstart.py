# %% [markdown]
# # hoccl in a notebook: one process, two GPUs
#
# Every `# %%` block below is a notebook cell (VS Code and JupyterLab with jupytext
# open this file as a notebook); `python examples/jupyter_quickstart.py` runs it
# top to bottom.  It needs two GPUs and cupy (`pip install -e '.[cuda]'`).
#
# In a notebook there is no `mpirun`: one Python process drives every rank.
# `hoccl.init_local([0, 1])` returns one communicator per GPU, rank 0 on GPU 0 and
# rank 1 on GPU 1, and you make each collective call once per rank.

# %%
import hoccl
from hoccl.backends import cuda_device_count

if cuda_device_count() < 2:
    raise SystemExit("this walkthrough needs 2 GPUs; without GPUs, run "
                     "examples/run_all.py (the host backend, numpy arrays)")
import cupy  # noqa: E402  (after the check, so a machine without GPUs gets the message)

comms = hoccl.init_local([0, 1])   # devices must be distinct: one rank per GPU
for comm in comms:
    print(comm)

# %% [markdown]
# ## A first all_reduce
#
# Arrays live on their rank's GPU.  Make the call on **every** rank first, then
# wait: `comm.synchronize()` blocks until that rank's work is done.

# %%
count = 1 << 20
x, y = [], []
for comm in comms:
    with cupy.cuda.Device(comm.device):
        x.append(cupy.full(count, comm.rank + 1, dtype=cupy.float32))
        y.append(cupy.empty(count, dtype=cupy.float32))

for comm in comms:                         # 1. every rank's call (each returns at once)
    comm.all_reduce(x[comm.rank], y[comm.rank], "sum")
for comm in comms:                         # 2. then wait
    comm.synchronize()

for comm in comms:
    print(f"rank {comm.rank}: y[:4] = {y[comm.rank][:4].get()}")   # 1 + 2 = 3 everywhere

# %% [markdown]
# ## What "no call may wait for another rank's call" means
#
# A hoccl call only *enqueues* work on a stream and returns.  Rank 0's all_reduce
# cannot start before rank 1 has made the matching call, because hoccl needs both
# buffers, and in one process rank 1's call comes later on the same thread.  So:
#
# * make every rank's call of one collective before anything that waits for it:
#   `comm.synchronize()`, `array.get()`, `print(array)`, `float(array.sum())`,
#   `cupy.cuda.Device(0).synchronize()`, `stream.synchronize()`, torch's `.item()`;
# * do not launch a kernel for the first time (cupy and torch compile or load
#   kernels lazily) between two ranks' calls of one collective: loading a module
#   may synchronize the device, and the device is waiting for the collective;
# * the safe shape is phases: every rank's producing kernels, then every rank's
#   hoccl call, then every rank's consuming kernels.
#
# `synchronize()` notices the first mistake and says which ranks have not called:

# %%
comms[0].all_reduce(x[0], y[0])            # rank 0 calls ...
try:
    comms[0].synchronize()                 # ... and waits before rank 1 called
except hoccl.HocclTimeoutError as error:
    print("HocclTimeoutError:", error)
comms[1].all_reduce(x[1], y[1])            # rank 1's call: now both ranks' work runs
for comm in comms:
    comm.synchronize()

# %% [markdown]
# A wait outside hoccl (`y[0].get()` in place of `comms[0].synchronize()` above)
# cannot be noticed: it would block forever, since rank 1's call never comes.

# %% [markdown]
# ## Streams
#
# `stream=None` (the default) means the current stream of the arrays' framework,
# here cupy's current stream of the array's device.  Pass `stream=` to use another
# one: a cupy or torch stream, a raw `CUstream` handle as an int, or any object with
# `__cuda_stream__`.  The collective is ordered after the work already on that
# stream and before the work enqueued on it later, so kernels before and after it on
# the same stream need no host synchronisation at all.

# %%
streams = []
for comm in comms:
    with cupy.cuda.Device(comm.device):
        streams.append(cupy.cuda.Stream(non_blocking=True))

gathered, doubled = [], []
for comm in comms:                         # warm-up: compile the kernels used below
    with cupy.cuda.Device(comm.device), streams[comm.rank]:
        cupy.multiply(x[comm.rank], 2, out=y[comm.rank])
        (y[comm.rank] + 1).sum()
    streams[comm.rank].synchronize()

for comm in comms:                         # phase 1: producers
    with cupy.cuda.Device(comm.device), streams[comm.rank]:
        cupy.multiply(x[comm.rank], 2, out=y[comm.rank])
        gathered.append(cupy.empty(2 * count, dtype=cupy.float32))
for comm in comms:                         # phase 2: hoccl calls only
    comm.all_gather(y[comm.rank], gathered[comm.rank], stream=streams[comm.rank])
for comm in comms:                         # phase 3: consumers, on the same streams
    with cupy.cuda.Device(comm.device), streams[comm.rank]:
        doubled.append((gathered[comm.rank] + 1).sum())

for comm in comms:
    print(f"rank {comm.rank}: sum = {float(doubled[comm.rank])}")  # (2+1)·2²⁰ + (4+1)·2²⁰
    assert float(doubled[comm.rank]) == 8 * count

# %% [markdown]
# ## In place: zero SMs for every byte
#
# In the in-place form of all_gather, the send buffer is this rank's own block of
# the receive buffer: nothing has to be copied within a GPU, so every byte travels on
# copy engines and no SM is used.  Out of place, a rank's own block is either copied
# locally on at most `max_sms` SMs (`self_route="local"`, the default) or travels to a
# peer and back on copy engines (`self_route="peer"`: zero SMs, costs NVLink bandwidth).

# %%
for comm in comms:
    with cupy.cuda.Device(comm.device):
        full = cupy.zeros(2 * count, dtype=cupy.float32)
        full[comm.rank * count:(comm.rank + 1) * count] = comm.rank + 1
        gathered[comm.rank] = full
for comm in comms:
    own_block = gathered[comm.rank][comm.rank * count:(comm.rank + 1) * count]
    comm.all_gather(own_block, gathered[comm.rank])
for comm in comms:
    comm.synchronize()
    print(f"rank {comm.rank}: {gathered[comm.rank][::count].get()}")   # [1. 2.]

# %% [markdown]
# Options are set for all later calls with `set_options` (or passed to `init_local`):
# `self_route`, `chunk_bytes`, `copy_lanes` and `max_sms`.

# %%
for comm in comms:
    comm.set_options(self_route="peer", max_sms=16)   # zero SMs for every move
    print(comm.options)

# %% [markdown]
# ## send / recv
#
# A send completes only once the receiver's stream has reached the matching recv
# (as in NCCL without a group).  Calls on one rank run in order, so order the pairs
# to avoid a cycle: here rank 0 sends first and rank 1 receives first.

# %%
with cupy.cuda.Device(1):
    inbox = cupy.zeros(8, dtype=cupy.int32)
with cupy.cuda.Device(0):
    message = cupy.arange(8, dtype=cupy.int32)
comms[0].send(message, 1)
comms[1].recv(inbox, 0)
for comm in comms:
    comm.synchronize()
print("rank 1 received", inbox.get())

# %% [markdown]
# ## Done
#
# `close()` releases the streams and events of a communicator; it is idempotent, and
# communicators also work as context managers.

# %%
for comm in comms:
    comm.close()
