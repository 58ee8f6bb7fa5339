"""A communicator across hosts: hoccl inside each host, an existing engine between hosts.

``hoccl.init()`` on a world that spans several hosts (or, with ``local_size=k`` /
``HOCCL_LOCAL_SIZE=k``, on simulated hosts of k consecutive ranks) returns a
``HierarchicalCommunicator``: the same API and argument checks as ``Communicator``,
whose calls run the phases of ``hoccl.sched.hierarchical`` plans:

* ``"host"`` calls on a hoccl communicator of the rank's host (built by ``init``'s
  single-host path over a ``SubBootstrap`` of the host's ranks): zero SMs for data;
* ``"rail"`` calls on the inter-host engine among the ranks with this local rank;
* ``"world"`` send/recv on the engine over all ranks;
* ``"local"`` steps (avg's division) on the rank's arrays.

Engines (``inter_host=``): ``"nccl"`` (nccl4py, or torch.distributed when it is
initialised with NCCL; CUDA buffers, enqueued on the caller's stream), ``"mpi"``
(mpi4py; device buffers are staged through host memory, so each MPI step waits on the
host for the work before it), and ``"hoccl"`` (hoccl communicators over the rails:
simulated hosts on one machine only).

Ordering.  On the cuda backend with NCCL every phase is enqueued on the caller's stream,
in order: a call returns without waiting for the GPU, like a single-host call.  On the
host backend (and for MPI steps) a call runs its phases one after the other and returns
when they are done (each phase's communicator is synchronised before the next phase
reads what it wrote), so ``stream`` must be None there.

Modules::

    topology.py      host_topology (which ranks share a host), SubBootstrap
    engine.py        InterHostEngine: the interface every level's engine implements
    nccl.py          NcclEngine: nccl4py or torch.distributed's NCCL groups
    mpi.py           MpiEngine: mpi4py, device arrays staged through host memory
    hoccl_engine.py  HocclEngine: a hoccl Communicator (the host's; simulated hosts' rails)
    arrays.py        flat views, scratch and host staging for numpy, torch and cupy
    communicator.py  HierarchicalCommunicator, and ENGINES: the engines by name

Adding an engine between hosts (gloo, UCX, MPI over pinned host memory on copy
engines) is one more module with one ``InterHostEngine`` subclass, listed in
``communicator.ENGINES``.  The subclass gives:

* ``name``: the ``inter_host=`` value that picks it;
* ``check_world(call, backend, hostnames)``: raise ``InvalidArgumentError`` for a world
  it cannot serve (NCCL: the cuda backend only; hoccl: one machine only);
* ``connect(setup)`` (a ``Setup``: the bootstrap, topology, device, host communicator):
  this rank's rail engine and world engine, each with a ``label`` for ``describe()``;
  every rank connects at the same time;
* the transfers, hoccl's API over the level's group (members numbered from 0):
  ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, ``broadcast``,
  ``reduce``, ``gather``, ``scatter``, ``send``, ``recv``, ``barrier``, each on flat
  arrays of the caller's framework with ``stream`` the caller's raw stream handle (None
  on the host backend): enqueued on it, or done when the method returns;
* ``abort(reason)``, ``close()``, and, where it keeps work of its own in flight,
  ``synchronize()``.
"""

from .communicator import ENGINES, INTER_HOST_ENGINES, HierarchicalCommunicator
from .engine import InterHostEngine, Setup
from .topology import SubBootstrap, host_topology

__all__ = ["SubBootstrap", "host_topology", "HierarchicalCommunicator", "INTER_HOST_ENGINES",
           "ENGINES", "InterHostEngine", "Setup"]
