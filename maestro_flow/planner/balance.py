"""Cost-balanced sample -> replica assignment that respects every edge's routing rule.

Pure (standard library only). Samples are placed most expensive first (LPT). A candidate is a
replica of the anchor section (the critical one); every other section's replica follows from it
along the edges (fixed by fan-out/fan-in, or the least-loaded replica the rule allows). The
candidate that keeps the busiest replica the sample touches least busy wins (busy in seconds,
or with `share` as a share of each section's work per replica, which also balances an encoder
whose load never decides the seconds), so an image-heavy sample balances the encoder replicas
and the LLM replicas at once.

Anchor replicas that allow the same neighbour replicas are interchangeable, so only the
least-loaded one of each such group is tried, the least-loaded allowed neighbour of a fan-out
block comes from a heap per block, and a sample that touches the anchor alone (a text-only
sample in a VLM) just takes the least-loaded anchor replica: O(N log N + N_multi x groups) in
all.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from maestro_flow.graph import EdgeInfo, SectionGraph
from maestro_flow.planner.routing import walk
from maestro_flow.samples import SampleMeta

Cost = Mapping[str, Mapping[int, float]]  # section -> sample id -> work (absent: not activated)


def _allowed(e: EdgeInfo, known: str, replica: int) -> range:
    return e.consumers_of(replica) if e.edge.src == known else e.producer_of(replica)


class _Heap:
    """Least-loaded replica of a set (`best`), with lazy deletion (loads only grow). Every load
    change of a replica in the set is followed by update(), so `best` is always current."""

    def __init__(self, replicas: list[int]) -> None:
        self.entries = [(0.0, r) for r in replicas]
        heapq.heapify(self.entries)
        self.best = self.entries[0][1]

    def update(self, r: int, load: list[float]) -> None:
        entries = self.entries
        if entries[0][1] == r:  # mostly: the least-loaded replica took the sample, its entry goes stale
            heapq.heapreplace(entries, (load[r], r))
        else:
            heapq.heappush(entries, (load[r], r))
        # An entry is stale once its replica's load grew; the fresh one was pushed then.
        while entries[0][0] != load[entries[0][1]]:
            heapq.heappop(entries)
        self.best = entries[0][1]


def assign(graph: SectionGraph, anchor: str, component: list[str], samples: Sequence[SampleMeta],
           cost: Cost, share: bool = False) -> dict[str, dict[int, int]]:
    """Routes of every section of `component`. `cost[n][sample id]` is the work the sample
    causes section n (absent where n does not activate on it). With `share`, a candidate's
    score is the busiest touched replica's load as a share of its section's work per replica
    (so an image balances the encoder replicas too where the LLM's seconds would decide alone);
    else in seconds."""
    steps = walk(graph, anchor)
    sections = graph.sections
    load = {n: [0.0] * sections[n].dp for n in component}

    # What each anchor replica allows its neighbours, when that follows from the replica alone.
    allows: dict[int, tuple[tuple[str, range], ...] | None] = {}
    for r in range(sections[anchor].dp):
        fixed: dict[str, int] = {anchor: r}
        out: list[tuple[str, range]] = []
        for known, other, e in steps:
            if known not in fixed:
                out = None  # a choice upstream decides this one: resolved per sample below
                break
            allowed = _allowed(e, known, fixed[known])
            out.append((other, allowed))
            if len(allowed) == 1:
                fixed[other] = allowed[0]
        allows[r] = tuple(out) if out is not None else None
    groups: dict[object, list[int]] = {}
    for r in range(sections[anchor].dp):
        key = tuple((n, a.start, a.stop) for n, a in allows[r]) if allows[r] is not None else ("dynamic", r)
        groups.setdefault(key, []).append(r)
    heaps = [_Heap(rs) for rs in groups.values()]
    group_of = {r: heap for heap, rs in zip(heaps, groups.values(), strict=True) for r in rs}
    every = _Heap(list(range(sections[anchor].dp)))

    # A sample that touches one other section alone (a text-only sample when the encoder is the
    # anchor) takes that section's least-loaded replica, and an anchor replica that reaches it.
    reach: dict[str, dict[int, int]] = {}
    single: dict[str, _Heap] = {}
    if all(a is not None for a in allows.values()):
        for r, out in allows.items():
            for other, allowed in out:
                for q in allowed:
                    reach.setdefault(other, {}).setdefault(q, r)
        single = {n: _Heap(sorted(qs)) for n, qs in reach.items() if len(qs) == sections[n].dp}

    # Anchor replicas whose neighbours are all fixed resolve to the same dict every time.
    fixed_reps = {r: {anchor: r, **{o: a[0] for o, a in out}} for r, out in allows.items()
                  if out is not None and all(len(a) == 1 for _, a in out)}

    # Where an anchor replica allows several replicas of a neighbour (a producer feeding several
    # consumer replicas, seen from the producer), those blocks partition the neighbour's
    # replicas: one least-loaded heap per block instead of a scan per candidate.
    blocks: dict[tuple[str, int, int], _Heap] = {}
    block_of: dict[tuple[str, int], _Heap] = {}
    for out in allows.values():
        for other, allowed in out or ():
            if len(allowed) > 1 and (other, allowed.start, allowed.stop) not in blocks:
                heap = blocks[(other, allowed.start, allowed.stop)] = _Heap(list(allowed))
                for q in allowed:
                    block_of[(other, q)] = heap

    def resolve(r: int, forced: tuple[str, int] | None = None) -> dict[str, int]:
        if forced is None and r in fixed_reps:
            return fixed_reps[r]
        reps = {anchor: r}
        if allows[r] is not None:
            for other, allowed in allows[r]:
                if forced is not None and other == forced[0]:
                    reps[other] = forced[1]
                else:
                    reps[other] = allowed[0] if len(allowed) == 1 else \
                        blocks[(other, allowed.start, allowed.stop)].best
            return reps
        for known, other, e in steps:
            reps[other] = min(_allowed(e, known, reps[known]), key=lambda x: (load[other][x], x))
        return reps

    costs = {s.id: {n: cost[n].get(s.id, 0.0) for n in component} for s in samples}
    # Seconds -> share of the section's work per replica ("share"), or seconds as they are.
    unit = {n: 1.0 for n in component}
    if share:
        for n in component:
            per_replica = sum(c[n] for c in costs.values()) / sections[n].dp
            unit[n] = 1.0 / per_replica if per_replica > 0 else 1.0
    # Per group of interchangeable anchor replicas: its heap and, where every neighbour follows
    # from the anchor replica in one step, each neighbour's fixed replica or block heap (the
    # common case, scored without building a candidate; resolve() then runs for the winner).
    scored = []
    for heap, rs in zip(heaps, groups.values(), strict=True):
        out = allows[rs[0]]
        direct = out is not None and all(known == anchor for known, _, _ in steps)
        parts = {other: allowed[0] if len(allowed) == 1 else blocks[(other, allowed.start, allowed.stop)]
                 for other, allowed in out} if direct else None
        scored.append((heap, parts))
    la = load[anchor]
    routes: dict[str, dict[int, int]] = {n: {} for n in component}
    order = sorted(samples, key=lambda s: (-sum(costs[s.id].values()), s.id))
    for s in order:
        c = costs[s.id]
        touched = [n for n in component if c[n] > 0]
        if not touched or touched == [anchor]:
            reps = resolve(every.best)
        elif len(touched) == 1 and touched[0] in single:
            q = single[touched[0]].best
            reps = resolve(reach[touched[0]][q], forced=(touched[0], q))
        else:
            terms = [(load[n], c[n], unit[n], n) for n in touched if n != anchor]
            mine = (c[anchor], unit[anchor]) if anchor in touched else None
            best_key, reps = None, None
            for heap, parts in scored:
                r = heap.best
                candidate = resolve(r) if parts is None else None
                score = (la[r] + mine[0]) * mine[1] if mine else 0.0
                for lo, cn, un, n in terms:
                    if candidate is not None:
                        q = candidate[n]
                    else:
                        q = parts[n]
                        if not isinstance(q, int):
                            q = q.best
                    v = (lo[q] + cn) * un
                    if v > score:
                        score = v
                key = (score, la[r], r)
                if best_key is None or key < best_key:
                    best_key, reps = key, candidate
            if reps is None:
                reps = resolve(best_key[2])
        # A section the sample costs nothing keeps its loads, and so its heaps.
        for n in component:
            q = reps[n]
            routes[n][s.id] = q
            if c[n]:
                load[n][q] += c[n]
                block = block_of.get((n, q))
                if block is not None:
                    block.update(q, load[n])
                if n in single:
                    single[n].update(q, load[n])
        if c[anchor]:
            r = reps[anchor]
            every.update(r, la)
            group_of[r].update(r, la)
    return routes
