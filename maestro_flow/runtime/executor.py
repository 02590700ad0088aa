"""One replica's execution of its part of each step plan: a non-blocking state machine.

Runs in a worker's compute thread (or, in colocated mode, for every section in one thread).
`poll()` does every piece of work that is ready — the oldest pending backward once its gradients
have all returned (backwards run in micro-batch order, so gradients accumulate in the same order
on every run), then the next micro-batch whose inputs have all arrived, then the step's end
(gradient reduction once the global loss denominator is known — a loss section reports its share
after its last forward, before that backward — then the optimizer step once the global clip
coefficient is known, see optim/stepper.py) — and returns without blocking. Inputs,
gradients, plans, denominators and clip coefficients arrive through `add_plan`, `deliver`,
`finalize` and `clip`; the step's end is runtime/step_end.py's (a mixin). With
`mixed_precision="bf16"` the stage's forward runs under bf16 autocast and floating tensors cross
sections in bf16 (both ways). The executor knows nothing of sockets or processes: it talks to
peers through a `Comm` and to the coordinator through a `report` callback.

Tensor parallelism: every rank of a replica runs an executor with the replica's plan. The leader
talks to other sections, and before each forward and each backward relays the micro-batch's
inputs ("tpf") or gradients ("tpb") to the other ranks (`Comm.relay`); those ranks follow the
relays in the leader's order (`_follow`), so every collective inside the stage's forward and
backward pairs up, and send nothing themselves. With FSDP, the section's parameters are gathered
at each step's start and reduce-scattered and released at its end; a lockstep section's (a
frozen teacher, a loss section) unit by unit in each forward and backward instead, and a replica
with fewer micro-batches than the step's `rounds` runs stand-in rounds until it has run as many
as its peers (parallel/fsdp.py, runtime/lockstep.py). Each
step's report holds the bytes of training state the rank held in the step and after it
(parallel/memory.py).

A section that reads only the data prepares its next micro-batches (`Stage.prepare`: decoding
images) ahead when its worker would otherwise wait (`prefetch`, called by the worker: section
mode), up to PREFETCH of them, from the current step's plan and the next ones'; else just before
their forward. Work done ahead counts in its own step's busy time, so a step's busy time can
exceed its wall time.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from maestro_flow.graph import SectionGraph
from maestro_flow.optim.reduce import GradientReducer
from maestro_flow.optim.stepper import SectionOptimizer
from maestro_flow.parallel.section import Layout
from maestro_flow.planner.cost import charged
from maestro_flow.planner.costfit import Timing
from maestro_flow.planner.plan import Placement
from maestro_flow.runtime import lockstep
from maestro_flow.runtime.executor_state import STAGE_RAISES, PendingBackward, StageFault, StepState, to_torch
from maestro_flow.runtime.precision import autocast_dtype, compute
from maestro_flow.runtime.prefetch import Prefetch
from maestro_flow.runtime.record import Recorder
from maestro_flow.runtime.step_end import StepEnd
from maestro_flow.runtime.trace import Tracer
from maestro_flow.samples import SampleMeta
from maestro_flow.stage import MicroBatch, Stage, detached_loss, output_problem, warn_unread_loss
from maestro_flow.transport.tensor_comm import Comm

Report = Callable[[str, dict[str, Any]], None]


class SectionExecutor(StepEnd, Prefetch):
    def __init__(self, *, stage: Stage, graph: SectionGraph, placement: Placement, section: str, replica: int,
                 source: Any, comm: Comm, report: Report, device: torch.device, dtype: torch.dtype,
                 reducer: GradientReducer | None, clock: Callable[[], float] = time.perf_counter,
                 tracer: Tracer | None = None, record: Recorder | None = None,
                 layout: Layout | None = None) -> None:
        self.stage, self.graph, self.placement = stage, graph, placement
        self.name, self.replica = section, replica
        self.section = graph.sections[section]
        self.rank = placement.rank(section, replica)
        self.source, self.comm, self.report = source, comm, report
        self.device, self.dtype, self.clock = device, dtype, clock
        self.in_edges = graph.inputs(section)
        self.out_edges = graph.outputs(section)
        self.is_loss = section in graph.loss_sections()
        # Whether trainable sections upstream take their gradients' denominator from this loss.
        self.feeds_upstream = self.is_loss and any(
            n != section and graph.sections[n].trainable and graph.loss_sections_of(n) == [section]
            for n in graph.order)
        self.trainable = self.section.trainable
        self.layout = layout or Layout(replica=replica, tp_index=0, members=(self.rank,))
        self.fsdp = self.layout.fsdp
        self.last_batch: MicroBatch | None = None  # a lockstep FSDP section's, for rounds without samples
        self.follower = not self.layout.leader  # a tensor-parallel rank that follows its leader
        self.relaying = self.layout.leader and len(self.layout.members) > 1
        self.carried = graph.carried(section)  # checked after forward
        # Warned of once (replica 0's leader) when a forward returns a "loss" nothing reads.
        self.unread_loss = graph.drops_loss(section) and replica == 0 and self.layout.leader
        self.ops: deque[tuple[str, int, int, list]] = deque()  # a follower's relays, in the leader's order
        params = [p for p in stage.parameters() if p.requires_grad] if self.trainable else []
        pipeline = graph.pipeline
        groups = stage.optimizer_groups(dict(self.section.optimizer)) if params else None
        if groups is not None:  # the same parameters, in the groups' order
            params = [p for _, ps in groups for p in ps]
        self.optim = SectionOptimizer(
            self.section.optimizer, params, total_steps=pipeline.steps,
            reducer=self.fsdp if self.fsdp is not None else reducer,
            owns_norm=[self.layout.owns(p) for p in params], groups=groups) if params else None
        self.grad_clip = pipeline.grad_clip
        self.clips: dict[int, float] = {}  # step -> clip coefficient, from the coordinator
        # Mixed precision: autocast dtype for the stage's forward and the dtype tensors travel in.
        self.mixed_precision = pipeline.mixed_precision
        self.autocast = autocast_dtype(pipeline.mixed_precision)
        self.plans: deque[StepState] = deque()
        self.current: StepState | None = None
        # step -> sample id -> tensor name -> tensor; filled by deliver(), possibly ahead of the plan.
        self.inbox: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self.finalized: dict[int, float] = {}
        self.progress: dict[tuple[int, int], int] = {}  # (step, consumer rank) -> forwards it finished
        self.pending_by_sample: dict[tuple[int, int], PendingBackward] = {}
        self.early_grads: list[tuple[int, int, list]] = []
        self.steps_done = 0
        self.tracer = tracer or Tracer(enabled=False)
        self.record = record if self.layout.leader else None  # what it saves for replay (runtime/record.py)
        # What this replica is doing now, for `maestro top` (read by the heartbeat thread).
        self.status: dict[str, Any] = {"state": "idle", "step": None, "mb": None, "buffered": 0, "in_flight": 0}
        # (step, micro-batch) -> (the batch as read when recording, as prepared): Stage.prepare run ahead.
        self.prepared: dict[tuple[int, int], tuple[MicroBatch | None, MicroBatch]] = {}
        self.unprepared: set[tuple[int, int]] = set()  # those whose preparing ahead failed
        self.prefetching = not self.in_edges and type(stage).prepare is not Stage.prepare
        stage.train(self.trainable)

    # -- inputs from outside ---------------------------------------------------------------

    def add_plan(self, msg: dict[str, Any]) -> None:
        samples = msg["samples"]
        self.plans.append(StepState(
            step=msg["step"], mbs=[tuple(mb) for mb in msg["micro_batches"]],
            rows={s[0]: s[1] for s in samples}, modalities={s[0]: frozenset(s[2]) for s in samples},
            sizes={s[0]: SampleMeta(id=s[0], num_tokens=s[3], num_patches=s[4], num_frames=s[5]) for s in samples},
            # Credits are the leader's: its followers run what it relays.
            gates=[] if self.follower else [[(self.placement.rank(c, ci), j) for c, ci, j in mb]
                                            for mb in msg.get("gates", ())],
            notify=[] if self.follower else [self.placement.rank(p, r) for p, r in msg.get("notify", ())],
            routes={k: {int(sid): r for sid, r in v.items()} for k, v in msg["routes"].items()},
            rounds=msg.get("rounds", 0),
        ))
        probe = msg.get("probe")
        if probe and self.fsdp is not None and self.fsdp.per_micro_batch:
            st = self.plans[-1]
            st.probe = probe[0]
            st.rows.setdefault(probe[0], probe[1])
            st.modalities.setdefault(probe[0], frozenset(probe[2]))

    def deliver(self, kind: str, edge: int, step: int, src: int, items: Any) -> None:
        if kind in ("tpf", "tpb"):  # a relay from this replica's leader; `edge` is the micro-batch index
            self.ops.append((kind, step, edge, items))
            if kind == "tpf":
                per_step = self.inbox.setdefault(step, {})
                for sid, name, t in items:
                    per_step.setdefault(sid, {})[name] = t
        elif kind == "progress":
            key = (step, src)
            self.progress[key] = max(self.progress.get(key, 0), items)
        elif kind == "fwd":
            per_step = self.inbox.setdefault(step, {})
            for sid, name, t in items:
                per_step.setdefault(sid, {})[name] = t
        else:
            self._deliver_grads(edge, step, items)

    def finalize(self, step: int, denominator: float) -> None:
        if self.optim is not None:  # a stage without trainable parameters never reads it (step_end)
            self.finalized[step] = float(denominator)

    def clip(self, step: int, coef: float) -> None:
        self.clips[step] = float(coef)

    # -- the state machine -----------------------------------------------------------------

    def poll(self) -> bool:
        """Do all ready work; return True if anything happened."""
        progressed = False
        while True:
            if self.current is None:
                if not self.plans:
                    break
                self.current = self.plans.popleft()
                self.current.started = self.clock()
                if self.fsdp is not None:
                    self.fsdp.begin_step()  # every replica, every step, whatever it computes in it
            st = self.current
            work = self._follow(st) if self.follower else (self._run_ready_backward(st) or self._run_next_forward(st))
            if work or self._finish_step(st):
                progressed = True
                continue
            break
        return progressed

    @property
    def idle(self) -> bool:
        return self.current is None and not self.plans

    # -- forward ---------------------------------------------------------------------------

    def _expected_inputs(self, st: StepState, sid: int) -> list[str]:
        names = []
        for e in self.in_edges:
            if self.graph.sections[e.edge.src].activates(st.modalities[sid]):
                names.extend(e.edge.tensors)
        return names

    def _run_next_forward(self, st: StepState) -> bool:
        if st.next_mb >= len(st.mbs):
            # Every forward ran; a backward still to run waits for its gradients.
            return self._wait(st, "wait gradients") if st.pending else False
        mb = st.mbs[st.next_mb]
        if st.gates and any(self.progress.get((st.step, rank), 0) < done for rank, done in st.gates[st.next_mb]):
            return self._wait(st, "wait credit")  # run-ahead credit: a consumer has not caught up yet
        got = self.inbox.get(st.step, {})
        for sid in mb:
            have = got.get(sid, {})
            if any(n not in have for n in self._expected_inputs(st, sid)):
                return self._wait(st, "wait inputs")
        index = st.next_mb
        st.next_mb += 1
        t0 = self.clock()
        cpu0 = time.thread_time() if self.tracer.enabled else 0.0  # the compute thread's own CPU, for the trace
        self._waited(st, t0, mb=index)
        self._doing("forward", st.step, index)
        arrived = {sid: got.pop(sid, {}) for sid in mb}
        if self.relaying:
            self.comm.relay("tpf", st.step, index, [(sid, name, t) for sid in mb for name, t in arrived[sid].items()])
        ahead = self.prepared.pop((st.step, index), None)
        self.unprepared.discard((st.step, index))
        if ahead is None:  # (also where preparing it ahead failed: the error is raised here, in its step)
            raw, leaves = self._make_batch(st, index, mb, arrived)
            try:
                batch = self._prepare(st, raw)
            except StageFault as fault:  # found in review: a corrupt image (the encoder's prepare) went unrecorded
                if self.record is not None and not fault.collateral:
                    self.record.fail(raw, {}, self.record.begin(st.step, index, self.stage, self.device), fault.phase)
                raise
        else:
            (raw, batch), leaves = ahead, {}
        st.tokens += sum(len(t) for t in batch.columns.get("tokens", ()))
        if self.fsdp is not None and self.fsdp.per_micro_batch:
            self.last_batch = lockstep.kept(batch)
        # Before the forward: what a replay starts from (the step's weights, the RNG states); not
        # timed (it would count in the section's busy time and fitted costs, so change the plans).
        recorded = None
        if self.record is not None:
            t_record = self.clock()
            recorded = self.record.begin(st.step, index, self.stage, self.device)
            t0 += self.clock() - t_record
        out: dict = {}
        try:
            try:
                with torch.set_grad_enabled(self.trainable), compute(self.mixed_precision, self.device):
                    out = self.stage.forward(batch)
            except STAGE_RAISES:
                raise StageFault("forward", st.step, traceback.format_exc()) from None
            # Checked here, before anything reads them, so a broken output is the stage's error.
            problem = output_problem(out, section=self.name, stage=self.section.stage, num_samples=len(mb),
                                     carried=self.carried, loss=self.is_loss)
            if problem is not None:
                out = {}  # (not recorded: it may not be recordable)
                raise StageFault("forward", st.step, problem)
            if self.unread_loss and "loss" in out:
                self.unread_loss = False
                warn_unread_loss(self.stage, self.section.config, self.name)
            self._send_outputs(st, mb, out)
            t_forward = self.clock()  # a loss section goes on to its backward at once: traced as its own span
            cpu_forward = time.thread_time() if self.tracer.enabled else 0.0
            if self.is_loss:
                self._loss_backward(st, mb, out, leaves)
            elif self.trainable:
                self._keep_for_backward(st, mb, out, leaves, index, None if recorded is None else (raw, out, recorded))
        except StageFault as fault:  # found in QA: the micro-batch a stage failed on was the one not recorded
            if self.record is not None and not fault.collateral:  # (a peer's failure is not this micro-batch's)
                self.record.fail(raw, out, recorded, fault.phase)
            raise
        elapsed = self.clock() - t0
        if recorded is not None:
            self.record.save(raw, out, recorded)  # as read (forward takes it as it is, Stage.prepare)
        st.busy_s += elapsed
        self._timing(st, "forward+backward" if self.is_loss and self.trainable else "forward", mb, elapsed)
        if self.tracer.enabled:  # `cpu` below the span's length: the thread was kept off its core
            backward = self.is_loss and self.trainable
            self.tracer.span("forward", "compute", t0, t_forward if backward else t0 + elapsed, step=st.step,
                             mb=index, samples=list(mb), cpu=(cpu_forward if backward else time.thread_time()) - cpu0)
            if backward:
                self.tracer.span("backward", "compute", t_forward, t0 + elapsed, step=st.step, mb=index,
                                 samples=list(mb), cpu=time.thread_time() - cpu_forward)
        for rank in st.notify:
            self.comm.notify(rank, st.step, st.next_mb)
        return True

    def _wait(self, st: StepState, reason: str) -> bool:
        """Note when the executor started waiting (for the trace); always False (nothing ran)."""
        if st.waiting is None:
            st.waiting = (reason, self.clock())
            self._doing(reason.replace("wait", "waiting for"), st.step, st.next_mb)
        return False

    def _doing(self, state: str, step: int | None, mb: int | None) -> None:
        self.status = {"state": state, "step": step, "mb": mb,
                       "buffered": sum(len(v) for v in self.inbox.values()),
                       "in_flight": getattr(self.comm, "in_flight", 0)}

    def _waited(self, st: StepState, now: float, **args: Any) -> None:
        if st.waiting is not None:
            reason, since = st.waiting
            self.tracer.span(reason, "wait", since, now, step=st.step, **args)
            st.waiting = None

    def _timing(self, st: StepState, kind: str, mb: tuple[int, ...], seconds: float) -> None:
        # What the cost model charges (planner/cost.py: padded to the longest where the stage pads).
        _, tokens, patches, frames = charged(self.section.cost, [st.sizes[s] for s in mb])
        st.timings.append(Timing(kind=kind, samples=len(mb), tokens=tokens, patches=patches, frames=frames,
                                 seconds=seconds).to_list())

    def _make_batch(self, st: StepState, index: int, mb: tuple[int, ...], arrived: dict) -> tuple[MicroBatch, dict]:
        rows = [st.rows[sid] for sid in mb]
        raw = self.source.read(rows, self.section.columns)
        columns = {name: [to_torch(name, v) for v in values] for name, values in raw.items()}
        leaves: dict[tuple[int, str], torch.Tensor] = {}
        inputs: dict[str, list[torch.Tensor | None]] = {}
        grad_names = {n for e in self.in_edges if e.carries_grad for n in e.edge.tensors}
        for e in self.in_edges:
            for name in e.edge.tensors:
                column = []
                for sid in mb:
                    t = arrived[sid].get(name)
                    if self.trainable and name in grad_names and name in arrived[sid]:
                        # Every received input of a gradient edge gets an answer, "no gradient"
                        # (None) included, so the producer never waits for one.
                        if t is not None and t.is_floating_point():
                            t.requires_grad_(True)
                            leaves[(sid, name)] = t
                        else:
                            leaves[(sid, name)] = None
                    column.append(t)
                inputs[name] = column
        batch = MicroBatch(step=st.step, index=index, sample_ids=list(mb),
                           modalities=[st.modalities[sid] for sid in mb], columns=columns, inputs=inputs)
        return batch, leaves

    def _wire(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A tensor as it crosses sections: detached, in bf16 under mixed precision."""
        if t is None:
            return None
        t = t.detach()
        return t.to(self.autocast) if self.autocast is not None and t.is_floating_point() else t

    def _send_outputs(self, st: StepState, mb: tuple[int, ...], out: dict) -> None:
        if self.follower:
            return  # the replica's outputs are the same on all its ranks: the leader sends them
        for e in self.out_edges:
            consumer = self.graph.sections[e.edge.dst]
            per_name = {name: out[name] for name in e.edge.tensors}
            by_rank: dict[int, list] = {}
            for i, sid in enumerate(mb):
                if not consumer.activates(st.modalities[sid]):
                    continue
                dst = self.placement.rank(e.edge.dst, st.routes[e.edge.dst][sid])
                by_rank.setdefault(dst, []).extend((sid, name, self._wire(per_name[name][i]))
                                                   for name in e.edge.tensors)
            for dst, items in by_rank.items():
                self.comm.send(dst, "fwd", e.index, st.step, items)

    # -- backward --------------------------------------------------------------------------

    def _loss_backward(self, st: StepState, mb: tuple[int, ...], out: dict, leaves: dict) -> None:
        loss = out["loss"]
        denom = out.get("loss_denominator", len(mb))
        st.loss_sum += float(loss.detach())
        st.denominator += float(denom.detach() if isinstance(denom, torch.Tensor) else denom)
        if self.trainable and not loss.requires_grad:  # found in QA: torch's own error, from a runtime frame
            raise StageFault("backward", st.step, detached_loss(self.name, self.section.stage))
        if st.next_mb == len(st.mbs):  # the step's last forward: upstream can finalize during this backward
            self._report_loss(st)
        if self.trainable:
            try:
                loss.backward()  # unscaled: gradients are divided by the global denominator at step end
            except STAGE_RAISES:
                raise StageFault("backward", st.step, traceback.format_exc()) from None
            self._send_input_grads(st, leaves)

    def _keep_for_backward(self, st: StepState, mb: tuple[int, ...], out: dict, leaves: dict, index: int,
                           recording: tuple | None = None) -> None:
        pending = PendingBackward(outputs={}, expected=set(), leaves=leaves, sample_ids=mb, index=index,
                                  recording=recording)
        for e in self.graph.needs_grad_from(self.name):
            consumer = self.graph.sections[e.edge.dst]
            per_name = {name: out[name] for name in e.edge.tensors}
            for i, sid in enumerate(mb):
                if not consumer.activates(st.modalities[sid]):
                    continue
                pending.expected.add((e.index, sid))
                for name in e.edge.tensors:
                    t = per_name[name][i]
                    if t is not None and t.requires_grad:  # a gradient flows back through this one only
                        pending.outputs[(sid, name)] = t
        if not pending.expected:
            # No consumer of these outputs trains on them: their gradient is zero, so upstream
            # gets "no gradient" at once rather than waiting for a backward that never comes.
            self._send_input_grads(st, leaves)
            return
        st.pending.append(pending)
        for _, sid in pending.expected:
            self.pending_by_sample[(st.step, sid)] = pending
        for edge, step, items in [g for g in self.early_grads if g[1] == st.step]:
            self.early_grads.remove((edge, step, items))
            self._deliver_grads(edge, step, items)

    def _deliver_grads(self, edge: int, step: int, items: list) -> None:
        sids = {sid for sid, _, _ in items}
        if any((step, sid) not in self.pending_by_sample for sid in sids):
            # Gradients can overtake nothing in a correct plan, but in colocated mode a consumer
            # may run before this replica registered the micro-batch; keep them until it does.
            self.early_grads.append((edge, step, items))
            return
        for sid, name, g in items:
            pending = self.pending_by_sample[(step, sid)]
            if g is not None:
                key = (sid, name)
                if key in pending.outputs:  # wire dtype (bf16) -> the output's, before summing consumers
                    g = g.to(pending.outputs[key].dtype)
                pending.grads[key] = pending.grads[key] + g if key in pending.grads else g
        for sid in sids:
            self.pending_by_sample[(step, sid)].expected.discard((edge, sid))

    def _run_ready_backward(self, st: StepState) -> bool:
        # Oldest first: gradients accumulate in micro-batch order whatever order they return in,
        # so a run is reproducible bit for bit (and a resumed run equals the uninterrupted one).
        if not st.pending or st.pending[0].expected:
            return False
        pending = st.pending[0]
        if self.relaying:
            self.comm.relay("tpb", st.step, pending.index, [(sid, name, g) for (sid, name), g in pending.grads.items()
                                                            if (sid, name) in pending.outputs])
        self._backward(st, pending)
        return True

    def _follow(self, st: StepState) -> bool:
        """A tensor-parallel follower: run the next relayed forward or backward, if it is here."""
        if not self.ops or self.ops[0][1] != st.step:
            return self._wait(st, "wait relay") if st.next_mb < len(st.mbs) or st.pending else False
        kind, _, index, items = self.ops.popleft()
        if kind == "tpf":
            if index != st.next_mb or not self._run_next_forward(st):
                raise RuntimeError(f"tensor-parallel follower out of step with its leader: relayed forward "
                                   f"{index} of step {st.step + 1}, expected {st.next_mb}")
            return True
        pending = next((p for p in st.pending if p.index == index), None)
        if pending is None:
            raise RuntimeError(f"tensor-parallel follower got gradients for micro-batch {index} of step "
                               f"{st.step + 1}, which awaits none")
        pending.grads = {(sid, name): g for sid, name, g in items}
        pending.expected.clear()
        self._backward(st, pending)
        return True

    def _backward(self, st: StepState, pending: PendingBackward) -> None:
        st.pending.remove(pending)
        for sid in pending.sample_ids:
            self.pending_by_sample.pop((st.step, sid), None)
        t0 = self.clock()
        cpu0 = time.thread_time() if self.tracer.enabled else 0.0
        self._waited(st, t0)
        self._doing("backward", st.step, pending.index)
        keys = [k for k in pending.outputs if k in pending.grads]
        if keys:
            try:
                torch.autograd.backward([pending.outputs[k] for k in keys], [pending.grads[k] for k in keys])
            except STAGE_RAISES:
                fault = StageFault("backward", st.step, traceback.format_exc())
                if pending.recording is not None and not fault.collateral:  # found in review: kept as if it passed
                    self.record.fail(*pending.recording, "backward")
                raise fault from None
        self._send_input_grads(st, pending.leaves)
        elapsed = self.clock() - t0
        st.busy_s += elapsed
        self._timing(st, "backward", pending.sample_ids, elapsed)
        if self.tracer.enabled:
            self.tracer.span("backward", "compute", t0, t0 + elapsed, step=st.step, mb=pending.index,
                             samples=list(pending.sample_ids), cpu=time.thread_time() - cpu0)

    def _send_input_grads(self, st: StepState, leaves: dict[tuple[int, str], torch.Tensor]) -> None:
        if self.follower:
            return
        for e in self.in_edges:
            if not e.carries_grad:
                continue
            by_rank: dict[int, list] = {}
            sids = dict.fromkeys(sid for (sid, name) in leaves if name in e.edge.tensors)  # mb order
            for sid in sids:
                src = self.placement.rank(e.edge.src, st.routes[e.edge.src][sid])
                for name in e.edge.tensors:
                    leaf = leaves.get((sid, name))
                    by_rank.setdefault(src, []).append((sid, name, None if leaf is None else self._wire(leaf.grad)))
            for src, items in by_rank.items():
                self.comm.send(src, "bwd", e.index, st.step, items)
