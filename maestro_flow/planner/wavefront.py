"""The wavefront planner: order every global batch so the critical section never waits.

Pure (standard library only). Per connected component:
  1. the critical section is the one with the most work per replica (usually the LLM/student);
  2. samples are assigned to replicas balancing cost across every section at once (balance.py);
  3. a greedy event simulation of the step decides each replica's micro-batches:
     - a section that feeds others (an encoder, a teacher) serves the consumer replica that
       would run out of work first; for each consumer its samples come in Johnson's order
       (cheap-to-produce / expensive-to-consume first, the reverse at the end), which keeps the
       consumer busy from the start and leaves little work after the last output arrives;
       producers run ahead of a consumer replica by at most `run_ahead` samples;
     - a section that consumes takes what has arrived first (oldest first), and fills the rest
       of a micro-batch with samples that need nothing from upstream (text-only samples while
       the encoder works), so it idles only when nothing at all is ready.
The recorded order is the plan; transfers follow it, so both ends of every pair agree.

    image samples i1..i4 (encoder cost 1, LLM cost 2), text t1..t4 (LLM cost 1); vision dp=1
    mb=1 -> llm dp=1 mb=2:   vision: [i1] [i2] [i3] [i4]
                             llm:    [t1,t2] [i1,t3] [i2,t4] [i3] [i4]   (never waits)
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.balance import assign
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.plan import MicroBatches, Plan
from maestro_flow.planner.routing import components
from maestro_flow.samples import SampleMeta

INF = float("inf")


@dataclass
class _Rep:
    section: str
    index: int
    mb: int
    loss: bool
    has_consumers: bool
    todo: set[int] = field(default_factory=set)  # assigned, not yet scheduled
    free: list[int] = field(default_factory=list)  # need nothing from upstream (in priority order)
    arrived: list[tuple[float, int, int]] = field(default_factory=list)  # heap: (arrival, seq, sid)
    missing: dict[int, int] = field(default_factory=dict)  # sid -> producer outputs still to arrive
    mbs: list[tuple[int, ...]] = field(default_factory=list)
    free_at: float = 0.0
    bwd_ready: list[tuple[float, float, int]] = field(default_factory=list)  # heap: (ready, cost, mb)
    grads_missing: dict[int, int] = field(default_factory=dict)  # mb -> gradients still to come
    grads_at: dict[int, float] = field(default_factory=dict)
    inflight: int = 0  # produced for this consumer replica (or in production), not yet consumed
    pending_work: float = 0.0  # consumer-side work of samples produced/in production, not consumed
    free_work: float = 0.0  # consumer-side work of samples that need nothing upstream
    waiting: bool = False
    slot: int = 0


class WavefrontPlanner:
    schedule = "wavefront"

    def __init__(self, graph: SectionGraph, costs: CostModel, run_ahead: int | None = None) -> None:
        self.graph = graph
        self.costs = costs
        self.run_ahead = run_ahead

    def _task(self, n: str, samples: Sequence[SampleMeta], fwd: dict[int, float]) -> dict[int, float]:
        """simulate.task_s for every sample of one section, without re-deriving the graph facts."""
        graph, section = self.graph, self.graph.sections[n]
        if not section.trainable:
            return dict(fwd)
        factor = 1.0 + self.costs.costs[n].backward_factor
        if n in graph.loss_sections():
            return {sid: f * factor for sid, f in fwd.items()}
        consumers = [graph.sections[e.edge.dst] for e in graph.needs_grad_from(n)]
        return {s.id: fwd[s.id] * (factor if any(c.activates(s.modalities) for c in consumers) else 1.0)
                for s in samples}

    def plan(self, step: int, samples: Sequence[SampleMeta]) -> Plan:
        graph = self.graph
        # Every per-sample cost once: forward, and all the work (forward + backward) it causes.
        fwd = {n: {s.id: self.costs.sample_s(n, s) for s in samples} for n in graph.order}
        task = {n: self._task(n, samples, fwd[n]) for n in graph.order}
        routes: dict[str, dict[int, int]] = {}
        replicas: dict[str, tuple[MicroBatches, ...]] = {}
        gates: dict[str, tuple] = {}
        for comp in components(graph):
            work = {n: sum(task[n][s.id] for s in samples if graph.sections[n].activates(s.modalities))
                    for n in comp}
            anchor = max(comp, key=lambda n: (work[n] / graph.sections[n].dp, graph.order.index(n)))
            comp_routes = assign(graph, anchor, comp, samples,
                                 lambda n, s: task[n][s.id] if graph.sections[n].activates(s.modalities) else 0.0)
            routes.update(comp_routes)
            order = _Order(graph, self.costs, comp, samples, comp_routes, self.run_ahead, anchor, fwd, task)
            replicas.update(order.run())
            gates.update(order.gates())
        ordered = {n: replicas[n] for n in graph.order}
        return Plan(step=step, schedule=self.schedule, samples=tuple(samples), replicas=ordered, routes=routes,
                    gates={n: gates[n] for n in graph.order})


class _Order:
    """The greedy event simulation that fixes every replica's micro-batch order."""

    def __init__(self, graph: SectionGraph, costs: CostModel, comp: list[str], samples: Sequence[SampleMeta],
                 routes: dict[str, dict[int, int]], run_ahead: int | None, critical: str,
                 fwd: dict[str, dict[int, float]], task: dict[str, dict[int, float]]) -> None:
        self.graph, self.costs, self.comp = graph, costs, comp
        self.meta = {s.id: s for s in samples}
        self.routes = routes
        self.sections = graph.sections
        self.losses = set(graph.loss_sections())
        self.reps: dict[str, list[_Rep]] = {}
        self.all: list[_Rep] = []
        self.producers = {n: [e.edge.src for e in graph.inputs(n)] for n in comp}
        self.consumers = {n: [e.edge.dst for e in graph.outputs(n)] for n in comp}
        self.grad_to = {n: [e.edge.src for e in graph.inputs(n) if e.carries_grad] for n in comp}
        self.grad_from = {n: [e.edge.dst for e in graph.needs_grad_from(n)] for n in comp}
        self.fwd, self.task = fwd, task
        for n in comp:
            sec = self.sections[n]
            reps = [_Rep(section=n, index=r, mb=sec.micro_batch, loss=n in self.losses,
                         has_consumers=bool(self.consumers[n])) for r in range(sec.dp)]
            self.reps[n] = reps
            for rep in reps:
                rep.slot = len(self.all)
                self.all.append(rep)
        for s in samples:
            for n in comp:
                if not self.sections[n].activates(s.modalities):
                    continue
                rep = self.reps[n][routes[n][s.id]]
                rep.todo.add(s.id)
                need = sum(1 for p in self.producers[n] if self.sections[p].activates(s.modalities))
                if need:
                    rep.missing[s.id] = need
                else:
                    rep.free.append(s.id)
                    rep.free_work += self.task[n][s.id]
        # Consumers fill with free samples most expensive first (list scheduling's classic choice
        # for a balanced tail). Producers serve each consumer replica in Johnson's order.
        for rep in self.all:
            rep.free.sort(key=lambda sid, n=rep.section: (-self.task[n][sid], sid))
        self.queues: dict[tuple[str, int, str, int], list[int]] = {}  # (producer, p, consumer, c) -> sids
        self.heads: dict[tuple[str, int, str, int], int] = {}
        self.keys_of: dict[int, list[tuple[str, int, str, int]]] = {}  # sid -> its queues
        for n in comp:
            for c in self.consumers[n]:
                for s in samples:
                    if self.sections[n].activates(s.modalities) and self.sections[c].activates(s.modalities):
                        key = (n, routes[n][s.id], c, routes[c][s.id])
                        self.queues.setdefault(key, []).append(s.id)
                        self.keys_of.setdefault(s.id, []).append(key)
        for key, sids in self.queues.items():
            n, c = key[0], key[2]
            sids.sort(key=lambda sid, n=n, c=c: _johnson(self.fwd[n][sid], self.task[c][sid], sid))
            self.heads[key] = 0
        self.out_keys: dict[tuple[str, int], list[tuple[str, int, str, int]]] = {}
        self.in_keys: dict[tuple[str, int], list[tuple[str, int, str, int]]] = {}
        for key in sorted(self.queues):
            self.out_keys.setdefault((key[0], key[1]), []).append(key)
            self.in_keys.setdefault((key[2], key[3]), []).append(key)
        self.taken: set[tuple[str, int]] = set()  # (section, sid) scheduled
        # Run-ahead credits protect the critical consumer's memory from a faster producer. A
        # consumer that is not critical needs no such bound: its producer is the slower side,
        # and holding the producer back would only lengthen the step.
        self.credit = {n: (run_ahead if run_ahead is not None else 4 * self.sections[n].micro_batch)
                       if n == critical else INF for n in comp}
        self.heap: list[tuple[float, int]] = []
        self.seq = 0
        self.mb_of: dict[tuple[str, int], int] = {}  # (section, sid) -> its micro-batch index
        self.started_at: dict[tuple[str, int, int], dict[tuple[str, int], int]] = {}
        self._consumed: dict[tuple[str, int, str, int], list[int]] = {}

    # -- the event loop --------------------------------------------------------------------

    def run(self) -> dict[str, tuple[MicroBatches, ...]]:
        for rep in self.all:
            heapq.heappush(self.heap, (0.0, rep.slot))
        while self.heap:
            t, slot = heapq.heappop(self.heap)
            rep = self.all[slot]
            if t < rep.free_at:
                continue
            self._decide(rep, t)
        for rep in self.all:
            if rep.todo:
                raise AssertionError(f"wavefront left {len(rep.todo)} samples of {rep.section}[{rep.index}] unplanned")
        return {n: tuple(tuple(r.mbs) for r in reps) for n, reps in self.reps.items()}

    def gates(self) -> dict[str, tuple[tuple[tuple[tuple[str, int, int], ...], ...], ...]]:
        """Credits as the runtime enforces them: producer micro-batch k of a replica may start once
        each critical consumer replica it feeds has finished enough micro-batches that at most
        `credit` of this producer's outputs (plus one consumer micro-batch) wait there — never
        more than that consumer had finished when the simulation decided k, so the gates cannot
        deadlock and do not slow the planned schedule down."""
        out = {}
        for n, reps in self.reps.items():
            per_rep = []
            for rep in reps:
                per_mb = []
                sent: dict[tuple[str, int], int] = {}
                for k, mb in enumerate(rep.mbs):
                    gate = []
                    for (c, ci), started in sorted(self.started_at.get((n, rep.index, k), {}).items()):
                        crep = self.reps[c][ci]
                        sent[(c, ci)] = sent.get((c, ci), 0) + sum(
                            1 for sid in mb if (n, rep.index, c, ci) in self.keys_of.get(sid, ()))
                        j = _first_covering(self.consumed_from(crep, n, rep.index), sent[(c, ci)] - self.credit[c])
                        # Gates count finished forwards; when this was decided the consumer had
                        # finished at least started - 1. So the credit holds to within one
                        # consumer micro-batch, and the gate never delays the planned schedule.
                        j = min(j, started) - 1
                        if j > 0:
                            gate.append((c, ci, j))
                    per_mb.append(tuple(gate))
                per_rep.append(tuple(per_mb))
            out[n] = tuple(per_rep)
        return out

    def consumed_from(self, crep: _Rep, producer: str, p: int) -> list[int]:
        """Cumulative count of samples from producer replica p in crep's first j micro-batches."""
        key = (crep.section, crep.index, producer, p)
        if key not in self._consumed:
            counts, total = [0], 0
            for mb in crep.mbs:
                total += sum(1 for sid in mb if (producer, p, crep.section, crep.index) in self.keys_of.get(sid, ()))
                counts.append(total)
            self._consumed[key] = counts
        return self._consumed[key]

    def _decide(self, rep: _Rep, t: float) -> None:
        rep.waiting = False
        if rep.bwd_ready and rep.bwd_ready[0][0] <= t:
            _, cost, m = heapq.heappop(rep.bwd_ready)
            self._busy(rep, t, cost)
            self._send_grads(rep, rep.mbs[m], rep.free_at)
            return
        batch = self._pick_producer(rep, t) if rep.has_consumers else self._pick_consumer(rep, t)
        if batch:
            self._forward(rep, t, batch)
            return
        rep.waiting = True
        # Wake at the next arrival or gradient; a producer held back by run-ahead credits is
        # woken by its consumer when a credit comes back (_forward).
        wake = min([a for a, _, _ in rep.arrived if a > t] + [b for b, _, _ in rep.bwd_ready if b > t], default=INF)
        if wake < INF:
            heapq.heappush(self.heap, (wake, rep.slot))
        # An idle consumer overrides run-ahead credits: wake producers that held back for it.
        for key in self.in_keys.get((rep.section, rep.index), ()):
            prep = self.reps[key[0]][key[1]]
            if prep.waiting:
                heapq.heappush(self.heap, (max(t, prep.free_at), prep.slot))

    def _pick_consumer(self, rep: _Rep, t: float) -> list[int]:
        batch = []
        while rep.arrived and rep.arrived[0][0] <= t and len(batch) < rep.mb:
            batch.append(heapq.heappop(rep.arrived)[-1])
        while len(batch) < rep.mb and rep.free:
            batch.append(rep.free.pop(0))
        return batch

    def _head(self, key: tuple[str, int, str, int], available: set[int]) -> int | None:
        """The first sample of a producer->consumer queue that is not taken and can be produced now."""
        queue, n = self.queues[key], key[0]
        i = self.heads[key]
        while i < len(queue) and (n, queue[i]) in self.taken:
            i += 1
        self.heads[key] = i
        for sid in queue[i:]:
            if (n, sid) not in self.taken and sid in available:
                return sid
        return None

    def _pick_producer(self, rep: _Rep, t: float) -> list[int]:
        """Serve the consumer replica that would starve first, within its run-ahead credit."""
        n = rep.section
        available = set(rep.free) | {sid for a, _, sid in rep.arrived if a <= t}
        keys = self.out_keys.get((n, rep.index), [])
        starve = {k: max(t, c.free_at) + c.free_work + c.pending_work
                  for k in keys for c in (self.reps[k[2]][k[3]],)}
        batch: list[int] = []
        while len(batch) < rep.mb:
            sid = None
            for k in sorted(keys, key=lambda k: (starve[k], k)):
                c = self.reps[k[2]][k[3]]
                if c.inflight >= self.credit[k[2]] and not c.waiting:
                    continue  # far enough ahead of this consumer; serve it again once it catches up
                sid = self._head(k, available)
                if sid is not None:
                    break
            if sid is None:
                # Samples that no consumer replica takes from here still need producing.
                sid = next((x for x in sorted(available) if not any(k[0] == n for k in self.keys_of.get(x, ()))),
                           None)
                if sid is None:
                    break
            batch.append(sid)
            available.discard(sid)
            self.taken.add((n, sid))
            for k in self.keys_of.get(sid, ()):
                if k[0] == n:
                    c = self.reps[k[2]][k[3]]
                    c.inflight += 1
                    c.pending_work += self.task[k[2]][sid]
                    starve[k] += self.task[k[2]][sid]
        if batch:
            chosen = set(batch)
            rep.free = [x for x in rep.free if x not in chosen]
            rep.arrived = [entry for entry in rep.arrived if entry[-1] not in chosen]
            heapq.heapify(rep.arrived)
        return batch

    # -- effects of a decision -------------------------------------------------------------

    def _busy(self, rep: _Rep, t: float, cost: float) -> None:
        rep.free_at = t + cost
        heapq.heappush(self.heap, (rep.free_at, rep.slot))

    def _forward(self, rep: _Rep, t: float, batch: list[int]) -> None:
        n = rep.section
        for sid in batch:
            rep.todo.discard(sid)
            self.taken.add((n, sid))
            if sid in rep.missing:
                rep.inflight -= 1
                rep.pending_work -= self.task[n][sid]
                for p in self.producers[n]:  # a credit came back: a producer held back may go on
                    if sid in self.routes[p] and self.sections[p].activates(self.meta[sid].modalities):
                        prep = self.reps[p][self.routes[p][sid]]
                        if prep.waiting:
                            heapq.heappush(self.heap, (max(t, prep.free_at), prep.slot))
            else:
                rep.free_work -= self.task[n][sid]
        rep.mbs.append(tuple(batch))
        m = len(rep.mbs) - 1
        for sid in batch:
            self.mb_of[(n, sid)] = m
        if rep.has_consumers:  # what each credit-bound consumer had started when this was decided
            self.started_at[(n, rep.index, m)] = {
                (k[2], k[3]): len(self.reps[k[2]][k[3]].mbs)
                for sid in batch for k in self.keys_of.get(sid, ())
                if k[0] == n and k[1] == rep.index and self.credit[k[2]] < INF}
        fwd = sum(self.fwd[n][s] for s in batch)
        cost = sum(self.task[n][s] for s in batch) if (rep.loss or not self.sections[n].trainable) else fwd
        self._busy(rep, t, cost)
        done = rep.free_at
        arrive = done + self.costs.transfer_s
        for c in self.consumers[n]:
            for sid in batch:
                if sid in self.routes[c] and self.sections[c].activates(self.meta[sid].modalities):
                    crep = self.reps[c][self.routes[c][sid]]
                    crep.missing[sid] -= 1
                    if crep.missing[sid] == 0:
                        self.seq += 1  # ties in arrival keep production order (FIFO per pair)
                        heapq.heappush(crep.arrived, (arrive, self.seq, sid))
                        if crep.waiting:
                            heapq.heappush(self.heap, (max(arrive, crep.free_at), crep.slot))
        expected = sum(1 for c in self.grad_from[n] for sid in batch
                       if self.sections[c].activates(self.meta[sid].modalities))
        if self.sections[n].trainable and not rep.loss and expected:
            rep.grads_missing[m] = expected
            rep.grads_at[m] = 0.0
        else:
            self._send_grads(rep, batch, done)

    def _send_grads(self, rep: _Rep, batch: Sequence[int], done: float) -> None:
        arrive = done + self.costs.transfer_s
        for p in self.grad_to[rep.section]:
            for sid in batch:
                if not self.sections[p].activates(self.meta[sid].modalities):
                    continue
                prep = self.reps[p][self.routes[p][sid]]
                m = self.mb_of[(p, sid)]
                prep.grads_missing[m] -= 1
                prep.grads_at[m] = max(prep.grads_at[m], arrive)
                if prep.grads_missing[m] == 0:
                    cost = sum(self.task[p][s] - self.fwd[p][s] for s in prep.mbs[m])
                    heapq.heappush(prep.bwd_ready, (prep.grads_at[m], cost, m))
                    if prep.waiting:
                        heapq.heappush(self.heap, (max(prep.grads_at[m], prep.free_at), prep.slot))


def _first_covering(cumulative: list[int], need: int) -> int:
    """Smallest j with cumulative[j] >= need (cumulative is non-decreasing, cumulative[0] = 0)."""
    if need <= 0:
        return 0
    return bisect.bisect_left(cumulative, need)


def _johnson(produce_s: float, consume_s: float, sid: int) -> tuple:
    """Johnson's rule for a two-stage flow: short production first while consumption is longer,
    then by decreasing consumption (a small tail after the last output)."""
    if produce_s < consume_s:
        return (0, produce_s, sid)
    return (1, -consume_s, sid)
