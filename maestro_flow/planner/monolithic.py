"""The predicted step of the monolithic baseline (baseline/monolithic.py), for `maestro tune`.

Pure (standard library only). The baseline runs `devices` data-parallel ranks; rank r takes a
contiguous block of the global batch (sample i of N goes to rank i * devices // N, as its FIFO
plan does) in micro-batches of `micro_batch`, and on each micro-batch runs every section that
activates on one of its samples, on those samples: forward, and backward where the section
trains and a gradient reaches it (simulate.micro_batch_task_s, the same costs as section mode,
padding to the micro-batch's longest sample included). A section that runs in a micro-batch
pays its fixed costs there (its Cost's, plus overhead_s + runtime_s, as `maestro profile`
measures them per micro-batch). The step ends when the slowest rank is done, plus one
gradient all-reduce of every trainable parameter (the tuner's ring estimate over the summed
gradients) and every section's optimizer step one after another, plus planning. Ranks that are
CPU processes sharing fewer cores than there are ranks run `devices / cpu_cores` slower, as the
tuner charges section mode's workers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.simulate import micro_batch_task_s
from maestro_flow.planner.tune_model import REDUCE_MB_PER_S, pow2_upto
from maestro_flow.samples import SampleMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class MonolithicStep:
    step_s: float
    devices: int
    micro_batch: int
    compute_s: float  # the slowest rank's micro-batches (contention included)
    end_s: float  # all-reduce, optimizer steps and planning (contention included)


def monolithic_step(graph: SectionGraph, costs: CostModel, batch: Sequence[SampleMeta], *, devices: int,
                    micro_batch: int, overhead_s: Mapping[str, float] | None = None,
                    runtime_s: Mapping[str, float] | None = None, step_s: Mapping[str, float] | None = None,
                    grad_mb: Mapping[str, float] | None = None, planning_s: float = 0.0,
                    cpu_cores: int | None = None) -> MonolithicStep:
    overhead, runtime = overhead_s or {}, runtime_s or {}
    n = len(batch)
    shares: list[list[SampleMeta]] = [[] for _ in range(devices)]
    for i, s in enumerate(batch):
        shares[i * devices // n if n else 0].append(s)
    slowest = 0.0
    for share in shares:
        t = 0.0
        for k in range(0, len(share), micro_batch):
            mb = share[k:k + micro_batch]
            for name in graph.order:
                active = [s for s in mb if graph.sections[name].activates(s.modalities)]
                if active:
                    t += overhead.get(name, 0.0) + runtime.get(name, 0.0)
                    t += micro_batch_task_s(graph, costs, name, active)
        slowest = max(slowest, t)
    trainable = [name for name in graph.order if graph.sections[name].trainable]
    grads = sum((grad_mb or {}).get(name, 0.0) for name in trainable)
    end = sum((step_s or {}).get(name, 0.0) for name in trainable) + planning_s
    if devices > 1:
        end += 2 * grads * (devices - 1) / devices / REDUCE_MB_PER_S
    scale = devices / cpu_cores if cpu_cores and devices > cpu_cores else 1.0
    return MonolithicStep(step_s=(slowest + end) * scale, devices=devices, micro_batch=micro_batch,
                          compute_s=slowest * scale, end_s=end * scale)


def best_monolithic(graph: SectionGraph, costs: CostModel, batches: Sequence[Sequence[SampleMeta]], *,
                    devices: int, micro_batches: Sequence[int], fewer: bool = False, **options) -> MonolithicStep:
    """The baseline at its best micro-batch among `micro_batches` (mean over `batches`), as a
    Megatron user would tune it; ties go to the smaller micro-batch (less activation memory). A
    size above a rank's share of the batch is reported as that share (the same step).
    With `fewer`, also at its best number of ranks up to `devices` (powers of two and `devices`;
    ties go to more ranks): CPU ranks sharing fewer cores can be slower than fewer ranks."""
    best: MonolithicStep | None = None
    counts = sorted({*pow2_upto(devices), devices}, reverse=True) if fewer else [devices]
    for d in counts:
        share = max(math.ceil(len(b) / d) for b in batches)  # a rank's most samples: a larger mb is this one
        for mb in sorted({min(m, share) for m in micro_batches}):  # (found in QA: tune printed --micro-batch 16 for 12)
            steps = [monolithic_step(graph, costs, b, devices=d, micro_batch=mb, **options) for b in batches]
            k = len(steps)
            mean = MonolithicStep(step_s=sum(s.step_s for s in steps) / k, devices=d, micro_batch=mb,
                                  compute_s=sum(s.compute_s for s in steps) / k, end_s=sum(s.end_s for s in steps) / k)
            if best is None or mean.step_s < best.step_s * (1 - 1e-9):
                best = mean
    assert best is not None, "no micro-batch size to try"
    return best
