"""Hierarchical plans: hoccl inside each host, an inter-host engine between hosts.

The world is ``hosts`` × ``local_size`` ranks and consecutive ranks share a host: rank
``r`` is local rank ``r % local_size`` of host ``r // local_size``.  A collective over
the world becomes a ``HierarchicalPlan``: a sequence of *phases*, in each of which every
rank makes zero or more calls at one *level*:

* ``"host"``  — a hoccl collective among the ranks of the rank's host (world
  ``local_size``, members numbered by local rank): zero SMs for the data;
* ``"rail"``  — a collective of the inter-host engine (NCCL, MPI, or hoccl itself on
  simulated hosts) among the ranks with the same local rank, one per host (world
  ``hosts``, members numbered by host): local rank i only ever talks to local rank i
  of the other hosts;
* ``"world"`` — send/recv between ranks of different hosts and different local ranks,
  on the engine over the whole world;
* ``"local"`` — a step of one rank alone: ``Divide`` (the division of "avg", which
  every other level computes as a sum).

A call names its buffers as ``Region`` s: element ranges of the rank's ``send``,
``recv`` and ``scratch``.  The calls of one phase on one rank touch disjoint memory, so
they may run side by side; phases run one after the other.

``build_hierarchical(shape, topology)`` makes the plan, ``verify_hierarchical(plan)``
proves it (matched calls, valid regions, no read of unwritten memory, no caller input
overwritten, every output written; every intra- and inter-host call's own plan verified
by ``verify``), and ``simulate_hierarchical(plan, arrays)`` runs it on numpy, each call
through ``simulate`` of that call's own plan.  The runtime (``hoccl._hierarchy``) runs
the same phases, each call through the level's communicator.

The algorithms (n = hosts · local_size ranks, c = count; r = (h, l)):

* all_gather: rail all_gather of every rank's block into scratch (H blocks), then per
  source host h' a host all_gather of block (h', l) into recv[h'·L·c, (h'+1)·L·c): the
  layout comes out rank-major with no local copy, and every network link carries
  (H−1)·c, the least possible;
* reduce_scatter: per destination host h' a host reduce_scatter of recv blocks
  [h'·L, (h'+1)·L) into scratch (rank l keeps the host's sum of block h'·L + l), then a
  rail reduce_scatter of those H partial sums;
* all_reduce: host reduce_scatter into this rank's 1/L shard, rail all_reduce of the
  shard, host all_gather (the remainder of count / L elements: host all_reduce, then
  every rail all_reduces it);
* all_to_all: per destination host a host all_to_all that gathers, on local rank l,
  what every rank of the host sends to local rank l of each host (scratch), then one
  rail all_to_all of L·c blocks;
* broadcast: the root's host scatters the data into L pieces, each rail broadcasts its
  piece from the root's host, each other host all_gathers the pieces while the root's
  host broadcasts the whole (every rail carries 1/L of the data);
* reduce: host reduce_scatter into pieces, rail reduce of each piece to the root's
  host, host gather to the root;
* gather / scatter: through the root's rail only (all data meets at one GPU anyway);
* send/recv: on the host, on the rail, or on the world engine, whichever holds both;
* barrier: host barrier, then rail barrier.

"avg" is a sum everywhere and one ``Divide`` by the world size, applied to the fewest
elements (a rank's shard before all_reduce's all_gather, a piece before reduce's gather).

Pipelined: ``pipeline_hierarchical(shape, topology, chunk)`` cuts an all_reduce,
broadcast or reduce into chunks of elements, an all_gather or reduce_scatter into one
chunk per host (``build_host_share``), whose phases overlap (``PipelinedPlan.program`` orders
them along the pipeline's diagonals; ``verify_pipelined`` proves the order matches on
every member of every group).  Elementwise, a chunked call computes what the whole call
does, in the same order: the bits are the same.

The module's parts: ``_hierarchical_plan`` (the types), ``_hierarchical_build`` (the
builders), ``_hierarchical_check`` (verifying and simulating) and
``_hierarchical_pipeline`` (chunks).
"""

from ._hierarchical_build import build_hierarchical
from ._hierarchical_check import divide_in_place, simulate_hierarchical, verify_hierarchical
from ._hierarchical_build import build_host_share
from ._hierarchical_pipeline import (BY_HOST, PIPELINED, PipelinedPlan, PipelinedStep, pipeline_hierarchical,
                                     verify_pipelined)
# Step and _caller_regions too: importers of this module use them
from ._hierarchical_plan import (LEVELS, BufferLayout, Call, Divide, HierarchicalPlan, Phase,
                                 Region, Step, Topology, _caller_regions)

__all__ = ["Topology", "Region", "Call", "Divide", "Phase", "BufferLayout",
           "HierarchicalPlan", "LEVELS", "build_hierarchical", "verify_hierarchical",
           "simulate_hierarchical", "divide_in_place", "PIPELINED", "BY_HOST", "PipelinedPlan",
           "PipelinedStep", "pipeline_hierarchical", "verify_pipelined", "build_host_share"]
