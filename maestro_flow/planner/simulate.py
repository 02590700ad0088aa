"""Event simulation of a plan under the cost model, and a lower bound no ordering can beat.

Pure (standard library only). Each replica is one serial processor that behaves as the runtime's
executor does: it runs its micro-batches in plan order, each once every input has arrived and
its run-ahead credits allow (the plan's gates: a consumer must have finished so many forwards); a
trainable section that is not a loss section runs a micro-batch's backward as soon as every
gradient for it has returned, before its next forward; a loss section runs forward and backward
of a micro-batch as one task. A micro-batch's forward costs its section's fixed cost per
micro-batch (Cost.per_micro_batch_s) plus its samples' costs, each at the costliest one's
where the stage pads (CostModel.batch_s); its backward, backward_factor times that. Outputs and
gradients arrive `transfer_s` after the task that made them. Where CostModel.message_s gives a
section a cost per message received, each message (forward: one per producer micro-batch, edge
and consumer replica; backward: one per consumer micro-batch, edge and producer replica; as the
executor sends them, `message_counts`) adds it to the first task of the receiving replica that
uses it. Reduction and optimizer time are not modelled (the same for every ordering). The lower
bound leaves padding out, and charges each section's fixed cost per micro-batch for the fewest
micro-batches its samples fit in (no micro-batch holds more than the section's micro_batch), so
it stays a bound whatever the micro-batches:

    lower bound = max over sections S of  work(S) / dp(S)
                  max over edges P -> C of  t0 + work(C, samples needing P) / dp(C)
                                            (t0: the cheapest single output P can produce, + transfer_s)
                  max over edges P -> C of  forward work(P, samples C takes) / dp(P) + transfer
                                            + cheapest C task

where work(S, samples) is every sample's task_s plus fixed_s: per_micro_batch_s times the fewest
micro-batches (ceil(samples / micro_batch)), and backward_factor times the fewest that need a
backward. The critical section is the one with the largest work(S) / dp(S).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.plan import Plan
from maestro_flow.samples import SampleMeta

INF = float("inf")
LIMIT_SLACK = 1e-12  # relative: a replica's seconds still to run are kept by subtraction, so they round


@dataclass(frozen=True, kw_only=True, slots=True)
class Simulation:
    makespan_s: float
    lower_bound_s: float
    critical_section: str
    critical_busy_fraction: float
    busy_s: dict[str, tuple[float, ...]]  # section -> per replica
    finish_s: dict[str, tuple[float, ...]]
    tasks: tuple[Task, ...] = ()  # every task run, in start order per replica
    bound_terms: dict[str, float] = field(default_factory=dict)  # bound_terms(): lower_bound_s is their max

    def to_json_dict(self) -> dict[str, Any]:
        return {"makespan_s": self.makespan_s, "lower_bound_s": self.lower_bound_s,
                "critical_section": self.critical_section,
                "critical_busy_fraction": self.critical_busy_fraction,
                "busy_s": {k: list(v) for k, v in self.busy_s.items()}}


@dataclass(frozen=True, slots=True)
class Task:
    section: str
    replica: int
    micro_batch: int
    kind: str  # "forward" (for a loss section: forward + backward) or "backward"
    start_s: float
    end_s: float


@dataclass
class _Replica:
    section: str
    index: int
    mbs: tuple[tuple[int, ...], ...]
    fwd_cost: list[float]
    bwd_cost: list[float]  # 0 where no separate backward task
    has_bwd: list[bool]  # a separate backward task (a zero cost one too: it still sends the gradients)
    missing: list[int]  # per mb: inputs (producer section, sample) still to arrive
    grads_needed: list[int]  # per mb: gradient messages still to come (separate backward only)
    next_fwd: int = 0
    free_at: float = 0.0
    busy: float = 0.0
    bwd_order: list[int] = field(default_factory=list)  # mbs with a backward, run in this order (as the executor)
    next_bwd: int = 0  # index into bwd_order
    grad_ready: list[float] = field(default_factory=list)  # per mb: latest gradient arrival
    inputs_at: list[float] = field(default_factory=list)  # per mb: latest input arrival so far
    finish: float = 0.0
    waiting: bool = False
    slot: int = 0  # index in _Sim.replicas
    gates: tuple = ()  # per mb: ((consumer section, replica, j), ...)
    fwd_ends: list[float] = field(default_factory=list)
    left: float = 0.0  # seconds of tasks still to run


class _Sim:
    def __init__(self, plan: Plan, graph: SectionGraph, costs: CostModel, memo: dict | None = None) -> None:
        """`memo` (optional, owned by the caller): each micro-batch's costs and inputs by (section,
        samples), kept across simulations of plans of the same samples, graph and costs that share
        micro-batches (refine.py's search)."""
        self.graph, self.costs = graph, costs
        self.samples, self.meta = plan.samples, None  # sample id -> SampleMeta, built on a memo's first miss
        self.where: dict[tuple[str, int], tuple[_Replica, int]] = {}  # (section, sid) -> replica, mb
        self.replicas: list[_Replica] = []
        self.losses = set(graph.loss_sections())
        memo = {} if memo is None else memo
        for name in graph.order:
            for r, mbs in enumerate(plan.replicas[name]):
                facts = [memo.get((name, mb)) or memo.setdefault((name, mb), self._facts(name, mb)) for mb in mbs]
                rep = _Replica(section=name, index=r, mbs=mbs, fwd_cost=[f[0] for f in facts],
                               bwd_cost=[f[1] for f in facts], missing=[f[2] for f in facts],
                               grads_needed=[f[3] for f in facts], grad_ready=[0.0] * len(mbs),
                               has_bwd=[f[3] > 0 for f in facts], bwd_order=[m for m, f in enumerate(facts) if f[3]],
                               inputs_at=[0.0] * len(mbs),
                               slot=len(self.replicas), gates=plan.gates_of(name, r),
                               left=sum(f[0] + f[1] for f in facts))
                self.replicas.append(rep)
                for m, mb in enumerate(mbs):
                    for s in mb:
                        self.where[(name, s)] = (rep, m)
        self.consumers = {name: list(dict.fromkeys(e.edge.dst for e in graph.outputs(name))) for name in graph.order}
        self.by_name = {(r.section, r.index): r for r in self.replicas}
        # Producer replicas whose run-ahead gates wait on a consumer replica: woken by its forwards.
        self.gated_by: dict[tuple[str, int], list[_Replica]] = {}
        for rep in self.replicas:
            for c, ci in {(c, ci) for gates in rep.gates for c, ci, _ in gates}:
                self.gated_by.setdefault((c, ci), []).append(rep)
        self.grad_producers = {name: [e.edge.src for e in graph.inputs(name) if e.carries_grad]
                               for name in graph.order}
        if costs.message_s:
            self._charge_messages(message_counts(graph, plan.replicas))
        self.heap: list[tuple[float, int]] = []
        self.limit, self.over = INF, False
        self.tasks: list[tuple[str, int, int, str, float, float]] = []  # Task's fields, in start order

    def _charge_messages(self, counts: dict[tuple[str, int], list[tuple[int, int]]]) -> None:
        """CostModel.message_s per message received, on the task that takes it first."""
        for rep in self.replicas:
            each = self.costs.message_s.get(rep.section, 0.0)
            if not each:
                continue
            for m, (fwd, bwd) in enumerate(counts[(rep.section, rep.index)]):
                extra_f, extra_b = fwd * each, (bwd * each if rep.has_bwd[m] else 0.0)
                rep.fwd_cost[m] += extra_f
                rep.bwd_cost[m] += extra_b
                rep.left += extra_f + extra_b

    def _facts(self, name: str, mb: tuple[int, ...]) -> tuple[float, float, int, int]:
        """One micro-batch's forward and backward seconds (a loss section's forward includes its
        backward), how many (producer, sample) outputs it needs, and the gradients it waits for
        (0: no separate backward task)."""
        graph, costs, section = self.graph, self.costs, self.graph.sections[name]
        if self.meta is None:
            self.meta = {s.id: s for s in self.samples}
        metas = [self.meta[s] for s in mb]
        f = costs.batch_s(name, metas)
        b = f * costs.costs[name].backward_factor if section.trainable else 0.0
        if name in self.losses:
            f, b = f + b, 0.0
        expected = sum(1 for e in graph.needs_grad_from(name) for s in metas
                       if graph.sections[e.edge.dst].activates(s.modalities))
        needs = len({(e.edge.src, s.id) for e in graph.inputs(name) for s in metas
                     if graph.sections[e.edge.src].activates(s.modalities)})
        if not section.trainable or name in self.losses:
            expected = 0  # no separate backward: nothing waits for gradients
        return f, (b if expected else 0.0), needs, expected  # the executor skips a backward nobody needs

    @property
    def makespan_s(self) -> float:
        """When the last task ends (after run())."""
        return max((rep.finish for rep in self.replicas), default=0.0)

    def run(self, limit: float = INF) -> bool:
        """Play the plan out; False (stopped early) as soon as some replica cannot end by `limit`."""
        self.limit = limit
        for i in range(len(self.replicas)):
            heapq.heappush(self.heap, (0.0, i))
        while self.heap:
            t, i = heapq.heappop(self.heap)
            self._step(self.replicas[i], i, t)
            if self.over:
                return False
        return True

    def _inputs_ready(self, rep: _Replica, m: int) -> float:
        ready = INF if rep.missing[m] else rep.inputs_at[m]
        for c, ci, j in rep.gates[m]:  # run-ahead credit: the consumer must have finished j forwards
            ends = self.by_name[(c, ci)].fwd_ends
            ready = max(ready, ends[j - 1] if len(ends) >= j else INF)
        return ready

    def _step(self, rep: _Replica, i: int, t: float) -> None:
        if t < rep.free_at:
            return  # busy: its own completion event decides next
        rep.waiting = False
        # Backwards run oldest first, as the executor runs them (gradients accumulate in
        # micro-batch order): a later micro-batch whose gradients came back first waits.
        bwd_at = self._backward_ready(rep)
        if bwd_at <= t:
            m = rep.bwd_order[rep.next_bwd]
            rep.next_bwd += 1
            self._run(rep, i, t, rep.bwd_cost[m], m, "backward")
            self._send_grads(rep, m, rep.free_at)
            return
        if rep.next_fwd < len(rep.mbs):
            ready = self._inputs_ready(rep, rep.next_fwd)
            if ready <= t:
                m = rep.next_fwd
                rep.next_fwd += 1
                self._run(rep, i, t, rep.fwd_cost[m], m, "forward")
                self._emit(rep, m, rep.free_at)
                return
        else:
            ready = INF
        wake = min(ready, bwd_at)
        rep.waiting = True
        if wake < INF:
            heapq.heappush(self.heap, (wake, i))
        # else: blocked until a producer's output or a consumer's gradient wakes it (see _wake).

    @staticmethod
    def _backward_ready(rep: _Replica) -> float:
        """When the oldest backward still to run can start (INF: its gradients are not all in)."""
        if rep.next_bwd == len(rep.bwd_order):
            return INF
        m = rep.bwd_order[rep.next_bwd]
        return rep.grad_ready[m] if m < rep.next_fwd and not rep.grads_needed[m] else INF

    def _run(self, rep: _Replica, i: int, t: float, cost: float, m: int, kind: str) -> None:
        end = t + cost
        self.tasks.append((rep.section, rep.index, m, kind, t, end))
        rep.left -= cost
        if end + rep.left > self.limit * (1 + LIMIT_SLACK):
            self.over = True
        if kind == "forward":
            rep.fwd_ends.append(end)
            for prep in self.gated_by.get((rep.section, rep.index), ()):  # a credit may come back
                self._wake(prep, end)
        rep.free_at = rep.finish = end  # a replica's tasks run one after another
        rep.busy += cost
        heapq.heappush(self.heap, (end, i))

    def _wake(self, rep: _Replica, t: float) -> None:
        if rep.waiting:
            heapq.heappush(self.heap, (max(t, rep.free_at), rep.slot))

    def _emit(self, rep: _Replica, m: int, done: float) -> None:
        arrive = done + self.costs.transfer_s
        name = rep.section
        where = self.where
        for consumer in self.consumers[name]:
            for s in rep.mbs[m]:
                hit = where.get((consumer, s))
                if hit is not None:
                    crep, cm = hit
                    crep.missing[cm] -= 1
                    if arrive > crep.inputs_at[cm]:
                        crep.inputs_at[cm] = arrive
                    if not crep.missing[cm] and cm == crep.next_fwd:  # else this arrival changes nothing now
                        self._wake(crep, crep.inputs_at[cm])
        if not rep.has_bwd[m]:  # loss section (backward done), frozen, or no gradient expected
            self._send_grads(rep, m, done)

    def _send_grads(self, rep: _Replica, m: int, done: float) -> None:
        arrive = done + self.costs.transfer_s
        for producer in self.grad_producers[rep.section]:
            for s in rep.mbs[m]:
                if (producer, s) not in self.where:
                    continue
                prep, pm = self.where[(producer, s)]
                prep.grads_needed[pm] -= 1
                prep.grad_ready[pm] = max(prep.grad_ready[pm], arrive)
                if (prep.has_bwd[pm] and prep.grads_needed[pm] == 0 and prep.next_fwd > pm
                        and prep.bwd_order[prep.next_bwd] == pm):
                    self._wake(prep, prep.grad_ready[pm])  # else it waits for an older backward


def replay(plan: Plan, graph: SectionGraph, costs: CostModel, memo: dict | None = None, limit: float = INF
           ) -> _Sim | None:
    """The plan's event simulation, run (tasks as Task's fields, no bound): what simulate() reports
    on, and what refine.py's search compares plans by. ValueError where the plan cannot complete;
    None, stopped early, once some replica cannot end by `limit` (its tasks still to run, back to
    back, would end after it, by more than LIMIT_SLACK): then the step ends after `limit`. Never
    None without a limit."""
    sim = _Sim(plan, graph, costs, memo)
    if not sim.run(limit):
        return None
    for rep in sim.replicas:
        if rep.next_fwd < len(rep.mbs) or rep.next_bwd < len(rep.bwd_order):
            raise ValueError(f"plan cannot complete: {rep.section}[{rep.index}] is stuck at micro-batch "
                             f"{rep.next_fwd} (a consumer ordered before its producer?)")
    return sim


def simulate(plan: Plan, graph: SectionGraph, costs: CostModel) -> Simulation:
    sim = replay(plan, graph, costs)
    assert sim is not None  # no limit: never stopped early
    busy: dict[str, list[float]] = {n: [] for n in graph.order}
    finish: dict[str, list[float]] = {n: [] for n in graph.order}
    for rep in sim.replicas:
        busy[rep.section].append(rep.busy)
        finish[rep.section].append(rep.finish)
    makespan = sim.makespan_s
    terms = bound_terms(plan.samples, graph, costs)
    bound, critical = max(terms.values(), default=0.0), critical_of(terms, graph.order)
    crit_busy = sum(busy[critical])
    fraction = crit_busy / (makespan * graph.sections[critical].dp) if makespan > 0 else 1.0
    return Simulation(makespan_s=makespan, lower_bound_s=bound, critical_section=critical,
                      critical_busy_fraction=fraction, busy_s={k: tuple(v) for k, v in busy.items()},
                      finish_s={k: tuple(v) for k, v in finish.items()}, tasks=tuple(Task(*t) for t in sim.tasks),
                      bound_terms=terms)


def task_s(graph: SectionGraph, costs: CostModel, name: str, sample: SampleMeta) -> float:
    """All the compute one sample costs `name`: forward, plus backward when a gradient comes
    back for it (a trainable loss section always; another trainable section when a consumer
    that trains activates on the sample), as the executor and the simulation do."""
    f = costs.sample_s(name, sample)
    return f + (costs.backward_s(name, sample) if needs_backward(graph, name, sample) else 0.0)


def message_counts(graph: SectionGraph, replicas: Mapping[str, Sequence[Sequence[Sequence[int]]]]
                   ) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """(section, replica) -> per micro-batch (in plan order): the tensor messages the replica
    receives first for it, (forward inputs, gradients). As runtime/executor.py sends them: a
    producer micro-batch's outputs go to each consumer replica as one message per edge, which
    the consumer's first micro-batch holding one of its samples takes; a consumer micro-batch's
    gradients go to each producer replica as one message per edge, taken by the first backward
    there holding one of its samples. `replicas`: a plan's (Plan.replicas, or plans.jsonl's)."""
    where: dict[tuple[str, int], tuple[int, int]] = {}
    for name, reps in replicas.items():
        for r, mbs in enumerate(reps):
            for m, mb in enumerate(mbs):
                for s in mb:
                    where[(name, s)] = (r, m)
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for name, reps in replicas.items():
        if name not in graph.sections:
            continue
        ins = [(k, e.edge.src) for k, e in enumerate(graph.inputs(name))]
        grads = [(k, e.edge.dst) for k, e in enumerate(graph.needs_grad_from(name))]
        for r, mbs in enumerate(reps):
            seen_f: set[tuple] = set()
            seen_b: set[tuple] = set()
            counts = []
            for mb in mbs:
                f = b = 0
                for s in mb:
                    for k, other in ins:
                        hit = where.get((other, s))
                        if hit is not None and (k, hit) not in seen_f:
                            seen_f.add((k, hit))
                            f += 1
                    for k, other in grads:
                        hit = where.get((other, s))
                        if hit is not None and (k, hit) not in seen_b:
                            seen_b.add((k, hit))
                            b += 1
                counts.append((f, b))
            out[(name, r)] = counts
    return out


def messages_received(graph: SectionGraph, sections: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """section -> the tensor messages its replicas receive in one plan (message_counts, summed);
    `sections`: a plans.jsonl line's "sections" (each with its "replicas")."""
    out: dict[str, int] = {}
    for (name, _), counts in message_counts(graph, {n: body["replicas"] for n, body in sections.items()}).items():
        out[name] = out.get(name, 0) + sum(f + b for f, b in counts)
    return out


def micro_batch_task_s(graph: SectionGraph, costs: CostModel, name: str, samples: Sequence[SampleMeta]) -> float:
    """All the compute one micro-batch costs `name`, as the simulation charges it: its forward
    (padding included), and a backward of all of it when a gradient comes back for any sample."""
    f = costs.batch_s(name, samples)
    if any(needs_backward(graph, name, s) for s in samples):
        f *= 1.0 + costs.costs[name].backward_factor
    return f


def backward_ids(graph: SectionGraph, name: str, samples: Sequence[SampleMeta]) -> set[int]:
    """The ids of `samples` (which `name` activates on) that `name` runs a backward for:
    needs_backward for each, with the graph's facts looked up once."""
    if not graph.sections[name].trainable:
        return set()
    if name in graph.loss_sections():
        return {s.id for s in samples}
    consumers = [graph.sections[e.edge.dst] for e in graph.needs_grad_from(name)]
    return {s.id for s in samples if any(c.activates(s.modalities) for c in consumers)}


def needs_backward(graph: SectionGraph, name: str, sample: SampleMeta) -> bool:
    if not graph.sections[name].trainable:
        return False
    if name in graph._losses:
        return True
    return any(graph.sections[e.edge.dst].activates(sample.modalities) for e in graph.needs_grad_from(name))


def fixed_s(costs: CostModel, name: str, micro_batch: int, forwards: int, backwards: int) -> float:
    """The least fixed cost `name` pays for `forwards` samples, `backwards` of which need a
    backward: per_micro_batch_s for each of the fewest micro-batches they fit in, and
    backward_factor times it for the fewest holding those that need one (found in QA: the bound
    and the critical section left it out, so where small micro-batches made it most of a
    section's time, `maestro plan` named another section critical)."""
    c = costs.costs[name]
    if not c.per_micro_batch_s:
        return 0.0
    return c.per_micro_batch_s * (-(-forwards // micro_batch) + c.backward_factor * -(-backwards // micro_batch))


def critical_of(terms: Mapping[str, float], order: Sequence[str]) -> str:
    """The section whose `work:S` bound term is largest (ties: the later one in `order`)."""
    work = [n for n in order if f"work:{n}" in terms]
    return max(work, key=lambda n: (terms[f"work:{n}"], order.index(n)))


def critical_section(graph: SectionGraph, costs: CostModel, samples) -> str:
    """The section with the most work per replica, its fixed costs per micro-batch included
    (ties: the later one in topological order)."""
    return critical_of(bound_terms(samples, graph, costs), graph.order)


def bound_terms(samples, graph: SectionGraph, costs: CostModel, *, sections: Sequence[str] | None = None,
                fwd: Mapping[str, Mapping[int, float]] | None = None,
                task: Mapping[str, Mapping[int, float]] | None = None) -> dict[str, float]:
    """Every term of the lower bound, named (`work:S`, `head:P->C`, `tail:P->C`); the bound is
    their maximum (see the module docstring). `sections` restricts them to those sections and
    the edges between them; `fwd`/`task` are sample_s and task_s per section and sample id,
    where the caller has them already (the wavefront planner)."""
    wanted = set(graph.order if sections is None else sections)
    names = [n for n in graph.order if n in wanted]
    secs = graph.sections
    active = {n: [s for s in samples if secs[n].activates(s.modalities)] for n in names}
    if task is None:
        task = {n: {s.id: task_s(graph, costs, n, s) for s in active[n]} for n in names}
    if fwd is None:
        fwd = {n: {s.id: costs.sample_s(n, s) for s in active[n]} for n in names}

    # The samples each section with a fixed cost runs a backward for (once: found in review, a
    # test per sample per term doubled the bound's time).
    back = {n: backward_ids(graph, n, active[n]) for n in names if costs.costs[n].per_micro_batch_s}

    def fixed(n: str, of: Sequence[SampleMeta], backward: bool = True) -> float:  # fixed_s of n for `of`
        if n not in back:
            return 0.0
        return fixed_s(costs, n, secs[n].micro_batch, len(of), sum(s.id in back[n] for s in of) if backward else 0)

    terms = {f"work:{n}": (sum(task[n][s.id] for s in active[n]) + fixed(n, active[n])) / secs[n].dp for n in names}
    for e in graph.edges:
        p, c = e.edge.src, e.edge.dst
        if f"work:{p}" not in terms or f"work:{c}" not in terms:
            continue
        both = [s for s in active[p] if secs[c].activates(s.modalities)]
        if not both:
            continue
        t0 = min(fwd[p][s.id] for s in both) + costs.micro_batch_s(p) + costs.transfer_s
        terms[f"head:{p}->{c}"] = t0 + (sum(task[c][s.id] for s in both) + fixed(c, both)) / secs[c].dp
        fwd_p = sum(fwd[p][s.id] for s in both) + fixed(p, both, backward=False)  # the outputs C waits for, at least
        tail = min(task[c][s.id] for s in both) + costs.micro_batch_s(c)
        terms[f"tail:{p}->{c}"] = fwd_p / secs[p].dp + costs.transfer_s + tail
    return terms


