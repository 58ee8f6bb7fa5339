"""``dist.shrink_group`` on the hoccl backend.

torch's ``shrink_group`` asks the group's backend to ``shrink`` (``ProcessGroupHoccl``
does: ``shrink`` here, on ``Communicator.shrink``) and then registers what it returns as
the C++ backend of a new ``ProcessGroup``.  A process group written in Python, as
hoccl's is, is no C++ backend: ``init_process_group`` takes such a group as the process
group itself, and so, once ``use_python_groups`` has run, does ``shrink_group``.  It also
names the ranks the new group keeps by their global ranks (torch 2.13 filters the
group's global ranks by the excluded *group* ranks, which differ once a subgroup has
been shrunk: its second shrink would register the wrong ranks), and, for the default
group, numbers the global ranks as the new group does (``dist.get_rank()`` is the new
group's rank; torch 2.13 keeps the old numbers, where DeviceMesh and FSDP2 would not
find this rank).  All three apply to hoccl's
groups only; any other backend's shrink goes the way torch made it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Set

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import InvalidArgumentError

__all__ = ["shrink", "use_python_groups"]


def shrink(group: Any, ranks: List[int], flags: int, opts: Any) -> Any:
    """``ProcessGroupHoccl.shrink``: a group of the same kind over every rank of ``group``
    not in ``ranks``, on ``Communicator.shrink`` of its communicator (``flags``:
    SHRINK_DEFAULT waits for the calls in flight, SHRINK_ABORT aborts them at once;
    ``opts``: None or ``hoccl.torch.Options``, whose settings and timeout override the
    group's).  ``group`` is left aborted; torch then destroys it (its ``shutdown`` closes
    it).  The new group's store (for the host backend's recvs from any source, and the
    gloo group beside a GPU communicator) is the group's under a prefix of its own: the
    store must outlive the lost ranks (torchrun's agent store, or one no worker hosts)."""
    call = "shrink_group"
    if flags not in (c10d.SHRINK_DEFAULT, c10d.SHRINK_ABORT):
        raise InvalidArgumentError(f"{call}: flags must be SHRINK_DEFAULT (0) or SHRINK_ABORT "
                                   f"(1); got {flags!r}")
    settings = dict(getattr(opts, "settings", None) or {})
    if getattr(opts, "timeout", None) is not None:
        settings["timeout"] = opts.timeout.total_seconds()
    child = group.communicator.shrink(list(ranks), wait=flags == c10d.SHRINK_DEFAULT,
                                      **settings)
    group.shrinks += 1
    store = (dist.PrefixStore(f"hoccl/shrunk/{group.shrinks}/", group.store)
             if group.store is not None else None)
    cpu_group = None
    if group.cpu_group is not None and store is not None:
        cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), child.rank,
                                          child.world_size, timedelta(seconds=child.timeout))
    return type(group)(child, cpu_group, store)


def use_python_groups(kind: Any) -> None:
    """Make torch's ``shrink_group`` keep a group of ``kind`` (hoccl's) as the shrunk
    process group, its ranks named right (once; a torch without ``shrink_group`` is left
    alone)."""
    create_group = getattr(c10d, "_create_shrunk_process_group", None)
    finalize = getattr(c10d, "_finalize_shrunk_group", None)
    if create_group is None or finalize is None or getattr(create_group, "hoccl", False):
        return

    def create(new_backend: Any, remaining_ranks: List[int], metadata: Dict[str, Any],
               is_default_group: bool) -> Any:
        if not isinstance(new_backend, kind):
            return create_group(new_backend, remaining_ranks, metadata, is_default_group)
        new_backend._set_group_name(metadata["new_group_name"])
        new_backend._set_group_desc("default:shrunken" if is_default_group
                                    else f"{metadata['original_group_name']}:shrunk")
        if metadata.get("bound_device_id") is not None:
            new_backend.bound_device_id = metadata["bound_device_id"]
        if metadata.get("backend_config") is not None:
            c10d._world.pg_backend_config[new_backend] = metadata["backend_config"]
        return new_backend

    def finalize_group(group_info: Dict[Any, Any], excluded_ranks_set: Set[Any],
                       new_backend: Any) -> dist.ProcessGroup:
        if isinstance(new_backend, kind):
            ranks = c10d.get_process_group_ranks(group_info["process_group"])
            # group ranks -> global ranks
            excluded_ranks_set = {ranks[rank] for rank in excluded_ranks_set}
        new_group = finalize(group_info, excluded_ranks_set, new_backend)
        if isinstance(new_backend, kind) and group_info["is_default_group"]:
            # the default group numbers the world: dist.get_rank() is its rank now, so the
            # global ranks are the new group's (torch keeps the old numbers, and a
            # DeviceMesh of the group would miss this rank)
            c10d._world.pg_group_ranks[new_group] = {rank: rank
                                                     for rank in range(new_group.size())}
        return new_group
    create.hoccl = True  # type: ignore[attr-defined]
    c10d._create_shrunk_process_group = create
    c10d._finalize_shrunk_group = finalize_group
