"""The tuner's model of one configuration: its cost per micro-batch, memory per rank and
simulated step time (`TuneModel`; planner/tune.py searches over it).

Pure (standard library only). A configuration's step time is the simulated makespan of the plans of
the pipeline's schedule (planner/simulate.py) plus the end of the step, averaged over the
representative batches; where consecutive steps overlap (lookahead and no gradient across an edge:
`TuneModel.overlapped`) it is the busiest replica's simulated busy time plus its section's end of
step. Time per micro-batch = the section's Cost, whose fixed cost per micro-batch
(Cost.per_micro_batch_s, a `maestro profile` cost file's fitted one) is raised by overhead_s, which
is what makes larger micro-batches pay off; the planner plans with these costs and the simulation
charges the fixed cost on every micro-batch the plan runs (the wavefront may cut a section's samples
into micro-batches smaller than its micro_batch to follow arrivals; it does so only where that
pays). For a stage that pads (Cost.padded) the simulation charges each micro-batch at its longest
sample, and the analytic score (which picks the candidates to simulate) adds the expected padding of
a micro-batch of that size drawn at random (`_padding_s`).

Calibration (runtime costs the stage's compute leaves out; all optional, zero by default):
  - runtime_s (section -> seconds per micro-batch): the executor's own cost per micro-batch,
    added to the fixed cost per micro-batch like overhead_s;
  - message_s (section -> seconds per tensor message a replica receives): charged by the
    simulation on the receiving replica (CostModel.message_s). More micro-batches upstream mean
    more messages for the consumer: without it, vlm's encoder micro-batches 2, 4 and 8 looked
    equal, and 2 measured 4% slower than 8 (tools/bench/RESULTS.md 11.6);
  - step_s (section -> seconds per step, trainable sections): optimizer step etc. after the
    last micro-batch, plus for dp > 1 a gradient all-reduce estimated as
    2 x grad_mb x (dp - 1) / dp / REDUCE_MB_PER_S (ring all-reduce over loopback); sections
    step in parallel, so the step adds the largest; planning_s (the coordinator's plan per
    step) is added once;
  - cpu_cores: when the replicas are CPU worker processes on one host with more workers than
    cores, every compute and per-step time is scaled by workers / cpu_cores: the cores are
    assumed shared evenly among the workers all step long. That is exact when every worker is
    always busy; it over-charges a worker that idles, but on the 2-core VM of
    tools/bench/RESULTS.md a "waiting" worker is not free (its comm threads, gloo and the
    coordinator run), and a utilisation-weighted factor (busy fractions / cores) under-predicted
    the 3-worker runs there (tools/bench/RESULTS.md, tuner section). The coordinator process
    and the scheduler's unfairness are not modelled.
"""


from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from maestro_flow.config import Cost, Pipeline
from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import make_planner
from maestro_flow.planner.cost import CostModel, length_s
from maestro_flow.planner.credit import default_run_ahead
from maestro_flow.planner.simulate import simulate
from maestro_flow.planner.tune_space import (
    Candidate,
    Layout,
    MemoryModel,
)
from maestro_flow.samples import SampleMeta

REDUCE_MB_PER_S = 1000.0  # gloo all-reduce over loopback, order of magnitude (tools/bench/RESULTS.md section 1)
TP_EFFICIENCY = 0.8  # a tp-rank replica computes tp x this as fast as one rank (its all-reduces cost the rest)


def pow2_upto(n: int) -> list[int]:
    out, m = [], 1
    while m <= n:
        out.append(m)
        m *= 2
    return out


def apart(limit: float, over: float) -> tuple[str, str]:
    """A limit and a figure over it, with the decimals it takes to tell them apart (found in QA:
    "does not fit the memory limit (2 MiB) ... (predicted 2 MiB at least)")."""
    for digits in range(7):
        a, b = f"{limit:.{digits}f}", f"{over:.{digits}f}"
        if a != b:
            return a, b
    return a, b


