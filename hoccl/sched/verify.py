"""``verify``: prove a plan safe for every ordering it allows, without enumerating them.

The model is the *happens-before* (hb) partial order of the plan's steps, a DAG:

* nodes: every step of every rank's program, plus per rank an ``ENTRY`` node (the
  entry fence: the caller's stream reached the call) and an ``EXIT`` node (the exit
  fence: the caller's stream continues);
* edges: ``ENTRY(r)`` → each step of ``r`` → ``EXIT(r)``; program order within one
  ``(rank, lane)``; ``Mark(lane, m)`` → every ``After(lane', m)`` of that rank; and
  ``Signal(peer=q, slot, v)`` → each ``Wait(slot, w)`` of ``q`` with ``w <= v`` — but
  only from the *first* signal into that slot reaching ``w``, because a ``>=`` wait is
  released by the first write that reaches its value and learns nothing about later
  ones.

For "first" to mean anything, every ``(receiver, slot)`` must have one writer (one
rank, one lane: the rank the slot names, ``slot // CHANNELS``) whose values strictly
increase; ``verify`` rejects anything else.
A ``Wait`` that no ``Signal`` reaches, or a cycle in the graph, is a deadlock: a
step can run exactly when its predecessors have, so an acyclic graph always has a
runnable step.  Step ``a`` happens before step ``b`` in *every* legal interleaving
exactly when ``b`` is reachable from ``a``; reachability is computed once, as one
Python-int bitset of ancestors per node, in topological order (only ``ENTRY`` nodes
and memory accesses get a bit, so the sets stay small).

On that order ``verify`` checks, per ``(rank, buffer)`` with interval sweeps:

* no race: two accesses to overlapping bytes, at least one a write (``Copy`` dst,
  ``Reduce`` output), are ordered by hb.  A ``Reduce`` whose output *is* one of its
  inputs is one element-wise access; a partial overlap is rejected;
* every output byte is written exactly once, and a caller's buffer is written
  nowhere else (its input-only bytes are the caller's and stay intact); scratch
  buffers (no inputs, no outputs) may be rewritten when the writes are ordered;
* every byte read is either an input (then every write to it comes after the read)
  or written by a write that happens before the read (the race rule makes that
  write the unique last one);
* fences: an access by rank ``r`` to rank ``q``'s memory (``q != r``) happens after
  ``ENTRY(q)`` through some step of ``q`` (``q``'s READY: its buffer is free; not for a
  direct kernel's double-buffered ``RING``, see ``plan.RING``: there the writer must hear
  from the ring's owner somewhere in the call instead) and
  before ``EXIT(q)`` (``q`` waited for the DONE: the caller may reuse the buffer).

Cost: building and closing the graph is O(V + E) big-int operations on bitsets of
``accesses`` bits; the sweeps are O(A log A) plus the overlapping pairs.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Dict, List, NoReturn, Optional, Sequence, Tuple

from .._dtypes import ITEMSIZE
from .._errors import PlanError
from .plan import (CHANNEL_NAMES, CHANNELS, OPS, RING, After, BufferSpec, BufRef, Copy, Mark,
                   Plan, Reduce, Signal, Wait)

__all__ = ["verify"]


Range = Tuple[int, int]


def _merge(ranges) -> List[Range]:
    """Sorted, disjoint, non-adjacent union of ``(start, stop)`` ranges (empty ones dropped)."""
    merged: List[List[int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(start, stop) for start, stop in merged]


def _subtract(start: int, stop: int, covered: List[Range]) -> Optional[Range]:
    """The first sub-range of ``[start, stop)`` outside the merged ranges ``covered``, or None."""
    position = start
    index = max(bisect_right(covered, (start, float("inf"))) - 1, 0)
    while position < stop:
        while index < len(covered) and covered[index][1] <= position:
            index += 1
        if index == len(covered) or covered[index][0] >= stop:
            return position, stop
        if covered[index][0] > position:
            return position, covered[index][0]
        position = covered[index][1]
    return None


class _Access:
    """One byte range one step reads or writes."""
    __slots__ = ("start", "stop", "node")

    def __init__(self, start: int, stop: int, node: int):
        self.start, self.stop, self.node = start, stop, node


class _OverlapIndex:
    """Ranges sorted by start with a running maximum of stops: finds every range that
    overlaps a query by scanning back only while an overlap is still possible."""

    def __init__(self, accesses: Sequence[_Access]):
        self.items = sorted(accesses, key=lambda a: (a.start, a.stop))
        self.starts = [a.start for a in self.items]
        self.reach, furthest = [], -1
        for access in self.items:
            furthest = max(furthest, access.stop)
            self.reach.append(furthest)

    def overlapping(self, start: int, stop: int, before: Optional[int] = None):
        index = bisect_left(self.starts, stop) if before is None else before
        for i in range(index - 1, -1, -1):
            if self.reach[i] <= start:
                break
            if self.items[i].stop > start:
                yield self.items[i]


class _Verifier:
    def __init__(self, plan: Plan):
        self.plan = plan
        # node numbering: per rank, ENTRY, then its steps in program order, then EXIT
        self.entry: List[int] = []
        self.exit: List[int] = []
        self.node_rank: List[int] = []
        self.node_index: List[int] = []  # step index; -1 entry, -2 exit
        self.node_step: List[object] = []

    # -- messages -----------------------------------------------------------------------
    def where(self, node: int) -> str:
        rank, index = self.node_rank[node], self.node_index[node]
        if index == -1:
            return f"rank {rank} entry fence"
        if index == -2:
            return f"rank {rank} exit fence"
        return f"rank {rank} step {index} {self.node_step[node]}"

    def fail(self, what: str, node: Optional[int] = None) -> NoReturn:
        place = f" {self.where(node)}:" if node is not None else ""
        raise PlanError(f"verify: {self.plan.collective} plan (world_size "
                        f"{self.plan.world_size}):{place} {what}")

    @staticmethod
    def slot_name(slot: int) -> str:
        sender, channel = divmod(slot, CHANNELS)
        return f"slot {slot} (rank {sender}'s {CHANNEL_NAMES[channel] if 0 <= channel < CHANNELS else channel})"

    # -- 1. shape of the plan -----------------------------------------------------------
    def check_structure(self) -> None:
        plan = self.plan
        n = plan.world_size
        if n < 1 or len(plan.programs) != n or len(plan.buffers) != n:
            self.fail(f"expected world_size >= 1 with one program and one buffer list per "
                      f"rank, got world_size {n}, {len(plan.programs)} programs, "
                      f"{len(plan.buffers)} buffer lists")
        if plan.lanes < 1:
            self.fail(f"expected lanes >= 1, got {plan.lanes}")
        if any(not 0 <= rank < n for rank in plan.participants):
            self.fail(f"participants {plan.participants} must be ranks below {n}")
        for rank in range(n):
            if rank not in plan.participants and plan.programs[rank]:
                self.fail(f"rank {rank} is not a participant but has {len(plan.programs[rank])} steps")
        self.specs: List[Dict[str, BufferSpec]] = []
        for rank, specs in enumerate(plan.buffers):
            named: Dict[str, BufferSpec] = {}
            for spec in specs:
                if spec.name in named:
                    self.fail(f"rank {rank} declares buffer {spec.name!r} twice")
                if spec.nbytes < 0:
                    self.fail(f"rank {rank} buffer {spec.name!r} has nbytes {spec.nbytes}")
                for start, stop in spec.inputs + spec.outputs:
                    if not 0 <= start <= stop <= spec.nbytes:
                        self.fail(f"rank {rank} buffer {spec.name!r} declares range "
                                  f"[{start}, {stop}) outside its {spec.nbytes} bytes")
                named[spec.name] = spec
            self.specs.append(named)

    def check_ref(self, node: int, ref: BufRef, nbytes: int, role: str) -> None:
        if not isinstance(ref, BufRef) or not 0 <= ref.rank < self.plan.world_size:
            self.fail(f"{role} {ref} does not name a rank of the plan", node)
        spec = self.specs[ref.rank].get(ref.buffer)
        if spec is None:
            self.fail(f"{role} names buffer {ref.buffer!r} that rank {ref.rank} does not have "
                      f"(it has {sorted(self.specs[ref.rank])})", node)
        if ref.offset < 0 or ref.offset + nbytes > spec.nbytes:
            self.fail(f"{role} bytes [{ref.offset}, {ref.offset + nbytes}) lie outside rank "
                      f"{ref.rank}'s {ref.buffer!r} of {spec.nbytes} bytes", node)

    def check_step(self, node: int, rank: int, step, marks: Dict[int, int]) -> None:
        plan = self.plan
        if not isinstance(step, (Copy, Signal, Wait, Reduce, Mark, After)):
            self.fail(f"unknown step type {type(step).__name__}", node)
        if not 0 <= step.lane < plan.lanes:
            self.fail(f"lane {step.lane} is outside the plan's {plan.lanes} lanes", node)
        if isinstance(step, Copy):
            if step.nbytes < 0:
                self.fail(f"nbytes must be >= 0, got {step.nbytes}", node)
            self.check_ref(node, step.src, step.nbytes, "source")
            self.check_ref(node, step.dst, step.nbytes, "destination")
            if rank not in (step.src.rank, step.dst.rank):
                self.fail(f"a copy issued by rank {rank} must read or write rank {rank}'s "
                          f"memory, got {step.src.rank} -> {step.dst.rank}", node)
            if ((step.src.rank, step.src.buffer) == (step.dst.rank, step.dst.buffer)
                    and step.nbytes and abs(step.src.offset - step.dst.offset) < step.nbytes):
                self.fail("source and destination overlap", node)
        elif isinstance(step, (Signal, Wait)):
            if isinstance(step, Signal) and not 0 <= step.peer < plan.world_size:
                self.fail(f"peer {step.peer} is not a rank below {plan.world_size}", node)
            if not 0 <= step.slot < plan.slots:
                self.fail(f"slot {step.slot} is outside the pad's {plan.slots} slots", node)
            if not 1 <= step.value <= plan.max_value:
                # a value above max_value would release the next collective's waits early
                self.fail(f"value must lie in 1..max_value={plan.max_value}, got {step.value}", node)
        elif isinstance(step, Reduce):
            if step.dtype not in ITEMSIZE:
                self.fail(f"dtype must be one of {sorted(ITEMSIZE)}, got {step.dtype!r}", node)
            if step.op not in OPS:
                self.fail(f"op must be one of {OPS}, got {step.op!r}", node)
            if step.count < 0 or not step.inputs:
                self.fail(f"expected count >= 0 and at least one input, got count {step.count} "
                          f"and {len(step.inputs)} inputs", node)
            nbytes = step.count * ITEMSIZE[step.dtype]
            for role, ref in [("input", r) for r in step.inputs] + [("output", step.output)]:
                self.check_ref(node, ref, nbytes, role)
            # inputs may lie on peers (read where they are, fenced like a copy's source)
            if step.output.rank != rank:
                self.fail(f"output {step.output} is not on the running rank {rank}", node)
            out = step.output
            for ref in step.inputs:
                if ((ref.rank, ref.buffer) == (out.rank, out.buffer) and ref.offset != out.offset
                        and abs(ref.offset - out.offset) < nbytes):
                    self.fail(f"output {out} partially overlaps input {ref} (it may only be "
                              f"exactly one of the inputs)", node)
        elif isinstance(step, Mark):
            if step.mark in marks:
                self.fail(f"mark {step.mark} was already recorded by "
                          f"{self.where(marks[step.mark])}", node)
            marks[step.mark] = node
        elif step.mark not in marks:
            self.fail(f"waits for mark {step.mark}, which is not recorded earlier in the program",
                      node)

    # -- 2. the happens-before graph ----------------------------------------------------
    def build_graph(self) -> None:
        plan = self.plan
        successors: List[List[int]] = []

        def new_node(rank: int, index: int, step) -> int:
            self.node_rank.append(rank)
            self.node_index.append(index)
            self.node_step.append(step)
            successors.append([])
            return len(successors) - 1

        # (receiver, slot) -> [writer rank, writer lane, values, nodes]
        writers: Dict[Tuple[int, int], list] = {}
        waits: List[Tuple[int, int]] = []  # (node, rank)
        for rank, program in enumerate(plan.programs):
            entry = new_node(rank, -1, None)
            self.entry.append(entry)
            marks: Dict[int, int] = {}
            lane_last: Dict[int, int] = {}
            for index, step in enumerate(program):
                node = new_node(rank, index, step)
                self.check_step(node, rank, step, marks)
                successors[lane_last.get(step.lane, entry)].append(node)
                lane_last[step.lane] = node
                if isinstance(step, After):
                    successors[marks[step.mark]].append(node)
                elif isinstance(step, Wait):
                    waits.append((node, rank))
                elif isinstance(step, Signal):
                    if step.slot // CHANNELS != rank:
                        self.fail(f"signals rank {step.peer}'s {self.slot_name(step.slot)}, "
                                  f"but a pad slot belongs to the rank it names", node)
                    key = (step.peer, step.slot)
                    writer = writers.setdefault(key, [rank, step.lane, [], []])
                    if (writer[0], writer[1]) != (rank, step.lane):
                        self.fail(f"signals rank {step.peer}'s {self.slot_name(step.slot)}, "
                                  f"which rank {writer[0]} lane {writer[1]} also signals: a slot "
                                  f"must have one writer", node)
                    if writer[2] and step.value <= writer[2][-1]:
                        self.fail(f"signals value {step.value} into rank {step.peer}'s "
                                  f"{self.slot_name(step.slot)} after value {writer[2][-1]}: "
                                  f"values into a slot must strictly increase", node)
                    writer[2].append(step.value)
                    writer[3].append(node)
            exit_node = new_node(rank, -2, None)
            self.exit.append(exit_node)
            for node in lane_last.values():
                successors[node].append(exit_node)
            successors[entry].append(exit_node)

        for node, rank in waits:
            wait = self.node_step[node]
            assert isinstance(wait, Wait)
            found = writers.get((rank, wait.slot))
            position = bisect_left(found[2], wait.value) if found else 0
            if found is None or position == len(found[2]):
                highest = f"the highest is {found[2][-1]}" if found else "nothing signals it"
                self.fail(f"deadlock: waits for {self.slot_name(wait.slot)} to reach "
                          f"{wait.value}, but no Signal reaches it ({highest})", node)
            successors[found[3][position]].append(node)
        self.successors = successors

    def close_graph(self) -> None:
        """Ancestor bitsets in topological order (Kahn); a leftover node means a cycle."""
        successors = self.successors
        count = len(successors)
        indegree = [0] * count
        for targets in successors:
            for target in targets:
                indegree[target] += 1
        self.bit = [0] * count
        next_bit = 0
        for node in range(count):
            step = self.node_step[node]
            if self.node_index[node] == -1 or (isinstance(step, (Copy, Reduce)) and self.touches(step)):
                self.bit[node] = 1 << next_bit
                next_bit += 1
        ancestors = [0] * count
        ready = [node for node in range(count) if indegree[node] == 0]
        done = 0
        while ready:
            node = ready.pop()
            done += 1
            inclusive = ancestors[node] | self.bit[node]
            for target in successors[node]:
                ancestors[target] |= inclusive
                indegree[target] -= 1
                if indegree[target] == 0:
                    ready.append(target)
        if done < count:
            self.fail_cycle(indegree)
        self.ancestors = ancestors

    def fail_cycle(self, indegree: List[int]) -> None:
        predecessor: Dict[int, int] = {}
        for node, targets in enumerate(self.successors):
            if indegree[node]:
                for target in targets:
                    if indegree[target]:
                        predecessor[target] = node
        # every blocked node has a blocked predecessor: walking back must close a loop
        node = next(iter(predecessor))
        seen: Dict[int, int] = {}
        path: List[int] = []
        while node not in seen:
            seen[node] = len(path)
            path.append(node)
            node = predecessor[node]
        cycle = path[seen[node]:][::-1]
        shown = " -> ".join(self.where(n) for n in cycle[:6]) + (" -> ..." if len(cycle) > 6 else "")
        self.fail(f"deadlock: steps wait for each other in a cycle: {shown}")

    @staticmethod
    def touches(step) -> bool:
        return (step.nbytes if isinstance(step, Copy) else step.count) > 0

    def happens_before(self, first: int, second: int) -> bool:
        return bool(self.ancestors[second] & self.bit[first])

    # -- 3. accesses and fences ---------------------------------------------------------
    def collect_accesses(self) -> None:
        self.reads: Dict[Tuple[int, str], List[_Access]] = {}
        self.writes: Dict[Tuple[int, str], List[_Access]] = {}
        for node, step in enumerate(self.node_step):
            if not isinstance(step, (Copy, Reduce)) or not self.touches(step):
                continue
            sources: Tuple[BufRef, ...]
            if isinstance(step, Copy):
                nbytes, sources = step.nbytes, (step.src,)
                target = step.dst
            else:
                nbytes, sources = step.count * ITEMSIZE[step.dtype], step.inputs
                target = step.output
            for ref, table in [(ref, self.reads) for ref in sources] + [(target, self.writes)]:
                table.setdefault((ref.rank, ref.buffer), []).append(
                    _Access(ref.offset, ref.offset + nbytes, node))
                self.check_fences(node, ref)

    def check_fences(self, node: int, ref: BufRef) -> None:
        owner = ref.rank
        if owner == self.node_rank[node]:
            return
        if ref.buffer != RING and not self.ancestors[node] & self.bit[self.entry[owner]]:
            self.fail(f"touches rank {owner}'s {ref.buffer!r} but no step of rank {owner} "
                      f"happens before it: it may run before rank {owner}'s caller reached the "
                      f"collective (a READY wait is missing)", node)
        if not self.ancestors[self.exit[owner]] & self.bit[node]:
            self.fail(f"touches rank {owner}'s {ref.buffer!r} but no step of rank {owner} "
                      f"happens after it: rank {owner}'s caller may reuse the buffer while it "
                      f"runs (a DONE signal waited for by rank {owner} is missing)", node)

    def check_call_order(self) -> None:
        """A plan with a ring (a direct kernel's) takes no READY before storing into a
        peer's ring: each rank must finish only after every other rank started, or it
        could run two calls ahead and overwrite a ring half or signature word that a
        slower rank still reads (see plan.RING)."""
        if not any(RING in named for named in self.specs):
            return
        ranks = range(len(self.plan.programs))
        for rank in ranks:
            for other in ranks:
                if other != rank and not (self.ancestors[self.exit[rank]]
                                          & self.bit[self.entry[other]]):
                    self.fail(f"finishes the call hearing from rank {other} "
                              f"nowhere in it: it could run two calls ahead and overwrite "
                              f"a ring half or signature word rank {other} still reads "
                              f"(see plan.RING)", self.exit[rank])

    # -- 4. memory ----------------------------------------------------------------------
    def check_memory(self) -> None:
        for rank, named in enumerate(self.specs):
            for name, spec in named.items():
                writes = self.writes.get((rank, name), [])
                reads = self.reads.get((rank, name), [])
                label = f"rank {rank}'s {name!r}"
                if spec.inputs or spec.outputs:
                    self.check_caller_writes(label, spec, writes)
                index = _OverlapIndex(writes)
                self.check_write_races(label, index)
                self.check_reads(label, spec, index, reads)

    def check_caller_writes(self, label: str, spec: BufferSpec, writes: List[_Access]) -> None:
        """A caller's buffer: its output bytes are written exactly once, nothing else is."""
        outputs = _merge(spec.outputs)
        ordered = sorted(writes, key=lambda a: (a.start, a.stop))
        furthest: Optional[_Access] = None
        for access in ordered:
            outside = _subtract(access.start, access.stop, outputs)
            if outside is not None:
                self.fail(f"writes bytes [{outside[0]}, {outside[1]}) of {label}, which are not "
                          f"outputs of the collective (they belong to the caller)", access.node)
            if furthest is not None and access.start < furthest.stop:
                self.fail(f"writes bytes [{access.start}, {min(access.stop, furthest.stop)}) of "
                          f"{label}, which {self.where(furthest.node)} also writes: output "
                          f"bytes must be written exactly once", access.node)
            if furthest is None or access.stop > furthest.stop:
                furthest = access
        written = _merge((a.start, a.stop) for a in ordered)
        for start, stop in outputs:
            missing = _subtract(start, stop, written)
            if missing is not None:
                self.fail(f"output bytes [{missing[0]}, {missing[1]}) of {label} are never written")

    def check_write_races(self, label: str, index: _OverlapIndex) -> None:
        for position, access in enumerate(index.items):
            for other in index.overlapping(access.start, access.stop, before=position):
                if not (self.happens_before(other.node, access.node)
                        or self.happens_before(access.node, other.node)):
                    self.fail(f"race: writes bytes [{max(access.start, other.start)}, "
                              f"{min(access.stop, other.stop)}) of {label}, which "
                              f"{self.where(other.node)} also writes, with no order between "
                              f"them", access.node)

    def check_reads(self, label: str, spec: BufferSpec, index: _OverlapIndex,
                    reads: List[_Access]) -> None:
        inputs = _merge(spec.inputs)
        for read in reads:
            earlier = []
            for write in index.overlapping(read.start, read.stop):
                if write.node == read.node:
                    continue  # an element-wise in-place Reduce
                if self.happens_before(write.node, read.node):
                    earlier.append((write.start, write.stop))
                elif not self.happens_before(read.node, write.node):
                    self.fail(f"race: reads bytes [{max(read.start, write.start)}, "
                              f"{min(read.stop, write.stop)}) of {label} while "
                              f"{self.where(write.node)} writes them, with no order between "
                              f"them", read.node)
            unset = _subtract(read.start, read.stop, _merge(earlier + inputs))
            if unset is not None:
                self.fail(f"reads bytes [{unset[0]}, {unset[1]}) of {label}, which are not "
                          f"inputs and are not written before the read", read.node)


def verify(plan: Plan) -> Plan:
    """Return ``plan`` if it is safe under every interleaving its ordering allows.

    Raises ``PlanError`` naming the collective, the rank and step, and what is wrong:
    a deadlock (a ``Wait`` no ``Signal`` reaches, a cycle), a race, an output byte
    written twice or never, a caller's byte written, a byte read before it is
    written, or a peer's memory touched outside that peer's entry/exit fences.
    """
    verifier = _Verifier(plan)
    verifier.check_structure()
    verifier.build_graph()
    verifier.close_graph()
    verifier.check_call_order()
    verifier.collect_accesses()
    verifier.check_memory()
    return plan
