"""A bounded local search that shortens the best ordering's plan, judged by simulate.py.

Pure (standard library only; a `random.Random` seeded by the step, so the same step of the same
batch under the same costs gets the same plan).
Why: the orderings (ordering.py) decide greedily, under fixed rules. Where an encoder trains and
has about as much work per replica as the LLM, its backwards (run as soon as their gradients
return) push its forwards back, the LLM idles mid-step and the encoder waits for gradients at
the end; at small batches every rule set then ends some steps well above the lower bound
(RESULTS 11.3). The search starts from one component's best ordering and tries small changes
to its plan, keeping a change when the simulated step is no longer (simulate.replay: the same
event simulation the planner's makespans come from, so the result is exact):
  - within one replica: a sample moves to another of its micro-batches (never past the
    section's micro-batch size), two samples swap micro-batches, a micro-batch moves to
    another place in the order, or splits in two;
  - across the replicas of one section: a sample moves to another replica (into a micro-batch
    with room there, or one of its own), or two samples swap replicas (their routes), or, where
    an edge's fan-out blocks forbid a swap (the other replica feeds other consumer replicas),
    two samples the same sections take trade places in every section of the component. Swaps
    keep each replica's sample count; moves change it, which balances a section whose replicas
    the rules left a few percent apart.
Most changes (P_CHAIN) touch a replica on the step's critical chain: the tasks that decide when
it ends, traced back from the last one through each wait on an input or a gradient; the others
touch any replica. A consumer with one producer section that feeds no one keeps taking each
producer replica's outputs in the order they were sent (as every schedule does). Run-ahead gates
are recomputed for every changed plan (credit.py), so the memory bound the orderings keep holds
for a refined plan too.

A candidate's simulation stops as soon as some replica cannot end by the current plan's end
(it would be rejected anyway), which spares the rest of a longer candidate's events (a minority
of them on the issue's case: most longer candidates show it late).

Budget, without clocks: only a component whose best ordering ends more than ABOVE over its
lower bound is searched; the search simulates at most MAX_EVALS plans and at most as many as
cost `share` (Pipeline.plan_search; the planner splits it between a graph's components) of the
step's planned seconds, at the modelled cost of a candidate (evals_allowed), its start included
(none where that leaves fewer than MIN_EVALS); it stops once within ABOVE of the bound, after
STALL plans none of which was shorter, or after drawing 4x its budget in changes (most of which
do not apply or change nothing: those cost no simulation).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.credit import credit_gates
from maestro_flow.planner.plan import MicroBatches, Plan
from maestro_flow.planner.regroup import sent_order
from maestro_flow.planner.simulate import replay
from maestro_flow.samples import SampleMeta

ABOVE = 0.02  # search a component only above (1 + ABOVE) x its lower bound; stop there
MAX_EVALS = 1024  # plans simulated at most, however long the step
STALL = 256  # stop after this many plans in a row none of which was shorter
# Seconds one candidate costs the search (its change, send order, gates, simulation, and the
# critical chain of an accepted one): a fixed part, a part per task of the simulated step and a
# part per sample placed in the component's sections (the send order, gates and simulation's
# set-up walk every one). Set from a one-off least-squares fit (script not kept) over the searched
# plans of the worst-case grid at 128 and 256 samples on this project's 2-core host (2026-11-26),
# a little above the fit at the grid's largest searches; tools/bench/wavefront_sim.py --worst
# reports the planning time against the planned step that follows (RESULTS 11.3), and a faster
# host spends less.
# Starting a search (the first simulation and chain) costs about SETUP_EVALS candidates, and a
# search allowed fewer than MIN_EVALS is not started.
EVAL_FIXED_S = 1e-4
EVAL_TASK_S = 4e-6
EVAL_PLACED_S = 2e-6
SETUP_EVALS = 3
MIN_EVALS = 8
P_CHAIN = 0.75  # share of changes made on a replica of the critical chain
P_ROUTE = 0.25  # share of changes that swap two samples between replicas, or move one
P_MOVE = 0.5  # of those, the share that move one sample (the others swap two)


@dataclass(frozen=True, slots=True)
class Refined:
    replicas: dict[str, tuple[MicroBatches, ...]]  # the component's sections only
    routes: dict[str, dict[int, int]]
    gates: dict[str, tuple]
    makespan_s: float
    evaluated: int  # plans simulated


def evals_allowed(span_s: float, tasks: int, placed: int, share: float) -> int:
    """How many plans the budget lets the search simulate for a step of `span_s` planned seconds
    whose simulation runs `tasks` tasks over `placed` sample placements."""
    if share <= 0 or span_s <= 0:
        return 0
    evals = min(MAX_EVALS, int(share * span_s / (EVAL_FIXED_S + EVAL_TASK_S * tasks + EVAL_PLACED_S * placed))
                - SETUP_EVALS)
    return evals if evals >= MIN_EVALS else 0


def refine(graph: SectionGraph, costs: CostModel, comp: Sequence[str], start: Plan, span_s: float, bound_s: float,
           critical: str, credit: int, share: float, seed: int) -> Refined | None:
    """A shorter plan for component `comp` than `start` (its sections' micro-batches, routes and
    gates; the other sections' replicas empty), whose simulated step ends at `span_s`; None where
    the search is not worth it or finds none."""
    if span_s <= bound_s * (1 + ABOVE):
        return None
    search = _Search(graph, costs, list(comp), critical, credit, start.samples)
    placed = sum(len(mb) for n in comp for rep in start.replicas[n] for mb in rep)
    budget = evals_allowed(span_s, search.tasks(start), placed, share)
    if budget <= 0:
        return None
    memo: dict = {}
    current, sim = start, replay(start, graph, costs, memo)  # its own gates: it ends at span_s
    assert sim is not None  # no limit: never stopped early
    cur, best_plan, best = sim.makespan_s, None, span_s
    chain = search.chain(sim)
    rng = random.Random(seed)
    evaluated = stalled = drawn = 0
    while evaluated < budget and stalled < STALL and best > bound_s * (1 + ABOVE) and drawn < 4 * budget:
        drawn += 1
        candidate = search.change(current, chain, rng)
        if candidate is None:
            continue  # the drawn change does not apply (a full micro-batch), or the send order undid it
        evaluated += 1
        try:  # stopped early (None) once some replica cannot end by the current plan's end: longer
            sim = replay(candidate, graph, costs, memo, limit=cur)
        except ValueError:  # the recomputed gates wait in a circle: not a plan
            sim = None
        if sim is None:
            stalled += 1
            continue
        end = sim.makespan_s
        if end > cur * (1 + 1e-12):
            stalled += 1
            continue
        stalled = 0 if end < cur * (1 - 1e-12) else stalled + 1
        current, cur, chain = candidate, end, search.chain(sim)
        if cur < best * (1 - 1e-12):
            best_plan, best = current, cur
    if best_plan is None:
        return None
    return Refined(replicas={n: best_plan.replicas[n] for n in comp}, routes={n: best_plan.routes[n] for n in comp},
                   gates={n: best_plan.gates[n] for n in comp if n in best_plan.gates}, makespan_s=best,
                   evaluated=evaluated)


class _Search:
    """The changes the search tries, and the critical chain that aims them."""

    def __init__(self, graph: SectionGraph, costs: CostModel, comp: list[str], critical: str, credit: int,
                 samples: Sequence[SampleMeta]) -> None:
        self.graph, self.costs, self.comp, self.critical, self.credit = graph, costs, comp, critical, credit
        self.replicas = [(n, r) for n in comp for r in range(graph.sections[n].dp)]
        self.inputs = {n: [e.edge.src for e in graph.inputs(n)] for n in comp}
        self.grads_from = {n: [e.edge.dst for e in graph.needs_grad_from(n)] for n in comp}
        self.edges = {n: [e for e in graph.edges if n in (e.edge.src, e.edge.dst)] for n in comp}
        # Consumers with one producer section that feed no one take each producer replica's
        # outputs in the order it sent them, under every schedule (tests/unit/test_planner.py's
        # check_pair_order): the search keeps that (`in_order`).
        self.in_order = {n: self.inputs[n][0] for n in comp if len(self.inputs[n]) == 1 and not graph.outputs(n)}
        self.takes = {n: {s.id for s in samples if graph.sections[n].activates(s.modalities)} for n in graph.order}

    def routable(self, routes: dict[str, dict[int, int]], n: str, sid: int, replica: int) -> bool:
        """Whether `sid` may move to replica `replica` of `n`: every edge of `n` still connects
        its replicas at both ends (Edge.consumers_of: fan-out and fan-in keep their blocks)."""
        for e in self.edges[n]:
            other = e.edge.dst if e.edge.src == n else e.edge.src
            if sid not in self.takes[other]:
                continue
            src, dst = (replica, routes[other][sid]) if e.edge.src == n else (routes[other][sid], replica)
            if dst not in e.consumers_of(src):
                return False
        return True

    def tasks(self, plan: Plan) -> int:
        """The tasks the plan's simulation runs, at most: a forward per micro-batch, and a backward
        where a trainable section that is not a loss section gets gradients back."""
        graph = self.graph
        losses = set(graph.loss_sections())
        return sum(len(mbs) * (2 if self.grads_from[n] and graph.sections[n].trainable and n not in losses else 1)
                   for n in self.comp for mbs in plan.replicas[n])

    def gated(self, plan: Plan) -> Plan:
        gates = credit_gates(self.graph, plan, self.comp, self.critical, self.credit, takes=self.takes[self.critical])
        return replace(plan, gates={**plan.gates, **gates})

    def chain(self, sim) -> list[tuple[str, int]]:
        """The replicas of the tasks that decide the step's end, with repeats (a replica on the
        chain for many tasks is picked more often)."""
        tasks = sim.tasks  # (section, replica, mb, kind, start, end), in start order
        if not tasks:
            return []
        prev_of: dict[int, int | None] = {}  # task -> the task before it on its replica
        last: dict[tuple[str, int], int] = {}
        by_mb: dict[tuple[str, int, int, str], int] = {}
        for i, (n, r, m, kind, _, _) in enumerate(tasks):
            prev_of[i] = last.get((n, r))
            last[(n, r)] = i
            by_mb[(n, r, m, kind)] = i
        where = sim.where  # (section, sample) -> (its replica, micro-batch)
        transfer = self.costs.transfer_s
        i = max(range(len(tasks)), key=lambda k: tasks[k][5])
        out: list[tuple[str, int]] = []
        for _ in range(len(tasks)):
            n, r, m, kind, start, _ = tasks[i]
            out.append((n, r))
            prev = prev_of[i]
            if prev is not None and tasks[prev][5] >= start - 1e-12:
                i = prev  # it ran as soon as its replica was free
                continue
            # It waited: for an input (a forward) or a gradient (a backward). Follow the latest.
            deps = []
            for sid in sim.by_name[(n, r)].mbs[m]:
                for other in (self.inputs[n] if kind == "forward" else self.grads_from[n]):
                    if (other, sid) in where:
                        o_rep, o_m = where[(other, sid)]
                        o_r = o_rep.index
                        k = by_mb.get((other, o_r, o_m, "backward" if kind == "backward" else "forward"))
                        if k is None:
                            k = by_mb.get((other, o_r, o_m, "forward"))
                        if k is not None:
                            deps.append(k)
            dep = max(deps, key=lambda k: tasks[k][5], default=None)
            if dep is not None and tasks[dep][5] + transfer >= start - 1e-12:
                i = dep
            elif prev is not None:
                i = prev  # held by a gate, or its wait was shorter than it looks: go on along the replica
            else:
                break
        return out

    def change(self, plan: Plan, chain: list[tuple[str, int]], rng: random.Random) -> Plan | None:
        """One random change of `plan` (a new plan with recomputed gates), or None where the
        drawn change does not apply or changes nothing once consumers are back in send order."""
        n, r = rng.choice(chain) if chain and rng.random() < P_CHAIN else rng.choice(self.replicas)
        sections = self.graph.sections
        reps = [list(map(list, mbs)) for mbs in plan.replicas[n]]
        routes, replicas = plan.routes, None
        if rng.random() < P_ROUTE:
            if sections[n].dp < 2:
                return None
            other = rng.randrange(sections[n].dp - 1)
            other += other >= r
            mine, theirs = reps[r], reps[other]
            if not mine or not theirs:
                return None
            a, b = rng.choice(mine), rng.choice(theirs)
            i, j = rng.randrange(len(a)), rng.randrange(len(b))
            if rng.random() < P_MOVE:  # a sample moves to the other replica (its load changes by it alone)
                routes = self._move(mine, theirs, a, i, routes, n, r, other, sections[n].micro_batch, rng)
                if routes is None:
                    return None
            elif self.routable(routes, n, a[i], other) and self.routable(routes, n, b[j], r):
                a[i], b[j] = b[j], a[i]
                routes = {**routes, n: {**routes[n], a[i]: r, b[j]: other}}
            else:  # the other replica serves other replicas downstream (or upstream): swap them everywhere
                swapped = self._swap_everywhere(plan, a[i], b[j])
                if swapped is None:
                    return None
                replicas, routes, changed = swapped
        elif not self._within(reps[r], sections[n].micro_batch, rng):
            return None
        if replicas is None:  # section n's micro-batches, changed in place (none left empty)
            replicas, changed = {**plan.replicas, n: tuple(tuple(tuple(mb) for mb in rep if mb) for rep in reps)}, {n}
        for c, p in self.in_order.items():
            if changed & {c, p}:
                replicas[c] = sent_order(replicas[p], replicas[c], self.takes[p], self.takes[c], routes[p], routes[c])
        if routes is plan.routes and all(replicas[m] == plan.replicas[m] for m in self.comp):
            return None
        return self.gated(replace(plan, replicas=replicas, routes=routes))

    def _move(self, mine: list[list[int]], theirs: list[list[int]], a: list[int], i: int,
              routes: dict[str, dict[int, int]], n: str, r: int, other: int, size: int,
              rng: random.Random) -> dict[str, dict[int, int]] | None:
        """Sample a[i] of replica r leaves for replica `other` of `n`: into one of its micro-batches
        with room, or a micro-batch of its own there; the new routes, or None where the move does
        not apply (it would empty replica r, or an edge's blocks forbid it)."""
        sid = a[i]
        if sum(map(len, mine)) < 2 or not self.routable(routes, n, sid, other):
            return None
        a.pop(i)
        k = rng.randrange(len(theirs) + 1)
        if k < len(theirs) and len(theirs[k]) < size:
            theirs[k].append(sid)
        else:
            theirs.insert(rng.randrange(len(theirs) + 1), [sid])
        return {**routes, n: {**routes[n], sid: other}}

    def _swap_everywhere(self, plan: Plan, a: int, b: int) -> tuple[dict, dict, set[str]] | None:
        """Samples `a` and `b` trade places (micro-batch and route) in every section of the
        component, which keeps every edge's blocks; None unless the same sections take both."""
        takes = [m for m in self.comp if a in self.takes[m]]
        if takes != [m for m in self.comp if b in self.takes[m]]:
            return None
        other = {a: b, b: a}
        replicas, routes = dict(plan.replicas), dict(plan.routes)
        for m in takes:
            replicas[m] = tuple(tuple(tuple(other.get(sid, sid) for sid in mb) for mb in rep) for rep in replicas[m])
        for m in self.comp:
            routes[m] = {**routes[m], a: routes[m][b], b: routes[m][a]}
        return replicas, routes, set(takes)

    @staticmethod
    def _within(mbs: list[list[int]], size: int, rng: random.Random) -> bool:
        """Change one replica's micro-batches in place; False where the drawn change does not apply."""
        if not mbs:
            return False
        kind, i = rng.randrange(4), rng.randrange(len(mbs))
        if kind == 3:  # split a micro-batch in two
            if len(mbs[i]) < 2:
                return False
            cut = rng.randrange(1, len(mbs[i]))
            mbs[i:i + 1] = [mbs[i][:cut], mbs[i][cut:]]
            return True
        j = rng.randrange(len(mbs))
        if i == j:
            return False
        if kind == 0:  # a sample moves to another micro-batch
            if len(mbs[j]) >= size:
                return False
            mbs[j].append(mbs[i].pop(rng.randrange(len(mbs[i]))))
        elif kind == 1:  # two samples swap micro-batches
            a, b = rng.randrange(len(mbs[i])), rng.randrange(len(mbs[j]))
            mbs[i][a], mbs[j][b] = mbs[j][b], mbs[i][a]
        else:  # a micro-batch moves to another place in the order
            mbs.insert(j, mbs.pop(i))
        return True
