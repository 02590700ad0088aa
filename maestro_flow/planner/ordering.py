"""One wavefront ordering: a greedy event simulation of the step that fixes every replica's order.

Pure (standard library only). Given the sample -> replica routes (balance.py; routed.py's
`Routed` holds what follows from them, shared by every ordering on the same routes) and a set of `Rules`
(rules.py), it plays the step out as the executor runs it (simulate.py's semantics: per
replica serial, a micro-batch once its inputs arrived and its gates allow, a trainable non-loss
section's backward of a whole micro-batch as soon as every gradient for it returned, before its
next forward) and makes each decision the executor leaves to the plan: which samples form a
replica's next micro-batch. The recorded order is the plan, and the simulated end of its last
task is the plan's makespan under simulate.py (padding included: a micro-batch's cost is
CostModel.batch_s's, so the orderings and rule sets are compared on what padding costs) wherever no section has two producer sections
(tests/unit/test_ordering.py checks they agree exactly), so the wavefront planner can compare
orderings without simulating them again. It knows nothing of the other rules the planner
tries, nor of FIFO.

Decisions (the `Rules` fields name the alternatives):
  - a producer (an encoder, a teacher) serves the consumer replica that would run out of work
    first (or the one with the most work still to produce for it); for each consumer replica
    its samples come in Johnson's order (cheap-to-produce / expensive-to-consume first, then by
    decreasing consumption), or it takes the largest job that the consumer's buffer hides; a
    micro-batch may be capped per consumer replica (spread), for a trainable producer by the
    backward it will owe at the end of the step (taper), and by the work its hungriest consumer
    replica still holds (prompt); producers run ahead of a critical consumer replica by at most
    `run_ahead` samples (default_run_ahead when unset);
  - a consumer takes what has arrived first (oldest first) and fills the rest of a micro-batch
    (or not: pad) with samples that need nothing from upstream (text-only samples while the
    encoder works), longest first, shortest first, or short ones at both ends of the step
    (for a stage that pads, first those no longer than the longest that arrived: free of padding);
    with nothing arrived it may instead take free samples that end before the next output it
    knows is coming (gap), so that output does not wait behind a long one.
Whatever the rules, a micro-batch of a stage that pads (Cost.padded) runs as the consecutive
pieces that cost least (`_split`: its samples by increasing cost, cut where padding them to the
longest costs more than another micro-batch's fixed cost); the pieces are recorded as the
plan's micro-batches, so the gates and the makespan account for them.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.cost import CostModel, cheapest_pieces
from maestro_flow.planner.credit import cumulative, default_run_ahead, first_covering
from maestro_flow.planner.plan import MicroBatches
from maestro_flow.planner.routed import Key, Routed
from maestro_flow.planner.rules import Rules

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
    inputs_at: dict[int, float] = field(default_factory=dict)  # sid -> latest arrival of its outputs so far
    mbs: list[tuple[int, ...]] = field(default_factory=list)
    pieces: list[list[int]] = field(default_factory=list)  # decided micro-batches still to start, in order
    free_at: float = 0.0
    bwd_order: list[int] = field(default_factory=list)  # mbs with a backward, run oldest first (as simulate.py)
    next_bwd: int = 0  # index into bwd_order
    grads_missing: dict[int, int] = field(default_factory=dict)  # mb -> gradients still to come
    grads_at: dict[int, float] = field(default_factory=dict)
    need: dict[int, int] = field(default_factory=dict)  # sid -> producers it needs outputs from
    pending_work: float = 0.0  # consumer-side work of samples produced/in production, not consumed
    free_work: float = 0.0  # consumer-side work of samples that need nothing upstream
    waiting: bool = False
    slot: int = 0


class Ordering:
    """The greedy event simulation of one component under one set of rules."""

    def __init__(self, graph: SectionGraph, costs: CostModel, comp: list[str], routed: Routed,
                 run_ahead: int | None, critical: str, fwd: dict[str, dict[int, float]],
                 task: dict[str, dict[int, float]], rules: Rules) -> None:
        self.graph, self.costs, self.comp, self.rules = graph, costs, comp, rules
        self.routes = routed.routes
        self.sections = graph.sections
        self.losses = set(graph.loss_sections())
        self.reps: dict[str, list[_Rep]] = {}
        self.all: list[_Rep] = []
        self.producers, self.consumers, self.grad_from = routed.producers, routed.consumers, routed.grad_from
        self.grad_to = {n: [e.edge.src for e in graph.inputs(n) if e.carries_grad] for n in comp}
        self.fwd, self.task = fwd, task
        # The executor's backward of a micro-batch runs through all of it, even the samples no
        # gradient comes back for (simulate.py charges the same).
        self.bwd_factor = {n: costs.costs[n].backward_factor if self.sections[n].trainable else 0.0 for n in comp}
        self.fixed = {n: costs.micro_batch_s(n) for n in comp}  # per micro-batch, as simulate.py charges it
        self.padded = {n: costs.costs[n].padded for n in comp}
        # A consumer of one producer section that feeds no one takes each producer's outputs in
        # the order they were sent (tests/unit/test_planner.check_pair_order): its splits keep it.
        self.keep_order = {n: len(graph.inputs(n)) == 1 and not graph.outputs(n) for n in comp}
        self.active, self.grads_of = routed.active, routed.grads_of
        self.keys_of, self.keys_out, self.keys_in = routed.keys_of, routed.keys_out, routed.keys_in
        self.out_keys, self.in_keys = routed.out_keys, routed.in_keys
        sign = -1.0 if rules.fill == "longest" else 1.0
        for n in comp:
            sec = self.sections[n]
            reps = [_Rep(section=n, index=r, mb=sec.micro_batch, loss=n in self.losses,
                         has_consumers=bool(self.consumers[n]), todo=set(routed.todo[(n, r)]),
                         missing=dict(routed.need[(n, r)]), need=routed.need[(n, r)],
                         free=sorted(routed.free[(n, r)], key=lambda sid, n=n: (sign * task[n][sid], sid)),
                         free_work=routed.free_work[(n, r)]) for r in range(sec.dp)]
            self.reps[n] = reps
            for rep in reps:
                rep.slot = len(self.all)
                self.all.append(rep)
                if rules.fill == "middle":  # ascending: every other one, then the rest descending
                    rep.free = rep.free[0::2] + rep.free[1::2][::-1]
        self.queues: dict[Key, list[int]] = {}  # (producer, p, consumer, c) -> sids, in serving order
        for key, sids in routed.queues.items():
            n, c = key[0], key[2]
            share = len(self.out_keys[(n, key[1])]) if rules.shared_producer else 1
            self.queues[key] = sorted(sids, key=lambda sid, n=n, c=c, k=share: _johnson(k * fwd[n][sid], task[c][sid], sid))
        self.heads = {key: 0 for key in self.queues}
        # Outputs produced (or in production) and not yet consumed, per producer -> consumer
        # replica pair: what a run-ahead credit counts, as the plan's gates do.
        self.inflight = {key: 0 for key in self.queues}
        self.remaining = dict(routed.remaining)
        if rules.fit:  # per queue: (producer job, -sid) ascending, and (job - consumption, sid) ascending
            self.by_job = {key: sorted((task[key[0]][sid], -sid) for sid in sids) for key, sids in self.queues.items()}
            self.by_gain = {key: sorted((task[key[0]][sid] - task[key[2]][sid], sid) for sid in sids)
                            for key, sids in self.queues.items()}
        self.taken: dict[str, set[int]] = {n: set() for n in comp}  # per section: the samples scheduled
        # Run-ahead credits protect the critical consumer's memory from a faster producer. A
        # consumer that is not critical needs no such bound: its producer is the slower side,
        # and holding the producer back would only lengthen the step.
        self.credit = {n: (run_ahead if run_ahead is not None else default_run_ahead(self.sections[n].micro_batch))
                       if n == critical else INF for n in comp}
        self.heap: list[tuple[float, int]] = []
        self.seq = 0
        self.mb_of: dict[str, dict[int, int]] = {n: {} for n in comp}  # per section: sid -> its micro-batch index
        self.started_at: dict[tuple[str, int, int], dict[tuple[str, int], int]] = {}
        self._consumed: dict[Key, list[int]] = {}

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

    @property
    def makespan_s(self) -> float:
        """When the last task ends (after run()): simulate.py's makespan of the recorded order."""
        return max((rep.free_at for rep in self.all), default=0.0)

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
                        j = first_covering(self.consumed_from(crep, n, rep.index), sent[(c, ci)] - self.credit[c])
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
            queue = (producer, p, crep.section, crep.index)
            self._consumed[key] = cumulative(crep.mbs, lambda sid: queue in self.keys_of.get(sid, ()))
        return self._consumed[key]

    def _decide(self, rep: _Rep, t: float) -> None:
        rep.waiting = False
        bwd_at = _backward_ready(rep)
        if bwd_at <= t:
            m = rep.bwd_order[rep.next_bwd]
            rep.next_bwd += 1
            n = rep.section
            self._busy(rep, t, self.bwd_factor[n] * self._batch_fwd(n, rep.mbs[m]))
            self._send_grads(rep, rep.mbs[m], rep.free_at)
            return
        if rep.pieces:  # the rest of a micro-batch split by padding (_split), one piece at a time
            self._forward(rep, t, rep.pieces.pop(0))
            return
        batch = self._pick_producer(rep, t) if rep.has_consumers else self._pick_consumer(rep, t)
        if batch:
            pieces = self._split(rep.section, batch)
            rep.pieces = pieces[1:]
            self._forward(rep, t, pieces[0])
            return
        rep.waiting = True
        # Wake at the next arrival or gradient; a producer held back by run-ahead credits is
        # woken by its consumer when a credit comes back (_forward).
        # (A ready backward would have run, so the earliest one is still to come; an arrival at or
        # before t can be left by a producer held back by credits: then look past it.)
        arrived = rep.arrived
        wake = arrived[0][0] if arrived and arrived[0][0] > t else min((a for a, _, _ in arrived if a > t), default=INF)
        wake = min(wake, bwd_at)
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
        if batch and not self.rules.pad:
            return batch
        if batch and self.padded[rep.section] and rep.free:
            # A padding stage fills first with free samples no longer than the longest that
            # arrived (the largest first): they cost no padding.
            fwd = self.fwd[rep.section]
            top = max(fwd[sid] for sid in batch)
            under = sorted((sid for sid in rep.free if fwd[sid] <= top), key=lambda sid: (-fwd[sid], sid))
            chosen = set(under[:rep.mb - len(batch)])
            if chosen:
                batch.extend(sid for sid in under if sid in chosen)
                rep.free = [sid for sid in rep.free if sid not in chosen]
        if not batch and self.rules.gap and rep.free and rep.arrived:
            return self._fill_gap(rep, rep.arrived[0][0] - t)  # nothing arrived by t: the next one
        while len(batch) < rep.mb and rep.free:
            batch.append(rep.free.pop(0))
        return batch

    def _fill_gap(self, rep: _Rep, room: float) -> list[int]:
        """Free samples for a micro-batch that ends within `room` (rules.gap): the largest that
        fit, as long as they fit; else the single shortest free sample."""
        n = rep.section
        scale = 1.0 + self.bwd_factor[n] if rep.loss else 1.0
        fwd = self.fwd[n]
        batch: list[int] = []
        for sid in sorted(rep.free, key=lambda sid: (-fwd[sid], sid)):
            if len(batch) >= rep.mb:
                break
            if self._batch_fwd(n, batch + [sid]) * scale <= room:
                batch.append(sid)
        if not batch:
            batch = [min(rep.free, key=lambda sid: (fwd[sid], sid))]
        chosen = set(batch)
        rep.free = [sid for sid in rep.free if sid not in chosen]
        return batch

    def _head(self, key: Key, available: set[int]) -> int | None:
        """The first sample of a producer->consumer queue that is not taken and can be produced now."""
        queue, n = self.queues[key], key[0]
        i = self.heads[key]
        taken = self.taken[n]
        while i < len(queue) and queue[i] in taken:
            i += 1
        self.heads[key] = i
        for j in range(i, len(queue)):
            sid = queue[j]
            if sid in available and sid not in taken:
                return sid
        return None

    def _fit(self, key: Key, available: set[int], buffer_s: float) -> int | None:
        """The queue's largest producer job (forward + backward) that the consumer's buffer of work
        hides; if none fits, the job that costs the producer least more than the consumer."""
        taken = self.taken[key[0]]
        jobs = self.by_job[key]
        i = bisect.bisect_right(jobs, (buffer_s, INF)) - 1
        while i >= 0:
            sid = -jobs[i][1]
            if sid in taken:
                del jobs[i]  # taken for good: drop it so later searches skip it for free
            elif sid in available:
                return sid
            i -= 1
        gains = self.by_gain[key]
        while gains and gains[0][1] in taken:
            gains.pop(0)
        return next((sid for _, sid in gains if sid not in taken and sid in available), None)

    def _pick_producer(self, rep: _Rep, t: float) -> list[int]:
        """Serve the consumer replica that would starve first (or has the most work to come),
        within its run-ahead credit."""
        n, rules = rep.section, self.rules
        keys_out = self.keys_out[n]
        # What can be produced now: for an entry section everything it still has to do (read
        # only: a sample picked for this batch is in `taken`, which every search checks first).
        entry = not self.producers[n]
        available = rep.todo if entry else set(rep.free) | {sid for a, _, sid in rep.arrived if a <= t}
        keys = self.out_keys.get((n, rep.index), [])
        starve = {k: max(t, c.free_at) + c.free_work + c.pending_work
                  for k in keys for c in (self.reps[k[2]][k[3]],)}
        cap = -(-rep.mb // len(keys)) if rules.spread and keys else rep.mb
        per_key: dict[Key, int] = {}
        budget = INF
        if rules.taper and self.grad_from[n]:
            budget = rules.taper * min((self.reps[k[2]][k[3]].free_work for k in keys), default=INF)
        backward = forward = 0.0
        hungry = INF
        if rules.prompt:
            hungry = min((starve[k] - t for k in keys if self.remaining[k] > 0), default=INF)
        batch: list[int] = []
        rank = (lambda k: (-self.remaining[k], k)) if rules.serve == "remaining" else (lambda k: (starve[k], k))
        while len(batch) < rep.mb and not (batch and (backward >= budget or forward >= hungry)):
            sid = None
            first = min(keys, key=rank) if keys else None
            # The first in line serves almost always: sort the others only when it cannot.
            for k in _first_then(first, keys, rank):
                c = self.reps[k[2]][k[3]]
                if self.inflight[k] >= self.credit[k[2]] and not c.waiting:
                    continue  # far enough ahead of this consumer; serve it again once it catches up
                if per_key.get(k, 0) >= cap:
                    continue
                sid = self._fit(k, available, starve[k] - t) if rules.fit else self._head(k, available)
                if sid is not None:
                    break
            if sid is None:
                # Samples that no consumer replica takes from here still need producing.
                sid = next((x for x in sorted(available) if x not in self.taken[n] and x not in self.keys_out[n]),
                           None)
                if sid is None:
                    break
            batch.append(sid)
            backward += self.task[n][sid] - self.fwd[n][sid]
            forward += self.fwd[n][sid]
            self.taken[n].add(sid)
            for k in keys_out.get(sid, ()):
                c = self.reps[k[2]][k[3]]
                work = self.task[k[2]][sid]
                self.inflight[k] += 1
                c.pending_work += work / c.need[sid]  # counted once over its producers
                starve[k] += work
                self.remaining[k] -= work
                per_key[k] = per_key.get(k, 0) + 1
        if batch and not entry:
            chosen = set(batch)
            rep.free = [x for x in rep.free if x not in chosen]
            rep.arrived = [item for item in rep.arrived if item[-1] not in chosen]
            heapq.heapify(rep.arrived)
        return batch

    # -- effects of a decision -------------------------------------------------------------

    def _busy(self, rep: _Rep, t: float, cost: float) -> None:
        rep.free_at = t + cost
        heapq.heappush(self.heap, (rep.free_at, rep.slot))

    def _forward(self, rep: _Rep, t: float, batch: list[int]) -> None:
        n = rep.section
        task_n, taken, mb_of, missing, todo = self.task[n], self.taken[n], self.mb_of[n], rep.missing, rep.todo
        keys_in = self.keys_in[n]
        m = len(rep.mbs)
        rep.mbs.append(tuple(batch))
        fwd = self._batch_fwd(n, batch)
        work = fwd * (1.0 + self.bwd_factor[n]) if rep.loss else fwd  # a loss section's backward follows
        for sid in batch:
            todo.discard(sid)
            taken.add(sid)
            mb_of[sid] = m
            if sid in missing:
                rep.pending_work -= task_n[sid]
                for k in keys_in[sid]:  # a credit came back: a producer held back may go on
                    self.inflight[k] -= 1
                    prep = self.reps[k[0]][k[1]]
                    if prep.waiting:
                        heapq.heappush(self.heap, (max(t, prep.free_at), prep.slot))
            else:
                rep.free_work -= task_n[sid]
        keys_out = self.keys_out[n]
        if rep.has_consumers:  # what each credit-bound consumer had started when this was decided
            self.started_at[(n, rep.index, m)] = {
                (k[2], k[3]): len(self.reps[k[2]][k[3]].mbs)
                for sid in batch for k in keys_out.get(sid, ()) if self.credit[k[2]] < INF}
        self._busy(rep, t, work if (rep.loss or not self.sections[n].trainable) else fwd)
        done = rep.free_at
        arrive = done + self.costs.transfer_s
        for sid in batch if rep.has_consumers else ():
            for k in keys_out.get(sid, ()):
                crep = self.reps[k[2]][k[3]]
                crep.missing[sid] -= 1
                # With several producers the sample is ready when the last output arrives, which
                # need not be the one decided last.
                ready = crep.inputs_at[sid] = max(crep.inputs_at.get(sid, 0.0), arrive)
                if crep.missing[sid] == 0:
                    self.seq += 1  # ties in arrival keep production order (FIFO per pair)
                    heapq.heappush(crep.arrived, (ready, self.seq, sid))
                    if crep.waiting:
                        heapq.heappush(self.heap, (max(ready, crep.free_at), crep.slot))
        grads_of = self.grads_of.get(n)
        expected = sum(map(grads_of.__getitem__, batch)) if grads_of else 0
        if self.sections[n].trainable and not rep.loss and expected:
            rep.grads_missing[m] = expected
            rep.grads_at[m] = 0.0
            rep.bwd_order.append(m)
        else:
            self._send_grads(rep, batch, done)

    def _split(self, n: str, batch: list[int]) -> list[list[int]]:
        """A micro-batch of a padding stage as the consecutive pieces that cost least: its samples
        by increasing forward (in their given order where the section keeps its producer's send
        order), cut where padding costs more than another micro-batch's fixed cost (exact:
        O(len^2), fewer pieces on ties: cost.cheapest_pieces); the batch itself when it stays whole."""
        if not self.padded[n] or len(batch) < 2:
            return [batch]
        fwd = self.fwd[n]
        order = list(batch) if self.keep_order[n] else sorted(batch, key=lambda sid: (fwd[sid], sid))
        pieces = cheapest_pieces(order, fwd, self.fixed[n])
        return [batch] if len(pieces) == 1 else pieces

    def _batch_fwd(self, n: str, batch: Sequence[int]) -> float:
        """A micro-batch's forward, as simulate.py charges it (CostModel.batch_s): the fixed cost
        plus its samples' forwards, each at the longest one's where the stage pads (a sample's
        forward is its per-sample term plus its length terms, so the longest has the largest)."""
        fwd_n = self.fwd[n]
        if self.padded[n]:
            return self.fixed[n] + len(batch) * max((fwd_n[sid] for sid in batch), default=0.0)
        return self.fixed[n] + sum(map(fwd_n.__getitem__, batch))

    def _send_grads(self, rep: _Rep, batch: Sequence[int], done: float) -> None:
        arrive = done + self.costs.transfer_s
        for p in self.grad_to[rep.section]:
            active = self.active[p]
            for sid in batch:
                if sid not in active:
                    continue
                prep = self.reps[p][self.routes[p][sid]]
                m = self.mb_of[p][sid]
                prep.grads_missing[m] -= 1
                prep.grads_at[m] = max(prep.grads_at[m], arrive)
                if prep.grads_missing[m] == 0 and prep.bwd_order[prep.next_bwd] == m:  # else an older one is due
                    if prep.waiting:
                        heapq.heappush(self.heap, (max(prep.grads_at[m], prep.free_at), prep.slot))


def _backward_ready(rep: _Rep) -> float:
    """When the oldest backward still to run can start (INF: its gradients are not all in)."""
    if rep.next_bwd == len(rep.bwd_order):
        return INF
    m = rep.bwd_order[rep.next_bwd]
    return rep.grads_at[m] if not rep.grads_missing[m] else INF


def _first_then(first: Key | None, keys: Sequence[Key], rank: Callable) -> Iterator[Key]:
    """`first`, then the other keys by `rank`, sorted only if the caller asks past the first."""
    if first is None:
        return
    yield first
    yield from sorted((k for k in keys if k != first), key=rank)


def _johnson(produce_s: float, consume_s: float, sid: int) -> tuple:
    """Johnson's rule for a two-stage flow: short production first while consumption is longer,
    then by decreasing consumption (a small tail after the last output)."""
    if produce_s < consume_s:
        return (0, produce_s, sid)
    return (1, -consume_s, sid)
