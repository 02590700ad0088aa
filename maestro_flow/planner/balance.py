"""Cost-balanced sample -> replica assignment that respects every edge's routing rule.

Pure (standard library only). Samples are placed most expensive first (LPT). A candidate is a
replica of the anchor section (the critical one); every other section's replica follows from it
along the edges (determined by fan-out/fan-in, or the least-loaded allowed replica). The
candidate that keeps the busiest touched replica least busy wins, so an image-heavy sample
balances the encoder replicas and the LLM replicas at once. Anchor replicas that determine the
same neighbour replicas are interchangeable, so only the least-loaded one of each such group is
tried: the cost is O(N log N x groups).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from maestro_flow.graph import EdgeInfo, SectionGraph
from maestro_flow.samples import SampleMeta

Cost = Callable[[str, SampleMeta], float]


def _walk(graph: SectionGraph, anchor: str, component: list[str]) -> list[tuple[str, str, EdgeInfo]]:
    """BFS over the component from the anchor: (known section, next section, edge) steps."""
    steps, seen, queue = [], {anchor}, deque([anchor])
    while queue:
        known = queue.popleft()
        for e in graph.outputs(known) + graph.inputs(known):
            other = e.edge.dst if e.edge.src == known else e.edge.src
            if other in seen or other not in component:
                continue
            seen.add(other)
            steps.append((known, other, e))
            queue.append(other)
    return steps


def assign(graph: SectionGraph, anchor: str, component: list[str], samples: Sequence[SampleMeta],
           cost: Cost) -> dict[str, dict[int, int]]:
    steps = _walk(graph, anchor, component)
    sections = graph.sections
    load = {n: [0.0] * sections[n].dp for n in component}

    def follow(r: int) -> dict[str, int | None]:
        """Neighbour replicas determined by anchor replica r alone (None where there is a choice)."""
        reps: dict[str, int | None] = {anchor: r}
        for known, other, e in steps:
            allowed = _allowed(e, known, reps[known])
            reps[other] = allowed[0] if allowed is not None and len(allowed) == 1 else None
        return reps

    groups: dict[tuple, list[tuple[float, int]]] = {}
    for r in range(sections[anchor].dp):
        key = tuple(v for k, v in sorted(follow(r).items()) if k != anchor)
        groups.setdefault(key, []).append((0.0, r))
    heaps = list(groups.values())
    for h in heaps:
        heapq.heapify(h)

    costs = {s.id: {n: cost(n, s) if sections[n].activates(s.modalities) else 0.0 for n in component}
             for s in samples}
    routes: dict[str, dict[int, int]] = {n: {} for n in component}
    order = sorted(samples, key=lambda s: (-sum(costs[s.id].values()), s.id))
    for s in order:
        c = costs[s.id]
        best = None
        for h in heaps:
            r = h[0][1]
            reps = _resolve(steps, anchor, r, load)
            score = max(load[n][reps[n]] + c[n] for n in component if c[n] > 0 or n == anchor)
            key = (score, load[anchor][r], r)
            if best is None or key < best[0]:
                best = (key, h, reps)
        _, h, reps = best
        _, r = heapq.heappop(h)
        for n in component:
            load[n][reps[n]] += c[n]
            routes[n][s.id] = reps[n]
        heapq.heappush(h, (load[anchor][r], r))
    return routes


def _allowed(e: EdgeInfo, known: str, replica: int | None) -> range | None:
    if replica is None:
        return None
    return e.consumers_of(replica) if e.edge.src == known else e.producer_of(replica)


def _resolve(steps, anchor: str, r: int, load: dict[str, list[float]]) -> dict[str, int]:
    reps = {anchor: r}
    for known, other, e in steps:
        allowed = _allowed(e, known, reps[known])
        reps[other] = min(allowed, key=lambda x: (load[other][x], x))
    return reps
