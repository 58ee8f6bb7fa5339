"""A communicator across hosts: an engine inside each host, chosen per host, and one
between hosts.

``hoccl.init()`` on a world that spans several hosts (or, with ``local_size=k`` /
``HOCCL_LOCAL_SIZE=k``, on simulated hosts of k consecutive ranks) returns a
``HierarchicalCommunicator``: the same API and argument checks as ``Communicator``,
whose calls run the phases of ``hoccl.sched.hierarchical`` plans:

* ``"host"`` calls on the engine inside the rank's host;
* ``"rail"`` calls on the inter-host engine among the ranks with this local rank;
* ``"world"`` send/recv on the engine over all ranks (inside ``hoccl.group()``, a
  batch of them per level, ``pairs.py``);
* ``"local"`` steps (avg's division) on the rank's arrays.

Inside each host (``hosts.py``): the ``intra_host`` setting (``HOCCL_INTRA_HOST``, set
per host; every rank of a host gives the same) or else what the host has picks
"cuda" (hoccl's cuda backend: zero SMs), "torch" (``TorchGroupEngine``: the
torch.distributed group of the host's ranks, ProcessGroupNCCL, which is RCCL in ROCm
builds; gloo in CI) or "host" (hoccl's host backend).  The choice also sets the rank's
hoccl backend, so ranks of one job may differ (CUDA on some hosts, CPU on others).  At
init every rank reports (hostname, device kind, engine) in one allgather over the
bootstrap; ``describe()["host_engines"]`` lists each host's ranks, device kind and
engine.  A hoccl communicator of the host is built on every host (it gives the device,
streams and avg's division), whichever engine runs the host's steps.

Engines between hosts (``inter_host=``): ``"nccl"`` (nccl4py, or torch.distributed when
it is initialised with NCCL; every rank on the cuda backend; CUDA buffers, enqueued on
the caller's stream), ``"mpi"``, ``"gloo"`` and ``"ucx"`` (``StagedEngine``: hosts of any
kinds; device data staged through pinned host memory on copy engines, chunk by chunk,
the transfer by mpi4py, torch's gloo or UCX), and ``"hoccl"`` (hoccl communicators over the
rails: simulated hosts on one machine, one backend).  None picks: NCCL when every host
is on hoccl's cuda backend and NCCL is there, hoccl for simulated CPU hosts, else UCX
where it loads on every rank, else MPI (else gloo).

Reductions agree across device kinds (``folding.py``): every reduction step folds its
inputs in member order, 16-bit floats in a float32 accumulator, one rounding per step;
engines whose library reduces in an order of its own (torch groups, MPI, gloo) move the
data with the library and fold it themselves.  NCCL between all-NVIDIA hosts keeps its
own reductions (every rank gets the same bits, not those of the rule).

Pipelined phases (the ``phases`` and ``phase_bytes`` settings): an all_reduce,
broadcast or reduce is cut into chunks of elements, an all_gather or reduce_scatter into
one chunk per host (``hoccl.sched.hierarchical``'s ``pipeline_hierarchical``); each
level runs on a worker thread of its own (``phases.py``), taking its steps in the plan's
order, each after its chunk's previous phase, so the host's reduce_scatter of chunk k+1
overlaps chunk k crossing hosts and chunk k-1's all_gather.  Pipelined and sequential
give the same bits.  Levels that enqueue on the caller's stream (NCCL) stay sequential;
all_to_all, gather and scatter run their phases one after another.

A call that a host's engine cannot run (what the torch engine's probe at init found its
library lacks on the host's device) is refused on every rank before any data moves,
naming the host and engine (``hosts.refusal``); init refuses ranks of one host on
different engines and ranks whose ``phases``, ``phase_bytes`` or ``stage_bytes`` differ.

Ordering.  On the cuda backend with NCCL every phase is enqueued on the caller's stream,
in order: a call returns without waiting for the GPU, like a single-host call.  The
staged engine runs each phase on a stream of its own (``StagedEngine.begin``): it waits
on the device for an event recorded after the phase before it, and the phase after
waits for one recorded after its work (``PhaseRunner``), so the caller's stream, where
the host phases of the next chunks are enqueued meanwhile, is made to wait only for
each chunk's last phase.  On the host backend a call runs its phases one after the
other and returns when they are done, so ``stream`` must be None there.

Modules::

    topology.py      host_topology (which ranks share a host), SubBootstrap
    hosts.py         HostReport: each host's device kind and engine inside; the choice
    engine.py        InterHostEngine: the interface every level's engine implements
    folding.py       the reduction rule; FoldingEngine: reductions by moving and folding
    hoccl_engine.py  HocclEngine: a hoccl Communicator (the host's; simulated hosts' rails)
    torch_group.py   TorchGroupEngine: a torch.distributed group (inside a host)
    phases.py        PhaseRunner: a call's phases in sequence, or pipelined (a worker per level)
    staged.py        StagedEngine (MPI, gloo): pinned staging on copy engines, chunked
    staged_batch.py  the staged engine's batches of sends and receives, all posted at once
    pairs.py         sends and receives inside hoccl.group(): held, then a batch per level
    transports.py    the staged engine's transports: MPI's and gloo's nonblocking steps,
                     and PairTransport (the steps over pairwise messages)
    ucx.py           UcxStagedEngine: the staged engine over UCX (ucxx) tag messages
    nccl.py          NcclEngine: nccl4py or torch.distributed's NCCL groups
    arrays.py        flat views, scratch and host staging for numpy, torch and cupy
    communicator.py  HierarchicalCommunicator, and ENGINES: the engines by name

Adding a transport between hosts is one module: a ``transports.PairTransport`` (two
primitives: post pairwise sends and receives, test a request; the collectives are
written once over them) and a ``staged.BatchingStagedEngine`` subclass whose
``transports(setup)`` connects the rail's and the world's, listed in
``communicator.ENGINES`` (``ucx.py`` is one).  An engine of another shape subclasses
``InterHostEngine``: ``name`` (the ``inter_host=`` value), ``check_world``, ``connect``,
the transfers of hoccl's API over the level's group, ``batch``, ``abort``, ``close``.
"""

from .communicator import ENGINES, INTER_HOST_ENGINES, HierarchicalCommunicator
from .engine import InterHostEngine, Setup
from .topology import SubBootstrap, host_topology

__all__ = ["SubBootstrap", "host_topology", "HierarchicalCommunicator", "INTER_HOST_ENGINES",
           "ENGINES", "InterHostEngine", "Setup"]
