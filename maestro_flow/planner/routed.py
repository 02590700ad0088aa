"""What follows from one component's sample -> replica routes alone (`Routed`): each replica's
samples, which of them need producers' outputs and which need nothing upstream, the queues of
samples between each producer replica and consumer replica, and the gradients each sample gets
back. Built once per routing and shared, read only, by every ordering played out on it
(planner/ordering.py). Pure (standard library only).
"""

from __future__ import annotations

from maestro_flow.graph import SectionGraph

Key = tuple[str, int, str, int]  # (producer, producer replica, consumer, consumer replica)


class Routed:
    """What follows from a component's routes alone: built once, shared (read only) by every
    ordering played out on those routes."""

    def __init__(self, graph: SectionGraph, comp: list[str], active: dict[str, list[int]],
                 routes: dict[str, dict[int, int]], task: dict[str, dict[int, float]]) -> None:
        """`active[n]`: the ids of the samples section n activates on, in batch order."""
        sections = graph.sections
        self.routes = routes
        self.producers = {n: [e.edge.src for e in graph.inputs(n)] for n in comp}
        self.consumers = {n: [e.edge.dst for e in graph.outputs(n)] for n in comp}
        self.grad_from = {n: [e.edge.dst for e in graph.needs_grad_from(n)] for n in comp}
        self.active = {n: set(active[n]) for n in comp}  # the samples each section processes
        # Per (section, replica): its samples, those that need producers' outputs (and how many),
        # those that need none (in sample order) and their work.
        self.todo: dict[tuple[str, int], set[int]] = {}
        self.need: dict[tuple[str, int], dict[int, int]] = {}
        self.free: dict[tuple[str, int], list[int]] = {}
        self.free_work: dict[tuple[str, int], float] = {}
        for n in comp:
            for r in range(sections[n].dp):
                self.todo[(n, r)], self.need[(n, r)], self.free[(n, r)], self.free_work[(n, r)] = set(), {}, [], 0.0
            producers = [self.active[p] for p in self.producers[n]]
            route, cost = routes[n], task[n]
            for sid in active[n]:
                where = (n, route[sid])
                self.todo[where].add(sid)
                need = 0
                for p in producers:
                    if sid in p:
                        need += 1
                if need:
                    self.need[where][sid] = need
                else:
                    self.free[where].append(sid)
                    self.free_work[where] += cost[sid]
        self.queues: dict[Key, list[int]] = {}  # (producer, p, consumer, c) -> sids, in sample order
        self.keys_of: dict[int, list[Key]] = {}  # sid -> its queues
        self.keys_out: dict[str, dict[int, list[Key]]] = {n: {} for n in comp}  # producer -> sid -> its queues from there
        self.keys_in: dict[str, dict[int, list[Key]]] = {n: {} for n in comp}  # consumer -> sid -> its queues to there
        for n in comp:
            for c in self.consumers[n]:
                consumer = self.active[c]
                for sid in active[n]:
                    if sid in consumer:
                        key = (n, routes[n][sid], c, routes[c][sid])
                        self.queues.setdefault(key, []).append(sid)
                        self.keys_of.setdefault(sid, []).append(key)
                        self.keys_out[n].setdefault(sid, []).append(key)
                        self.keys_in[c].setdefault(sid, []).append(key)
        self.out_keys: dict[tuple[str, int], list[Key]] = {}
        self.in_keys: dict[tuple[str, int], list[Key]] = {}
        for key in sorted(self.queues):
            self.out_keys.setdefault((key[0], key[1]), []).append(key)
            self.in_keys.setdefault((key[2], key[3]), []).append(key)
        # Gradients each sample of a section gets back (from consumers that train and take it).
        self.grads_of = {n: {sid: sum(sid in self.active[c] for c in self.grad_from[n]) for sid in active[n]}
                         for n in comp if self.grad_from[n]}
        # Consumer work of each queue (what Rules.serve == "remaining" counts down).
        self.remaining = {key: sum(task[key[2]][sid] for sid in sids) for key, sids in self.queues.items()}
