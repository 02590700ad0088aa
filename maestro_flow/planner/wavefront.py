"""The wavefront planner: order every global batch so the critical section never waits.

Pure (standard library only). Per connected component:
  1. the critical section is the one with the most work per replica (usually the LLM/student);
  2. samples are assigned to replicas balancing cost across every section at once (balance.py);
  3. a greedy event simulation of the step decides each replica's micro-batches (ordering.py):
     producers serve the consumer replica that would run out of work first, in Johnson's order,
     within a run-ahead credit; consumers take what has arrived, oldest first, and fill the rest
     with samples that need nothing upstream (text while the encoder works);
  4. that simulation is played out under several sets of rules (rules.CANDIDATES: e.g. answer
     a trainable encoder's gradients promptly, taper its last micro-batches, keep long text for
     the middle of the step, fit big encoder jobs into the LLM's buffer, run text that ends
     before the next encoder output, cut an encoder micro-batch an LLM replica would starve
     behind) and the order whose simulated step ends first is kept (on a tie, the one with
     fewer micro-batches). Its
     simulation is simulate.py's (except where a section has several producer sections: there
     simulate.py itself judges), so the choice is exact, not estimated. CANDIDATE_BUDGET
     (samples x orderings) bounds the work: a large batch plays out only the first candidates,
     and stops at one within GOOD_ENOUGH of simulate.bound_terms' bound, which keeps a 4096-sample
     step under 100 ms. Then, where an LLM that pads its micro-batches takes one encoder's
     outputs in their send order, that encoder sends each micro-batch's samples longest first
     and the LLM sorts what it holds by length (regroup.py), kept where simulate.py finds the
     step shorter (not for batches too large to try every rule set);
  5. where the best order still ends more than 2% over the bound, a bounded local search
     (refine.py) changes its micro-batches, their order and routes and keeps what its
     simulation shows shorter, within a share of the step's planned time (Pipeline.plan_search,
     default 0.5; not for batches too large to try every rule set);
  6. FIFO's order is a candidate too: where it simulates shorter than every ordering (only
     simulated where its replicas' work alone does not already rule it out), it is kept for
     that component, so the wavefront is never slower than FIFO under simulate.py.
The recorded order is the plan (schedule "wavefront"; `Plan.variant` names the rules that won,
"regrouped <rules>" where step 4's regrouping was kept, "refined ..." where the search then
shortened the order);
transfers follow it, so both ends of every pair agree.

    image samples i1..i4 (encoder cost 1, LLM cost 2), text t1..t4 (LLM cost 1); vision dp=1
    mb=1 -> llm dp=1 mb=2:   vision: [i1] [i2] [i3] [i4]
                             llm:    [t1,t2] [i1,t3] [i2,i3] [i4,t4]   (never waits)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.balance import assign
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.credit import credit_gates
from maestro_flow.planner.fifo import FifoPlanner
from maestro_flow.planner.ordering import Ordering
from maestro_flow.planner.plan import Plan
from maestro_flow.planner.refine import refine
from maestro_flow.planner.regroup import regroup
from maestro_flow.planner.routed import Routed
from maestro_flow.planner.routing import components
from maestro_flow.planner.rules import CANDIDATES, Rules
from maestro_flow.planner.simulate import bound_terms, critical_of, simulate
from maestro_flow.samples import SampleMeta

CANDIDATE_BUDGET = 8192  # samples x orderings played out per plan (4096 samples: the first two)
GOOD_ENOUGH = 0.005  # where the budget cuts candidates: an ordering this close to the bound ends the search


class WavefrontPlanner:
    schedule = "wavefront"

    def __init__(self, graph: SectionGraph, costs: CostModel, run_ahead: int | None = None,
                 candidates: Sequence[Rules] = CANDIDATES, versus_fifo: bool = True, search: float | None = None
                 ) -> None:
        self.graph = graph
        self.costs = costs
        self.run_ahead = run_ahead
        # Share of a step's planned seconds refine.py's search may take (None: the pipeline's plan_search).
        self.search = graph.pipeline.plan_search if search is None else search
        for rules in candidates:
            rules.validate()
        self.candidates = tuple(candidates)
        self.versus_fifo = versus_fifo

    def _task(self, n: str, samples: Sequence[SampleMeta], fwd: dict[int, float],
              active: dict[str, list[int]]) -> dict[int, float]:
        """simulate.task_s for every sample of one section, without re-deriving the graph facts
        (`active[c]`: the samples section c activates on)."""
        graph, section = self.graph, self.graph.sections[n]
        if not section.trainable:
            return dict(fwd)
        factor = 1.0 + self.costs.costs[n].backward_factor
        if n in graph.loss_sections():
            return {sid: f * factor for sid, f in fwd.items()}
        grads = set().union(*(active[e.edge.dst] for e in graph.needs_grad_from(n)))  # a consumer sends one back
        return {s.id: fwd[s.id] * (factor if s.id in grads else 1.0) for s in samples}

    def tried(self, num_samples: int) -> tuple[Rules, ...]:
        """The candidates one plan of `num_samples` samples plays out (at least one)."""
        return self.candidates[:max(1, min(len(self.candidates), CANDIDATE_BUDGET // max(1, num_samples)))]

    def plan(self, step: int, samples: Sequence[SampleMeta]) -> Plan:
        return self._plan(step, samples, self.tried(len(samples)), self.versus_fifo, self.search)[0]

    def plan_with(self, step: int, samples: Sequence[SampleMeta], rules: Rules) -> tuple[Plan, float]:
        """The plan one set of rules makes alone (no other candidate, no FIFO, no search), and its makespan
        as the ordering simulated it: simulate(plan).makespan_s exactly (tests/unit/test_ordering.py)."""
        rules.validate()
        return self._plan(step, samples, (rules,), False, 0.0)

    def _plan(self, step: int, samples: Sequence[SampleMeta], tried: Sequence[Rules], versus_fifo: bool,
              search: float) -> tuple[Plan, float]:
        graph = self.graph
        sections = graph.sections
        # Every per-sample cost once: forward, and all the work (forward + backward) it causes.
        fwd = {n: self.costs.samples_s(n, samples) for n in graph.order}
        active = {n: [s.id for s in samples if sections[n].activates(s.modalities)] for n in graph.order}
        task = {n: self._task(n, samples, fwd[n], active) for n in graph.order}
        chosen: list[tuple[list[str], float, str, dict, dict, dict]] = []  # comp, makespan, rules, routes, mbs, gates
        hurry = len(tried) < len(self.candidates)  # a large batch: the budget cut the candidates short
        comps = components(graph)
        anchors = []  # each component's critical section (_versus_fifo's gates anchor there too)
        for index, comp in enumerate(comps):
            terms = bound_terms(samples, graph, self.costs, sections=comp, fwd=fwd, task=task)
            anchor = critical_of(terms, graph.order)  # the most work per replica, fixed costs included
            anchors.append(anchor)
            cost = {n: {sid: task[n][sid] for sid in active[n]} for n in comp}  # absent: not activated
            bound = max(terms.values())
            # The ordering's own simulation is simulate.py's exactly unless a section has several
            # producer sections (their orders differ, and the gates let the executor run one of
            # them ahead by up to a consumer micro-batch more than the ordering assumed): there,
            # each candidate is simulated.
            exact = all(len(graph.inputs(n)) <= 1 for n in comp)
            routed_by: dict[str, Routed] = {}  # one assignment per balance rule
            best = None
            for rules in tried:
                if rules.balance not in routed_by:
                    routes = assign(graph, anchor, comp, samples, cost, share=rules.balance == "share")
                    routed_by[rules.balance] = Routed(graph, comp, active, routes, task)
                routed = routed_by[rules.balance]
                order = Ordering(graph, self.costs, comp, routed, self.run_ahead, anchor, fwd, task, rules)
                mbs = order.run()
                span = order.makespan_s if exact else self._simulated(comp, samples, mbs, order.gates())
                # Equally short (to rounding): the one with fewer micro-batches (fuller ones run
                # more efficiently than the cost model says), then the earlier candidate.
                count = sum(len(rep) for reps in mbs.values() for rep in reps)
                if best is None or span < best[0] - 1e-9 * best[0] or (span <= best[0] + 1e-9 * best[0]
                                                                        and count < best[1]):
                    best = (span, count, rules.name, routed.routes, mbs, order)
                if hurry and best[0] <= bound * (1 + GOOD_ENOUGH):
                    break  # no candidate can do much better: spare the time
            span, _, name, routes, mbs, order = best
            gates = order.gates()
            if not hurry:
                regrouped, span = self._regrouped(comp, samples, routes, mbs, gates, span, fwd)
                if regrouped is not mbs:
                    mbs, name = regrouped, f"regrouped {name}"
            if search > 0 and not hurry:  # a batch too large to try every rule set is not searched either
                start = self._component_plan(samples, comp, mbs, gates, routes)
                better = refine(graph, self.costs, comp, start, span, bound, anchor, order.credit[anchor],
                                search / len(comps), seed=step * 1009 + index)
                if better is not None:
                    span, name = better.makespan_s, f"refined {name}"
                    routes, mbs, gates = better.routes, better.replicas, better.gates
            chosen.append((comp, span, name, routes, mbs, gates))
        if versus_fifo:
            chosen = self._versus_fifo(step, samples, active, task, chosen, anchors)
        replicas, routes, gates = {}, {}, {}
        for _, _, _, comp_routes, comp_mbs, comp_gates in chosen:
            routes.update(comp_routes)
            replicas.update(comp_mbs)
            gates.update(comp_gates)
        names = [name for _, _, name, _, _, _ in chosen]
        plan = Plan(step=step, schedule=self.schedule, samples=tuple(samples),
                    replicas={n: replicas[n] for n in graph.order}, routes=routes,
                    gates={n: gates[n] for n in graph.order if n in gates},
                    variant="+".join(names) if len(set(names)) > 1 else (names[0] if names else ""))
        return plan, max((span for _, span, *_ in chosen), default=0.0)

    def _regrouped(self, comp: list[str], samples: Sequence[SampleMeta], routes: dict, mbs: dict, gates: dict,
                   span: float, fwd: dict[str, dict[int, float]]) -> tuple[dict, float]:
        """regroup.py's orders of a padding consumer and its producer (narrow, then wide runs): the
        shortest under simulate.py (the order's own gates), the order as it was on a tie."""
        padded = {n: self.costs.costs[n].padded for n in comp}
        best = (mbs, span)
        for wide in (False, True):
            new = regroup(self.graph, comp, mbs, routes, fwd, padded, gates, wide=wide)
            if new is None:
                continue
            try:
                new_span = self._simulated(comp, samples, new, gates)
            except ValueError:  # the gates wait in a circle on the new order: not a candidate
                continue
            if new_span < best[1] * (1 - 1e-9):
                best = (new, new_span)
        return best

    def _component_plan(self, samples: Sequence[SampleMeta], comp: list[str], mbs: dict, gates: dict,
                        routes: dict | None = None) -> Plan:
        """One component's order as a plan of its own (the other sections' replicas idle)."""
        sections = self.graph.sections
        return Plan(step=0, schedule=self.schedule, samples=tuple(samples),
                    replicas={n: mbs[n] if n in mbs else tuple(() for _ in range(sections[n].dp)) for n in self.graph.order},
                    routes=routes or {}, gates=gates)

    def _simulated(self, comp: list[str], samples: Sequence[SampleMeta], mbs: dict, gates: dict) -> float:
        """simulate.py's makespan of one component's order (the other sections idle)."""
        return simulate(self._component_plan(samples, comp, mbs, gates), self.graph, self.costs).makespan_s

    def _versus_fifo(self, step: int, samples: Sequence[SampleMeta], active: dict[str, list[int]],
                     task: dict[str, dict[int, float]], chosen: list, anchors: list[str]) -> list:
        """Keep FIFO's order for a component where it simulates shorter than the best ordering.

        With an explicit run_ahead, FIFO's order gets the same run-ahead gates as the
        wavefront's (the memory bound the user set holds whichever order is kept); without, it
        runs as FIFO plans it, ungated (the producer then runs ahead as under schedule "fifo").
        Its makespan is at least the busiest of its replicas' work, which costs nothing to
        compute; only where that floor is below the wavefront's makespan is it simulated (small
        batches, mostly: at 4096 samples FIFO's count-balanced replicas rule it out)."""
        planner = FifoPlanner(self.graph, self.costs)
        sections = self.graph.sections
        doubtful = []
        for i, (comp, span, *_) in enumerate(chosen):
            routes = planner.routes(comp, samples)
            floor = 0.0
            for n in comp:
                load = [0.0] * sections[n].dp
                route, cost = routes[n], task[n]
                for sid in active[n]:
                    load[route[sid]] += cost[sid]
                floor = max(floor, max(load))
            if floor < span:
                doubtful.append(i)
        if not doubtful:
            return chosen
        fifo = planner.plan(step, samples)
        gates = {}
        for i in doubtful:
            comp = chosen[i][0]
            if self.run_ahead is None:
                gates.update({n: tuple(tuple(() for _ in rep) for rep in fifo.replicas[n]) for n in comp})
            else:
                gates.update(credit_gates(self.graph, fifo, comp, anchors[i], self.run_ahead))
        fifo = dataclasses.replace(fifo, gates={n: gates[n] for n in self.graph.order if n in gates})
        try:
            sim = simulate(fifo, self.graph, self.costs)
        except ValueError:  # its gates wait in a circle (only with a tiny run_ahead): not a candidate
            return chosen
        out = list(chosen)
        for i in doubtful:
            comp, span = chosen[i][0], chosen[i][1]
            fifo_span = max((f for n in comp for f in sim.finish_s[n]), default=0.0)
            if fifo_span < span:
                out[i] = (comp, fifo_span, "fifo", {n: fifo.routes[n] for n in comp},
                          {n: fifo.replicas[n] for n in comp}, {n: gates[n] for n in comp})
        return out
