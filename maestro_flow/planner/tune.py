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
    micro-batches and at least 16 samples, the wavefront planner's credit) — capped by its samples per step.
Tensor parallelism and FSDP (`tune(tp_options=...)`): a section's replica is tp ranks (tp
devices); its compute per sample is divided by tp x TP_EFFICIENCY (0.8: the all-reduces inside
each layer cost the rest), and its memory per rank follows `MemoryModel.at`: the share of the
parameters the stage's tp_plan shards is divided by tp; FSDP, chosen for a section only when it
does not fit without (its collectives cost every step), shards the optimizer state over dp while
the parameters and a trainable section's gradients are gathered for the whole step, or, in a
lockstep section (a frozen teacher fed by the data, a loss section at tp=1), a few units at a
time (as the runtime holds them, parallel/fsdp.py), whose collectives are then charged on every
micro-batch (`TuneModel.lockstep_s`). Each combination of the sections'
candidate tp values (`tp_assignments`) is searched as below and the results are merged. How a
configuration's step time and memory are predicted: planner/tune_model.py (`TuneModel`, which
`Tuner` extends with the search).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Collection, Mapping, Sequence

from maestro_flow.config import Pipeline
from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.monolithic import MonolithicStep, best_monolithic
from maestro_flow.planner.tune_model import TuneModel, apart, pow2_upto
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

TIE_TOLERANCE = 0.005  # steps within 0.5% of the fastest count as equal; fewer devices win
START_SHRINK = (4, 16)  # the search also starts from the default micro-batches divided by these (Tuner._starts)


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


