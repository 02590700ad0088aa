"""The in-order (FIFO) planner: dataset order, balanced by count, the baseline schedule.

Pure (standard library only). Per connected component, the anchor section (largest dp) takes
contiguous blocks of the global batch; every other section follows the edge routing rule and
orders its samples by when its neighbour toward the anchor needs them, so producers emit in the
order their consumers consume.

    samples 0..7, teacher dp=1 mb=4 -> student dp=2 mb=2:
        student[0]: [0,1] [2,3]      student[1]: [4,5] [6,7]
        teacher[0]: [0,1,4,5] [2,3,6,7]     (first micro-batch of both students first)
"""

from __future__ import annotations

from collections.abc import Sequence

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.plan import MicroBatches, Plan
from maestro_flow.planner.routing import components, default_anchor, propagate, walk
from maestro_flow.samples import SampleMeta


class FifoPlanner:
    schedule = "fifo"

    def __init__(self, graph: SectionGraph, costs: CostModel) -> None:
        self.graph = graph
        self.costs = costs

    def routes(self, comp: list[str], samples: Sequence[SampleMeta]) -> dict[str, dict[int, int]]:
        """Every section's routes in one component (what plan() orders; the wavefront planner
        bounds FIFO's makespan from them alone)."""
        graph = self.graph
        anchor = default_anchor(graph, comp)
        dp = graph.sections[anchor].dp
        active = [s for s in samples if graph.sections[anchor].activates(s.modalities)]
        position = {s.id: i for i, s in enumerate(active)}
        # Contiguous blocks by count over the anchor's active samples; others follow by index.
        anchor_routes = {s.id: (position[s.id] * dp // len(active) if s.id in position
                                else i * dp // len(samples)) for i, s in enumerate(samples)}
        return propagate(graph, anchor, anchor_routes, samples, lambda n, s: 1.0)

    def plan(self, step: int, samples: Sequence[SampleMeta]) -> Plan:
        graph = self.graph
        routes: dict[str, dict[int, int]] = {}
        replicas: dict[str, tuple[MicroBatches, ...]] = {}
        for comp in components(graph):
            anchor = default_anchor(graph, comp)
            comp_routes = self.routes(comp, samples)
            routes.update(comp_routes)
            # Order sections outward from the anchor so that each one's neighbour is ordered first.
            key: dict[str, dict[int, tuple]] = {}
            for toward, name in [(None, anchor)] + [(known, other) for known, other, _ in walk(graph, anchor)]:
                section = graph.sections[name]
                mine = [s for s in samples if section.activates(s.modalities)]
                if toward is not None:  # its neighbour on the path to the anchor, ordered already
                    ref = key[toward]
                    late = (float("inf"),)
                    mine.sort(key=lambda s, ref=ref, late=late: ref.get(s.id, late + (s.id,)))
                per_replica: list[list[int]] = [[] for _ in range(section.dp)]
                for s in mine:
                    per_replica[comp_routes[name][s.id]].append(s.id)
                mbs = tuple(_chunk(ids, section.micro_batch) for ids in per_replica)
                replicas[name] = mbs
                key[name] = {sid: (m, r, p) for r, rep in enumerate(mbs)
                             for m, mb in enumerate(rep) for p, sid in enumerate(mb)}
        ordered = {n: replicas[n] for n in graph.order}
        return Plan(step=step, schedule=self.schedule, samples=tuple(samples), replicas=ordered, routes=routes)


def _chunk(ids: list[int], size: int) -> MicroBatches:
    return tuple(tuple(ids[i:i + size]) for i in range(0, len(ids), size))
