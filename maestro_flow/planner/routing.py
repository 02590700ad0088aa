"""Sample -> replica routing that respects every edge's fan-out/fan-in rule.

Pure (standard library only). One anchor section per connected component gets its replicas
from a caller-supplied assignment; every other section's replica follows along the edges
(with dp_dst = f * dp_src, consumer replica r is served by producer replica r // f; with fan-in
the reverse, choosing the least-loaded allowed producer). The graph has no undirected cycles
(checked in graph.py), so each section is reached exactly once and the rule always holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from maestro_flow.graph import EdgeInfo, SectionGraph
from maestro_flow.samples import SampleMeta


def components(graph: SectionGraph) -> list[list[str]]:
    """Connected components of the undirected section graph, each in topological order."""
    seen: set[str] = set()
    out = []
    for start in graph.order:
        if start in seen:
            continue
        comp, queue = set(), deque([start])
        while queue:
            n = queue.popleft()
            if n in comp:
                continue
            comp.add(n)
            queue.extend(e.edge.dst for e in graph.outputs(n))
            queue.extend(e.edge.src for e in graph.inputs(n))
        seen |= comp
        out.append([n for n in graph.order if n in comp])
    return out


def default_anchor(graph: SectionGraph, component: list[str]) -> str:
    """The section routing starts from: the largest dp, latest in topological order on ties."""
    return max(component, key=lambda n: (graph.sections[n].dp, component.index(n)))


def walk(graph: SectionGraph, anchor: str) -> list[tuple[str, str, EdgeInfo]]:
    """Breadth-first over the anchor's component: (known section, next section, edge joining
    them) steps. The graph is a tree once edges are undirected, so `known` is the next section's
    one neighbour on the path to the anchor."""
    steps, seen, queue = [], {anchor}, deque([anchor])
    while queue:
        known = queue.popleft()
        for e in graph.outputs(known) + graph.inputs(known):
            other = e.edge.dst if e.edge.src == known else e.edge.src
            if other in seen:
                continue
            seen.add(other)
            steps.append((known, other, e))
            queue.append(other)
    return steps


def propagate(graph: SectionGraph, anchor: str, anchor_routes: dict[int, int],
              samples: Sequence[SampleMeta], weight: Callable[[str, SampleMeta], float]) -> dict[str, dict[int, int]]:
    """Derive every section's routes in `anchor`'s component from the anchor's routes.

    Where an edge allows several replicas (fan-in seen from the consumer, fan-out seen from the
    producer), the sample goes to the allowed replica with the least `weight` so far.
    """
    routes = {anchor: dict(anchor_routes)}
    for known, other, e in walk(graph, anchor):
        allowed_of = e.consumers_of if e.edge.src == known else e.producer_of
        section = graph.sections[other]
        choices = [allowed_of(r) for r in range(graph.sections[known].dp)]
        known_routes = routes[known]
        if all(len(c) == 1 for c in choices):  # every replica fixed by its neighbour's: no loads to weigh
            only = [c[0] for c in choices]
            routes[other] = {s.id: only[known_routes[s.id]] for s in samples}
            continue
        load = [0.0] * section.dp
        out: dict[int, int] = {}
        for s in samples:
            pick = min(choices[known_routes[s.id]], key=lambda r: (load[r], r))
            out[s.id] = pick
            if section.activates(s.modalities):
                load[pick] += weight(other, s)
        routes[other] = out
    return routes