class Tuner(TuneModel):
    """The search over layouts of a TuneModel (`run`)."""

    # -- search -------------------------------------------------------------------------------

    def _dp_values(self, name: str) -> list[int]:
        cap = (self.devices - sum(self.rdev[n] for n in self.order if n != name)) // self.rdev[name]
        if not self._sharded_past_samples(name):
            cap = min(cap, self.most[name])
        return list(range(1, cap + 1)) if cap <= 64 else _smooth_upto(cap)

    def _sharded_past_samples(self, name: str) -> bool:
        """Whether section `name` may have more replicas than samples a step: fed by the data, it
        fits only sharded (FSDP, run in lockstep at tp 1), and its spare replicas stand in each
        round, each one more shrinking every rank's shard (runtime/lockstep.py)."""
        m = self.memory[name]
        return (not self.graph.inputs(name) and m.lockstep and self.tp[name] == 1 and self.limit is not None
                and m.at(1, 1, self.most[name], False) > self.limit)

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
                # The least work the section has at any micro-batch: a bound for the branch, cut
                # when it cannot reach the current top `keep`.
                bound = max(partial, self.least_work(name) / d)
                if bound > cutoff() * (1 + 1e-9):
                    continue
                dps[name] = d
                visit(i + 1, dps, used + d * self.rdev[name], bound)
                del dps[name]

        visit(0, {}, 0, 0.0)
        return sorted(out.values(), key=lambda v: (v[0], v[1], tuple(v[2].values())))

    def _starts(self, vectors: Sequence[tuple[float, int, dict[str, int], dict[str, int]]]) -> list[Layout]:
        """Where the descent may start: each dp vector at its default micro-batches, and at a
        quarter and a sixteenth of them (START_SHRINK). From the largest alone, the descent,
        halving one micro-batch at a time, stopped at the first local minimum (found in review:
        a FIFO VLM, whose consumers wait for a producer's micro-batch whole, tuned 26% slower than
        its best layout, a wavefront one 5%; tests/unit/test_tune.py compares with every layout)."""
        out: list[Layout] = []
        for _, _, dps, mbs in vectors:
            for shrink in (1, *START_SHRINK):
                layout = self._layout(dps, {n: max(1, m // shrink) for n, m in mbs.items()})
                if layout not in out and (shrink == 1 or self._feasible(layout)):
                    out.append(layout)
        return out

    def _descend(self, start: Layout) -> Candidate:
        """Coordinate descent over the sections' micro-batches (powers of two), dp fixed."""
        best = self.evaluate(start)
        improved = True
        while improved and len(self.cache) < self.max_simulations:
            improved = False
            for i, (name, dp, mb) in enumerate(best.layout):
                per_replica = max(1, math.ceil(len(self.active[name]) / dp))
                for new in (mb * 2, mb // 2):
                    if (new < 1 or new > min(self.max_mb, 2 * per_replica, self.most[name])
                            or len(self.cache) >= self.max_simulations):
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
        for d in range(1, min(self.devices // per, max(self.most.values())) + 1):
            most = max(math.ceil(len(self.active[n]) / d) for n in self.order)
            for m in pow2_upto(min(self.max_mb, 2 * most, max(self.most.values()))):
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
                                + (f" and {self.limit:.0f} MiB per replica" if self.limit else ""))
        firsts = sorted((self.evaluate(layout) for layout in self._starts(vectors)), key=_rank)
        # From the two best starts, the two best at the default micro-batches (where the search
        # started before _starts: it found what it found then), and the best start of each of
        # the two best dp vectors (found in review: the two best starts were often one dp
        # vector's, and the second vector's descent was lost).
        defaults = {self._layout(dps, mbs) for _, _, dps, mbs in vectors}
        best_of = {tuple(d for _, d, _ in c.layout): c for c in reversed(firsts)}
        starts = (firsts[:2] + [c for c in firsts if c.layout in defaults][:2]
                  + sorted(best_of.values(), key=_rank)[:2])
        for start in dict.fromkeys(c.layout for c in starts):
            self._descend(start)
        uniform = self.uniform()
        ranked = _ties_to_the_frugal(sorted(self.cache.values(), key=_rank))
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
    tp_efficiency, and the calibration (see the module docstring): runtime_s, message_s, step_s, grad_mb,
    planning_s, cpu_cores.
    """
    if costs is None:
        costs = CostModel(costs={s.name: s.cost for s in pipeline.sections})
    batches = [samples] if samples and isinstance(samples[0], SampleMeta) else list(samples)
    results, refusals = [], []
    capable = options.pop("tp_capable", None)
    for tp in tp_assignments(pipeline, tp_options, options.get("memory") or {}, options.get("memory_limit_mb"),
                             devices, capable):
        try:
            results.append(Tuner(pipeline, costs, batches, devices=devices, tp=tp, **options).run(top))
        except PipelineError as exc:
            refusals.append(exc)
    if not results:
        raise refusals[0]
    return dataclasses.replace(merge(results, top), monolithic=monolithic_for(pipeline, costs, batches, devices,
                                                                               options, fewer=True))


def monolithic_for(pipeline: Pipeline, costs: CostModel, batches: Sequence[Sequence[SampleMeta]], devices: int,
                   options: Mapping, micro_batches: Sequence[int] | None = None,
                   fewer: bool = False) -> MonolithicStep | None:
    """The monolithic baseline on the same devices (at most one per sample of a global batch: a rank
    takes a share of each; with `fewer`, at its fastest number of them: best_monolithic) at its
    best micro-batch (of `micro_batches`, default powers of two up to max_micro_batch) that fits
    the memory limit with every section on each rank; None when none fits."""
    graph = SectionGraph(pipeline)
    memory, limit = options.get("memory") or {}, options.get("memory_limit_mb")
    devices = min(devices, min(len(b) for b in batches))
    largest = min(options.get("max_micro_batch", 64), max(len(b) for b in batches))  # a global batch: no more
    fits = [m for m in micro_batches or pow2_upto(largest)
            if limit is None or sum(memory.get(n, MemoryModel()).at(m) for n in graph.order) <= limit]
    if not fits:
        return None
    return best_monolithic(graph, costs, batches, devices=devices, micro_batches=fits, fewer=fewer,
                           overhead_s=options.get("overhead_s"), runtime_s=options.get("runtime_s"),
                           step_s=options.get("step_s"), grad_mb=options.get("grad_mb"),
                           planning_s=options.get("planning_s", 0.0), cpu_cores=options.get("cpu_cores"))


def tp_assignments(pipeline: Pipeline, tp_options: Mapping[str, Sequence[int]] | None,
                   memory: Mapping[str, MemoryModel], limit: float | None, devices: int,
                   capable: Collection[str] | None = None) -> list[dict[str, int]]:
    """The tp of every section to search: per section, the smallest allowed tp whose rank fits
    the memory limit at micro-batch 1 (with FSDP over as many replicas as the devices allow)
    and the next larger one (faster, when devices are spare); every combination of those.
    `capable`: the sections whose stage can be tensor-parallel (None: unknown, all); a section
    outside it that fits no way is not told to raise --max-tp, which cannot split it."""
    per: dict[str, list[int]] = {}
    for s in pipeline.sections:
        allowed = sorted({t for t in (tp_options or {}).get(s.name, (s.tp,)) if t <= devices}) or [s.tp]
        m = memory.get(s.name, MemoryModel())
        least = {t: min(m.at(1, t, max(1, devices // t), f) for f in (False, True)) for t in allowed}
        fits = [t for t in allowed if limit is None or least[t] <= limit]
        if not fits:  # no layout fits: say so (the largest tp's search would refuse it for other reasons)
            limit_mb, least_mb = apart(limit, min(least.values()))
            raise_ = ("raise --memory-gb, --max-tp or --devices" if capable is None or s.name in capable else
                      "raise --memory-gb or --devices (its stage has no tp_plan, so tensor parallelism cannot "
                      "split it)")
            raise PipelineError(
                f"tune: sections.{s.name} does not fit the memory limit ({limit_mb} MiB) at micro_batch 1 with any "
                f"tensor parallelism it allows ({', '.join(map(str, allowed))}) and FSDP over the most replicas "
                f"{devices} devices give (predicted {least_mb} MiB at least); {raise_}")
        start = allowed.index(fits[0])
        per[s.name] = allowed[start:start + 2]
    out: list[dict[str, int]] = [{}]
    for name, values in per.items():
        out = [{**a, name: t} for a in out for t in values]
    return out


def merge(results: Sequence[TuneResult], top: int) -> TuneResult:
    """One ranking from the searches at each tp assignment (fewer devices win near-ties)."""
    ranked = _ties_to_the_frugal(sorted((c for r in results for c in r.best), key=_rank))
    uniforms = [r.uniform for r in results if r.uniform is not None]
    return TuneResult(best=tuple(ranked[:top]), uniform=min(uniforms, key=_rank) if uniforms else None,
                      devices=results[0].devices, evaluated=sum(r.evaluated for r in results),
                      scored=sum(r.scored for r in results))


def _ties_to_the_frugal(ranked: list[Candidate]) -> list[Candidate]:
    """Within TIE_TOLERANCE of the fastest, fewer devices win, then less memory per rank: a
    configuration 0.1% faster thanks to idle extra replicas, or to micro-batches that take 1.7x
    the memory (found in QA), is not worth them."""
    near = [c for c in ranked if c.step_s <= ranked[0].step_s * (1 + TIE_TOLERANCE)]
    near.sort(key=lambda c: (c.devices, max(c.memory_mb.values(), default=0.0), _rank(c)))
    return near + [c for c in ranked if c not in near]