class TuneModel:
    """A pipeline's sections, costs, memory models and representative batches, and what any
    (dp, micro_batch) layout of them predicts (`evaluate`)."""


    def __init__(self, pipeline: Pipeline, costs: CostModel, batches: Sequence[Sequence[SampleMeta]], *,
                 devices: int, memory_limit_mb: float | None = None,
                 memory: Mapping[str, MemoryModel] | None = None, overhead_s: Mapping[str, float] | None = None,
                 replica_devices: Mapping[str, int] | None = None, max_micro_batch: int = 64,
                 dp_candidates: int = 6, max_simulations: int = 40, runtime_s: Mapping[str, float] | None = None,
                 message_s: Mapping[str, float] | None = None,
                 step_s: Mapping[str, float] | None = None, grad_mb: Mapping[str, float] | None = None,
                 planning_s: float = 0.0, cpu_cores: int | None = None, tp: Mapping[str, int] | None = None,
                 tp_efficiency: float | Mapping[str, float | None] = TP_EFFICIENCY) -> None:
        if devices < 1:
            raise PipelineError(f"tune: --devices must be >= 1, got {devices}")
        self.pipeline = pipeline
        self.graph = SectionGraph(pipeline)
        self.order = list(self.graph.order)
        self.costs = costs
        self.batches = [list(b) for b in batches]
        if not self.batches or not all(self.batches):
            raise PipelineError("tune: no sample metadata to tune for")
        self.devices = devices
        self.limit = memory_limit_mb
        self.memory = {n: (memory or {}).get(n, MemoryModel()) for n in self.order}
        self.overhead = {n: float((overhead_s or {}).get(n, 0.0)) for n in self.order}
        self.tp = {n: int((tp or {}).get(n, 1)) for n in self.order}
        # section -> a tp replica's speed over tp single ranks; None: no faster than one rank (the CPU)
        self.tp_efficiency = {n: tp_efficiency.get(n, TP_EFFICIENCY) if isinstance(tp_efficiency, Mapping)
                              else tp_efficiency for n in self.order}
        self.rdev = {n: int((replica_devices or {}).get(n, 1)) * self.tp[n] for n in self.order}
        self.runtime = {n: float((runtime_s or {}).get(n, 0.0)) for n in self.order}
        self.message = {n: float((message_s or {}).get(n, 0.0)) for n in self.order}
        self.step_cost = {n: float((step_s or {}).get(n, 0.0)) for n in self.order}
        self.grad_mb = {n: float((grad_mb or {}).get(n, 0.0)) for n in self.order}
        self.planning_s = float(planning_s)
        self.cpu_cores = cpu_cores
        self.max_mb = max_micro_batch
        self.dp_candidates = dp_candidates
        self.max_simulations = max_simulations
        self.cache: dict[Layout, Candidate] = {}
        self.scored = 0
        self.sample0 = self.batches[0]
        self.active = {n: [s for s in self.sample0 if self.graph.sections[n].activates(s.modalities)]
                       for n in self.order}
        # The most samples a section gets in a step: no micro-batch beyond it, and no dp but where
        # more replicas shard a section that fits no other way (Tuner._sharded_past_samples): its
        # extra replicas would get no sample, its micro-batches never fill.
        self.most = {n: max(1, *(sum(self.graph.sections[n].activates(s.modalities) for s in b)
                                 for b in self.batches)) for n in self.order}
        self._terms: dict[tuple, float] = {}
        need = sum(self.rdev.values())
        if need > devices:
            raise PipelineError(f"tune: the pipeline needs at least {need} devices (one replica per section), "
                                f"got --devices {devices}")
        for n in self.order:
            most = max(1, (devices - need + self.rdev[n]) // self.rdev[n])  # the most replicas it could get
            least = min(self.memory[n].at(1, self.tp[n], most, fsdp) for fsdp in (False, True))
            if self.limit is not None and least > self.limit:
                limit_mb, least_mb = apart(self.limit, least)
                raise PipelineError(
                    f"tune: sections.{n} does not fit the memory limit ({limit_mb} MiB) even at micro_batch 1 "
                    f"(predicted {least_mb} MiB at tp={self.tp[n]}); raise --memory-gb or allow a larger tp")

    # -- cost and memory at a micro-batch size -------------------------------------------------

    def cost_at(self, name: str, scale: float = 1.0, gathers_s: float = 0.0) -> Cost:
        """The section's Cost as the search charges it: the fixed cost per micro-batch includes
        overhead_s, runtime_s and `gathers_s` (a lockstep FSDP section's collectives,
        `lockstep_s`), and every term is multiplied by `scale` (and divided by a
        tensor-parallel replica's speed-up)."""
        c = self.costs.costs[name]
        if self.tp[name] > 1 and self.tp_efficiency[name] is not None:  # its ranks share its compute, at an efficiency
            scale /= self.tp[name] * self.tp_efficiency[name]
        fixed = c.per_micro_batch_s + self.overhead[name] + self.runtime[name] + gathers_s
        return dataclasses.replace(c, per_sample_s=c.per_sample_s * scale, per_token_s=c.per_token_s * scale,
                                   per_patch_s=c.per_patch_s * scale, per_frame_s=c.per_frame_s * scale,
                                   per_micro_batch_s=fixed * scale)

    def contention(self, workers: int) -> float:
        """Time scale when `workers` CPU processes share `cpu_cores` cores (module docstring)."""
        return workers / self.cpu_cores if self.cpu_cores and workers > self.cpu_cores else 1.0

    def section_end_s(self, name: str, dp: int, lockstep: bool = False) -> float:
        """A section's per-step cost after its last micro-batch (uncontended): a trainable
        section's optimizer step plus its all-reduce estimate; none for a `lockstep` FSDP
        section, whose reduce-scatters lockstep_s charges at every micro-batch (at the step's
        end it reduces only its presence counts)."""
        if not self.graph.sections[name].trainable:
            return 0.0
        reduce = 2 * self.grad_mb[name] * (dp - 1) / dp / REDUCE_MB_PER_S if dp > 1 and not lockstep else 0.0
        return self.step_cost[name] + reduce

    def end_of_step_s(self, layout: Layout, gathers: Mapping[str, float]) -> float:
        """Per-step costs after the last micro-batch (uncontended): the slowest section's
        optimizer step + all-reduce estimate, plus one plan (`gathers`: each section's lockstep_s)."""
        return max((self.section_end_s(n, dp, gathers[n] > 0) for n, dp, _ in layout), default=0.0) + self.planning_s

    def overlapped(self) -> bool:
        """Whether consecutive steps overlap: with lookahead (the next plan out before this step
        ends) and no gradient crossing an edge (frozen producers: a teacher), a producer runs
        on into the next step while its consumers finish this one (up to its run-ahead credit),
        so the step's fill and drain and the planning hide. Measured on pipelines/distill.py
        (teacher 1x4, student 1x4, pinned): 30.8 ms per step for 30.3 ms of teacher busy time,
        where the one-step makespan plus end of step predicted 38.7 ms. A trainable producer
        (a vision encoder) cannot start the next step before its optimizer step, which waits
        for every gradient of this one: there the step is the makespan plus its end."""
        return self.pipeline.lookahead_steps >= 1 and not any(e.carries_grad for e in self.graph.edges)

    def lockstep_s(self, name: str, dp: int, fsdp: bool) -> float:
        """A lockstep FSDP section's collectives per micro-batch (parallel/fsdp.py): its whole
        parameters all-gathered once per forward, and training once more for the backward plus a
        reduce-scatter of the gradients, each moving (dp - 1)/dp of the bytes (REDUCE_MB_PER_S).
        Every replica's pace is the slowest one's: not modelled. Zero without a memory model's
        parameter size."""
        m = self.memory[name]
        if not (fsdp and m.lockstep and dp > 1 and self.tp[name] == 1):
            return 0.0
        passes = 1 if m.copies == 1 else 3
        return passes * m.param_mb * (dp - 1) / dp / REDUCE_MB_PER_S

    def model_at(self, layout: Layout, gathers: Mapping[str, float]) -> CostModel:
        """The cost model the planner plans a layout with; `gathers`: each section's lockstep_s."""
        return dataclasses.replace(self.costs, costs={**self.costs.costs, **{
            n: self.cost_at(n, gathers_s=gathers[n]) for n, _, _ in layout}})

    def _kept(self, name: str, dp: int, mb: int, layout: Mapping[str, tuple[int, int]] | None) -> int:
        graph = self.graph
        per_replica = max(1, math.ceil(len(self.active[name]) / dp))
        grads = graph.needs_grad_from(name)
        if not grads or name in graph.loss_sections():
            return mb
        run_ahead = 0
        for e in grads:
            cdp, cmb = (layout or {}).get(e.edge.dst, (dp, mb))
            credit = self.pipeline.run_ahead if self.pipeline.run_ahead is not None else default_run_ahead(cmb)
            run_ahead += max(1, cdp // dp) * credit
        return min(per_replica, mb + run_ahead) if per_replica > mb else mb

    def fsdp_for(self, name: str, dp: int, mb: int, layout: Mapping[str, tuple[int, int]] | None = None) -> bool:
        """FSDP only where the section does not fit without it (it adds collectives every step);
        without a memory limit to check, the pipeline's own choice."""
        if dp == 1:
            return False
        if self.limit is None:
            return bool(self.graph.sections[name].fsdp)
        m, kept = self.memory[name], self._kept(name, dp, mb, layout)
        return m.at(kept, self.tp[name], dp) > self.limit and m.at(kept, self.tp[name], dp, True) <= self.limit

    def memory_mb(self, name: str, dp: int, mb: int, layout: Mapping[str, tuple[int, int]] | None = None) -> float:
        return self.memory[name].at(self._kept(name, dp, mb, layout), self.tp[name], dp,
                                    self.fsdp_for(name, dp, mb, layout))

    def _fits(self, name: str, dp: int, mb: int, layout: Mapping[str, tuple[int, int]] | None = None) -> bool:
        return self.limit is None or self.memory_mb(name, dp, mb, layout) <= self.limit

    def default_mbs(self, dps: Mapping[str, int]) -> dict[str, int] | None:
        """Each section's largest power-of-two micro-batch up to its samples per replica, halved
        until every section fits memory (a trainable producer's memory also grows with its
        consumers' micro-batches, so those are halved when halving its own is not enough);
        None when nothing fits."""
        mbs = {}
        for n in self.order:
            per_replica = max(1, math.ceil(len(self.active[n]) / dps[n]))
            mbs[n] = pow2_upto(min(self.max_mb, per_replica))[-1]
        while True:
            by_name = {n: (dps[n], mbs[n]) for n in self.order}
            bad = [n for n in self.order if not self._fits(n, dps[n], mbs[n], by_name)]
            if not bad:
                return mbs
            n = bad[0]
            if mbs[n] > 1:
                mbs[n] //= 2
                continue
            consumers = [e.edge.dst for e in self.graph.needs_grad_from(n) if mbs[e.edge.dst] > 1]
            if not consumers:
                return None
            c = max(consumers, key=lambda c: mbs[c])
            mbs[c] //= 2

    # -- analytic score -----------------------------------------------------------------------

    def _task(self, name: str, mb: int, s: SampleMeta) -> float:
        """A sample's work at micro-batch `mb`, its share of the fixed cost included (scoring)."""
        from maestro_flow.planner.simulate import needs_backward

        f = self._fwd(name, mb, s)
        return f * (1.0 + self.costs.costs[name].backward_factor) if needs_backward(self.graph, name, s) else f

    def _fwd(self, name: str, mb: int, s: SampleMeta) -> float:
        c = self.cost_at(name)
        return c.per_micro_batch_s / mb + c.per_sample_s + length_s(c, s) + self._padding_s(name, mb)

    def _padding_s(self, name: str, mb: int) -> float:
        """What padding adds to a sample's forward at micro-batch `mb`, on average, for a stage
        that pads (Cost.padded): the expected longest of `mb` samples drawn at random from the
        section's samples, less their mean length (scoring only: the evaluation simulates the
        plan's actual micro-batches)."""
        key = ("padding", name, mb)
        if key not in self._terms:
            c = self.cost_at(name)
            lengths = sorted(length_s(c, s) for s in self.active[name])
            n = len(lengths)
            if not c.padded or mb <= 1 or n == 0:
                self._terms[key] = 0.0
            else:
                longest = sum(v * ((k / n) ** mb - ((k - 1) / n) ** mb) for k, v in enumerate(lengths, 1))
                self._terms[key] = max(0.0, longest - sum(lengths) / n)
        return self._terms[key]

    def least_work(self, name: str) -> float:
        """The section's least work at any micro-batch the search tries: a lower bound on its
        work at every one. Not simply the largest micro-batch's: a padded stage's work grows
        with the micro-batch (_padding_s)."""
        return min(self._term(("work", name, m)) for m in pow2_upto(self.max_mb))

    def _term(self, key: tuple) -> float:
        """Cached sums over the representative batch (they do not depend on dp)."""
        if key not in self._terms:
            kind = key[0]
            if kind == "work":
                _, n, mb = key
                v = sum(self._task(n, mb, s) for s in self.active[n])
            elif kind in ("head", "tail", "chain"):
                _, p, c, mbp, mbc = key
                both = [s for s in self.active[p] if self.graph.sections[c].activates(s.modalities)]
                tr = self.costs.transfer_s
                if not both:
                    v = 0.0
                elif kind == "head":
                    v = min(self._fwd(p, mbp, s) for s in both) + tr
                elif kind == "tail":
                    v = tr + min(self._task(c, mbc, s) for s in both)
                else:
                    v = max(self._fwd(p, mbp, s) + tr + self._task(c, mbc, s) for s in both)
            elif kind == "both_work":
                _, p, c, mbc = key
                v = sum(self._task(c, mbc, s) for s in self.active[p] if self.graph.sections[c].activates(s.modalities))
            else:  # "both_fwd"
                _, p, c, mbp = key
                v = sum(self._fwd(p, mbp, s) for s in self.active[p] if self.graph.sections[c].activates(s.modalities))
            self._terms[key] = v
        return self._terms[key]

    def score(self, dps: Mapping[str, int], mbs: Mapping[str, int]) -> float:
        """A lower bound on the step (see simulate.bound_terms) plus the longest one-sample chain."""
        best = max(self._term(("work", n, mbs[n])) / dps[n] for n in self.order)
        for e in self.graph.edges:
            p, c = e.edge.src, e.edge.dst
            best = max(best,
                       self._term(("head", p, c, mbs[p], mbs[c])) + self._term(("both_work", p, c, mbs[c])) / dps[c],
                       self._term(("both_fwd", p, c, mbs[p])) / dps[p] + self._term(("tail", p, c, mbs[p], mbs[c])),
                       self._term(("chain", p, c, mbs[p], mbs[c])))
        self.scored += 1
        return best * self.contention(sum(dps[n] * self.tp[n] for n in self.order))

    # -- evaluation ---------------------------------------------------------------------------

    def evaluate(self, layout: Layout) -> Candidate:
        if layout in self.cache:
            return self.cache[layout]
        by_name = {n: (d, m) for n, d, m in layout}
        sections = tuple(dataclasses.replace(s, dp=by_name[s.name][0], micro_batch=by_name[s.name][1])
                         for s in self.pipeline.sections)
        graph = SectionGraph(dataclasses.replace(self.pipeline, sections=sections))
        gathers = {n: self.lockstep_s(n, d, self.fsdp_for(n, d, m, by_name)) for n, d, m in layout}
        costs = self.model_at(layout, gathers)
        # The rules alone: layouts are compared, and the search (refine.py) would multiply the
        # tuning time for the few % it takes off some plans. The pipeline's own schedule (found in
        # QA: a FIFO pipeline was predicted with the wavefront's plans, a third too fast).
        planner = make_planner(self.pipeline.schedule, graph, costs, search=0.0)
        spans, bounds, busy = [], [], {n: 0.0 for n in self.order}
        fixed = self.end_of_step_s(layout, gathers)
        workers = sum(d * self.tp[n] for n, d, _ in layout)
        overlapped = self.overlapped()
        for step, batch in enumerate(self.batches):
            plan = planner.plan(step, batch)
            scale = self.contention(workers)
            sim = simulate(plan, graph, dataclasses.replace(costs, costs={**costs.costs, **{
                n: self.cost_at(n, scale, gathers[n]) for n in self.order}}, message_s={
                n: self.message[n] * scale for n in self.order if self.message[n]}))
            if overlapped:  # the busiest replica, with its section's end of step, sets the pace
                step_s = max(max(sim.busy_s[n], default=0.0)
                             + self.section_end_s(n, by_name[n][0], gathers[n] > 0) * scale for n in self.order)
                # Its bound: each section's work per replica. The fill and drain terms bound one
                # step's makespan, which overlapping steps hide (found when the bound came to
                # count fixed costs per micro-batch: it rose above such a step).
                bounds.append(max((v for k, v in sim.bound_terms.items() if k.startswith("work:")), default=0.0))
            else:
                step_s = sim.makespan_s + fixed * scale
                bounds.append(sim.lower_bound_s)
            spans.append(step_s)
            for n in self.order:
                busy[n] += sum(sim.busy_s[n]) / (step_s * by_name[n][0]) if step_s > 0 else 0.0
        k = len(self.batches)
        cand = Candidate(layout=layout, step_s=sum(spans) / k, lower_bound_s=sum(bounds) / k,
                         devices=sum(d * self.rdev[n] for n, d, _ in layout),
                         utilisation={n: busy[n] / k for n in self.order},
                         memory_mb={n: self.memory_mb(n, d, m, by_name) for n, d, m in layout},
                         tp=dict(self.tp), fsdp={n: self.fsdp_for(n, d, m, by_name) for n, d, m in layout},
                         given={s.name: (s.tp, s.fsdp) for s in self.pipeline.sections})
        self.cache[layout] = cand
        return cand

    def _layout(self, dps: Mapping[str, int], mbs: Mapping[str, int]) -> Layout:
        return tuple((n, dps[n], mbs[n]) for n in self.order)

    def _feasible(self, layout: Layout) -> bool:
        by_name = {n: (d, m) for n, d, m in layout}
        return all(self._fits(n, d, m, by_name) for n, d, m in layout)
