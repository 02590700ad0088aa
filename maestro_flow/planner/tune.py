"""Searching each section's dp, micro-batch size, tensor parallelism and FSDP for the shortest
simulated step.

Pure (standard library only; no torch, no clocks, no files): a pipeline, a cost model (with an
optional per-micro-batch overhead per section, as `maestro profile` measures it), a memory model
per section and a representative global batch of sample metadata in; ranked configurations out.
`maestro tune` (cli_tools.py) wraps it; the runtime never calls it.

A configuration gives every section `dp` (replicas) and `micro_batch`. It is feasible when
  - sum over sections of dp * replica_devices <= devices (a replica may span several devices,
    e.g. a tensor-parallel group sized to hold the model; default 1);
  - across every edge one dp divides the other (integral fan-out / fan-in);
  - every section's predicted memory per replica fits the limit:
        memory = base_mb + per_sample_mb * kept_samples
    where kept_samples is the micro-batch for a frozen section or a loss section (activations
    live for one micro-batch), and for a trainable section that feeds others (a vision encoder)
    the samples whose activations wait for gradients: its own micro-batch plus what the plan
    lets it run ahead of its consumers — fan-out x run_ahead samples (default 4 consumer
    micro-batches, the wavefront planner's credit) — capped by its samples per step.
Tensor parallelism and FSDP (`tune(tp_options=...)`): a section's replica is tp ranks (tp
devices); its compute per sample is divided by tp x TP_EFFICIENCY (0.8: the all-reduces inside
each layer cost the rest), and its memory per rank follows `MemoryModel.at`: the share of the
parameters the stage's tp_plan shards is divided by tp; FSDP, chosen for a section only when it
does not fit without (its collectives cost every step), shards the optimizer state over dp while
the parameters and a trainable section's gradients are gathered for the whole step (as the
runtime holds them). Each combination of the sections' candidate tp values (`tp_assignments`) is
searched as below and the results are merged.
Its step time is the wavefront plan's simulated makespan (planner/simulate.py) plus the end of
the step, averaged over the representative batches; where consecutive steps overlap (lookahead
and no gradient across an edge: `Tuner.overlapped`) it is the busiest replica's simulated busy
time plus its section's end of step. Time per
micro-batch = the section's Cost, whose fixed cost per micro-batch (Cost.per_micro_batch_s, a
`maestro profile` cost file's fitted one) is raised by overhead_s, which is what makes larger
micro-batches pay off; the planner plans with these costs and the simulation charges the fixed
cost on every micro-batch the plan runs (the wavefront may cut a section's samples into
micro-batches smaller than its micro_batch to follow arrivals; it does so only where that pays).
For a stage that pads (Cost.padded) the simulation charges each micro-batch at its longest
sample, and the analytic score (which picks the candidates to simulate) adds the expected
padding of a micro-batch of that size drawn at random (`_padding_s`).

Calibration (runtime costs the stage's compute leaves out; all optional, zero by default):
  - runtime_s (section -> seconds per micro-batch): the executor's own cost per micro-batch,
    added to the fixed cost per micro-batch like overhead_s;
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
import heapq
import math
from collections.abc import Mapping, Sequence

from maestro_flow.config import Cost, Pipeline
from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import make_planner
from maestro_flow.planner.cost import CostModel, length_s
from maestro_flow.planner.monolithic import MonolithicStep, best_monolithic
from maestro_flow.planner.ordering import default_run_ahead
from maestro_flow.planner.simulate import simulate
from maestro_flow.planner.tune_space import (
    Candidate,
    Layout,
    MemoryModel,
    TuneResult,
    representative_batch,
    to_overrides,
)
from maestro_flow.samples import SampleMeta

__all__ = ["Candidate", "MemoryModel", "TuneResult", "Tuner", "representative_batch", "to_overrides", "tune"]

REDUCE_MB_PER_S = 1000.0  # gloo all-reduce over loopback, order of magnitude (tools/bench/RESULTS.md section 1)
TIE_TOLERANCE = 0.005  # steps within 0.5% of the fastest count as equal; fewer devices win
TP_EFFICIENCY = 0.8  # a tp-rank replica computes tp x this as fast as one rank (its all-reduces cost the rest)


def _pow2_upto(n: int) -> list[int]:
    out, m = [], 1
    while m <= n:
        out.append(m)
        m *= 2
    return out


def _smooth_upto(n: int) -> list[int]:
    out = set()
    a = 1
    while a <= n:
        b = a
        while b <= n:
            c = b
            while c <= n:
                out.add(c)
                c *= 5
            b *= 3
        a *= 2
    return sorted(out)


class Tuner:
    def __init__(self, pipeline: Pipeline, costs: CostModel, batches: Sequence[Sequence[SampleMeta]], *,
                 devices: int, memory_limit_mb: float | None = None,
                 memory: Mapping[str, MemoryModel] | None = None, overhead_s: Mapping[str, float] | None = None,
                 replica_devices: Mapping[str, int] | None = None, max_micro_batch: int = 64,
                 dp_candidates: int = 6, max_simulations: int = 40, runtime_s: Mapping[str, float] | None = None,
                 step_s: Mapping[str, float] | None = None, grad_mb: Mapping[str, float] | None = None,
                 planning_s: float = 0.0, cpu_cores: int | None = None, tp: Mapping[str, int] | None = None,
                 tp_efficiency: float = TP_EFFICIENCY) -> None:
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
        self.tp_efficiency = tp_efficiency
        self.rdev = {n: int((replica_devices or {}).get(n, 1)) * self.tp[n] for n in self.order}
        self.runtime = {n: float((runtime_s or {}).get(n, 0.0)) for n in self.order}
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
        self._terms: dict[tuple, float] = {}
        need = sum(self.rdev.values())
        if need > devices:
            raise PipelineError(f"tune: the pipeline needs at least {need} devices (one replica per section), "
                                f"got --devices {devices}")
        for n in self.order:
            most = max(1, (devices - need + self.rdev[n]) // self.rdev[n])  # the most replicas it could get
            least = min(self.memory[n].at(1, self.tp[n], most, fsdp) for fsdp in (False, True))
            if self.limit is not None and least > self.limit:
                raise PipelineError(
                    f"tune: sections.{n} does not fit the memory limit ({self.limit:.0f} MB) even at micro_batch 1 "
                    f"(predicted {least:.0f} MB at tp={self.tp[n]}); raise --memory-gb or allow a larger tp")

    # -- cost and memory at a micro-batch size -------------------------------------------------

    def cost_at(self, name: str, scale: float = 1.0) -> Cost:
        """The section's Cost as the search charges it: the fixed cost per micro-batch includes
        overhead_s and runtime_s, and every term is multiplied by `scale` (and divided by a
        tensor-parallel replica's speed-up)."""
        c = self.costs.costs[name]
        if self.tp[name] > 1:  # the replica's ranks share its compute, at an efficiency
            scale /= self.tp[name] * self.tp_efficiency
        fixed = c.per_micro_batch_s + self.overhead[name] + self.runtime[name]
        return dataclasses.replace(c, per_sample_s=c.per_sample_s * scale, per_token_s=c.per_token_s * scale,
                                   per_patch_s=c.per_patch_s * scale, per_frame_s=c.per_frame_s * scale,
                                   per_micro_batch_s=fixed * scale)

    def contention(self, workers: int) -> float:
        """Time scale when `workers` CPU processes share `cpu_cores` cores (module docstring)."""
        return workers / self.cpu_cores if self.cpu_cores and workers > self.cpu_cores else 1.0

    def section_end_s(self, name: str, dp: int) -> float:
        """A section's per-step cost after its last micro-batch (uncontended): a trainable
        section's optimizer step plus its all-reduce estimate."""
        if not self.graph.sections[name].trainable:
            return 0.0
        reduce = 2 * self.grad_mb[name] * (dp - 1) / dp / REDUCE_MB_PER_S if dp > 1 else 0.0
        return self.step_cost[name] + reduce

    def end_of_step_s(self, layout: Layout) -> float:
        """Per-step costs after the last micro-batch (uncontended): the slowest section's
        optimizer step + all-reduce estimate, plus one plan."""
        return max((self.section_end_s(n, dp) for n, dp, _ in layout), default=0.0) + self.planning_s

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

    def model_at(self, layout: Layout) -> CostModel:
        return dataclasses.replace(self.costs, costs={**self.costs.costs,
                                                      **{n: self.cost_at(n) for n, _, _ in layout}})

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
        """FSDP only where the section does not fit without it (it adds collectives every step)."""
        if self.limit is None or dp == 1:
            return False
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
            mbs[n] = _pow2_upto(min(self.max_mb, per_replica))[-1]
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
        """A lower bound on the step (see simulate.lower_bound) plus the longest one-sample chain."""
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
        costs = self.model_at(layout)
        planner = make_planner("wavefront", graph, costs)
        spans, bounds, busy = [], [], {n: 0.0 for n in self.order}
        fixed = self.end_of_step_s(layout)
        workers = sum(d * self.tp[n] for n, d, _ in layout)
        overlapped = self.overlapped()
        for step, batch in enumerate(self.batches):
            plan = planner.plan(step, batch)
            scale = self.contention(workers)
            sim = simulate(plan, graph, dataclasses.replace(costs, costs={**costs.costs, **{
                n: self.cost_at(n, scale) for n in self.order}}))
            if overlapped:  # the busiest replica, with its section's end of step, sets the pace
                step_s = max(max(sim.busy_s[n], default=0.0) + self.section_end_s(n, by_name[n][0]) * scale
                             for n in self.order)
            else:
                step_s = sim.makespan_s + fixed * scale
            spans.append(step_s)
            bounds.append(sim.lower_bound_s)
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

    # -- search -------------------------------------------------------------------------------

    def _dp_values(self, name: str) -> list[int]:
        cap = (self.devices - sum(self.rdev[n] for n in self.order if n != name)) // self.rdev[name]
        return list(range(1, cap + 1)) if cap <= 64 else _smooth_upto(cap)

    def dp_vectors(self, keep: int) -> list[tuple[float, int, dict[str, int], dict[str, int]]]:
        """The `keep` best dp vectors by analytic score, each with its default micro-batches."""
        values = {n: self._dp_values(n) for n in self.order}
        neighbours = {n: [e.edge.dst if e.edge.src == n else e.edge.src for e in self.graph.edges
                          if n in (e.edge.src, e.edge.dst)] for n in self.order}
        heap: list[tuple[float, int, tuple]] = []  # max-heap via negation: (-score, -devices, key)
        out: dict[tuple, tuple[float, int, dict[str, int], dict[str, int]]] = {}
        rest_min = [sum(self.rdev[n] for n in self.order[i:]) for i in range(len(self.order) + 1)]

        def cutoff() -> float:
            return -heap[0][0] if len(heap) >= keep else math.inf

        def visit(i: int, dps: dict[str, int], used: int, partial: float) -> None:
            if i == len(self.order):
                mbs = self.default_mbs(dps)
                if mbs is None:
                    return
                s = self.score(dps, mbs)
                key = tuple(dps[n] for n in self.order)
                item = (-s, -used, key)
                if len(heap) < keep:
                    heapq.heappush(heap, item)
                    out[key] = (s, used, dict(dps), mbs)
                elif item > heap[0]:
                    dropped = heapq.heapreplace(heap, item)
                    out.pop(dropped[2], None)
                    out[key] = (s, used, dict(dps), mbs)
                return
            name = self.order[i]
            for d in values[name]:
                if used + d * self.rdev[name] + rest_min[i + 1] > self.devices:
                    break
                if any(n in dps and d % dps[n] and dps[n] % d for n in neighbours[name]):
                    continue
                # Work at the largest micro-batch is the least a section can cost: a bound for
                # the branch, cut when it cannot reach the current top `keep`.
                bound = max(partial, self._term(("work", name, self.max_mb)) / d)
                if bound > cutoff() * (1 + 1e-9):
                    continue
                dps[name] = d
                visit(i + 1, dps, used + d * self.rdev[name], bound)
                del dps[name]

        visit(0, {}, 0, 0.0)
        return sorted(out.values(), key=lambda v: (v[0], v[1], tuple(v[2].values())))

    def _descend(self, start: Layout) -> Candidate:
        """Coordinate descent over the sections' micro-batches (powers of two), dp fixed."""
        best = self.evaluate(start)
        improved = True
        while improved and len(self.cache) < self.max_simulations:
            improved = False
            for i, (name, dp, mb) in enumerate(best.layout):
                per_replica = max(1, math.ceil(len(self.active[name]) / dp))
                for new in (mb * 2, mb // 2):
                    if new < 1 or new > min(self.max_mb, 2 * per_replica) or len(self.cache) >= self.max_simulations:
                        continue
                    layout = best.layout[:i] + ((name, dp, new),) + best.layout[i + 1:]
                    if not self._feasible(layout):
                        continue
                    cand = self.evaluate(layout)
                    if _rank(cand) < _rank(best):
                        best, improved = cand, True
                        break
        return best

    def uniform(self) -> Candidate | None:
        per = sum(self.rdev.values())
        options = []
        for d in range(1, self.devices // per + 1):
            most = max(math.ceil(len(self.active[n]) / d) for n in self.order)
            for m in _pow2_upto(min(self.max_mb, 2 * most)):
                dps, mbs = {n: d for n in self.order}, {n: m for n in self.order}
                if self._feasible(self._layout(dps, mbs)):
                    options.append((self.score(dps, mbs), d * per, m, self._layout(dps, mbs)))
        if not options:
            return None
        options.sort()
        return min((self.evaluate(o[3]) for o in options[:3]), key=_rank)

    def run(self, top: int = 5) -> TuneResult:
        vectors = self.dp_vectors(self.dp_candidates)
        if not vectors:
            raise PipelineError(f"tune: no configuration fits {self.devices} devices"
                                + (f" and {self.limit:.0f} MB per replica" if self.limit else ""))
        firsts = sorted((self.evaluate(self._layout(dps, mbs)) for _, _, dps, mbs in vectors), key=_rank)
        for start in firsts[:2]:
            self._descend(start.layout)
        uniform = self.uniform()
        ranked = sorted(self.cache.values(), key=_rank)
        # Within TIE_TOLERANCE of the fastest, fewer devices win: a configuration 0.1% faster
        # thanks to idle extra replicas is not worth them.
        near = [c for c in ranked if c.step_s <= ranked[0].step_s * (1 + TIE_TOLERANCE)]
        near.sort(key=lambda c: (c.devices, _rank(c)))
        ranked = near + [c for c in ranked if c not in near]
        return TuneResult(best=tuple(ranked[:top]), uniform=uniform, devices=self.devices,
                          evaluated=len(self.cache), scored=self.scored)


def _rank(c: Candidate) -> tuple:
    return (round(c.step_s, 12), c.devices, c.layout)


def tune(pipeline: Pipeline, costs: CostModel | None, samples: Sequence[SampleMeta] | Sequence[Sequence[SampleMeta]],
         *, devices: int, top: int = 5, tp_options: Mapping[str, Sequence[int]] | None = None,
         **options) -> TuneResult:
    """Rank configurations of `pipeline` on `devices` devices (see the module docstring).

    `samples` is one global batch of metadata or several (the step time is their mean);
    `tp_options` (section -> the tensor-parallel sizes its stage allows; default: the pipeline's
    own tp) adds tp to the search, FSDP following from memory (`Tuner.fsdp_for`); options:
    memory_limit_mb, memory (section -> MemoryModel), overhead_s (section -> seconds per
    micro-batch), replica_devices, max_micro_batch, dp_candidates, max_simulations,
    tp_efficiency, and the calibration (see the module docstring): runtime_s, step_s, grad_mb,
    planning_s, cpu_cores.
    """
    if costs is None:
        costs = CostModel(costs={s.name: s.cost for s in pipeline.sections})
    batches = [samples] if samples and isinstance(samples[0], SampleMeta) else list(samples)
    results, refusals = [], []
    for tp in tp_assignments(pipeline, tp_options, options.get("memory") or {}, options.get("memory_limit_mb"),
                             devices):
        try:
            results.append(Tuner(pipeline, costs, batches, devices=devices, tp=tp, **options).run(top))
        except PipelineError as exc:
            refusals.append(exc)
    if not results:
        raise refusals[0]
    return dataclasses.replace(merge(results, top), monolithic=monolithic_for(pipeline, costs, batches, devices,
                                                                               options))


def monolithic_for(pipeline: Pipeline, costs: CostModel, batches: Sequence[Sequence[SampleMeta]], devices: int,
                   options: Mapping, micro_batches: Sequence[int] | None = None) -> MonolithicStep | None:
    """The monolithic baseline on the same devices at its best micro-batch (of `micro_batches`,
    default powers of two up to max_micro_batch) that fits the memory limit with every section
    on each rank; None when none fits."""
    graph = SectionGraph(pipeline)
    memory, limit = options.get("memory") or {}, options.get("memory_limit_mb")
    fits = [m for m in micro_batches or _pow2_upto(options.get("max_micro_batch", 64))
            if limit is None or sum(memory.get(n, MemoryModel()).at(m) for n in graph.order) <= limit]
    if not fits:
        return None
    return best_monolithic(graph, costs, batches, devices=devices, micro_batches=fits,
                           overhead_s=options.get("overhead_s"), runtime_s=options.get("runtime_s"),
                           step_s=options.get("step_s"), grad_mb=options.get("grad_mb"),
                           planning_s=options.get("planning_s", 0.0), cpu_cores=options.get("cpu_cores"))


def tp_assignments(pipeline: Pipeline, tp_options: Mapping[str, Sequence[int]] | None,
                   memory: Mapping[str, MemoryModel], limit: float | None, devices: int) -> list[dict[str, int]]:
    """The tp of every section to search: per section, the smallest allowed tp whose rank fits
    the memory limit at micro-batch 1 (with FSDP over as many replicas as the devices allow)
    and the next larger one (faster, when devices are spare); every combination of those."""
    per: dict[str, list[int]] = {}
    for s in pipeline.sections:
        allowed = sorted({t for t in (tp_options or {}).get(s.name, (s.tp,)) if t <= devices}) or [s.tp]
        m = memory.get(s.name, MemoryModel())
        fits = [t for t in allowed if limit is None or min(m.at(1, t, max(1, devices // t), f) for f in (False, True))
                <= limit]
        start = allowed.index(fits[0]) if fits else len(allowed) - 1
        per[s.name] = allowed[start:start + 2]
    out: list[dict[str, int]] = [{}]
    for name, values in per.items():
        out = [{**a, name: t} for a in out for t in values]
    return out


def merge(results: Sequence[TuneResult], top: int) -> TuneResult:
    """One ranking from the searches at each tp assignment (fewer devices win near-ties)."""
    ranked = sorted((c for r in results for c in r.best), key=_rank)
    near = [c for c in ranked if c.step_s <= ranked[0].step_s * (1 + TIE_TOLERANCE)]
    near.sort(key=lambda c: (c.devices, _rank(c)))
    ranked = near + [c for c in ranked if c not in near]
    uniforms = [r.uniform for r in results if r.uniform is not None]
    return TuneResult(best=tuple(ranked[:top]), uniform=min(uniforms, key=_rank) if uniforms else None,
                      devices=results[0].devices, evaluated=sum(r.evaluated for r in results),
                      scored=sum(r.scored for r in results))
