"""Fitting `maestro profile`'s measurements: a section's Cost, fixed cost and memory model.

Pure (standard library only; called by runtime/profiling.py with the rows it measured, each one
micro-batch: its samples and their sizes, forward and backward seconds, peak memory). The forward
times are fitted by planner.costfit.fit_nonnegative as seconds = overhead + a*samples + b*tokens
+ c*patches + d*frames (the terms the section's Cost uses), once with the rows counted as a
stage that pads is charged (every sample at its micro-batch's longest: planner/cost.charged) and
once without; the by far better fit (PADDING_MARGIN) sets `Cost.padded`. backward_factor = total backward / total
forward time; memory = parameter state + a fitted line in the micro-batch size.

Also pure: which samples are timed (default_sizes, spread, micro_batches), the rows' source;
and planning_s, the (pure) planner's time for one global batch, which reads the clock.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import Any

from maestro_flow.config import Cost, Pipeline
from maestro_flow.graph import SectionGraph
from maestro_flow.planner.cost import charged
from maestro_flow.planner.costfit import FEATURES, fit_nonnegative
from maestro_flow.samples import SampleMeta

# The other padding model than the Cost declares must fit 4x better (sum of squared residuals)
# to be taken: a few repeats of few-ms micro-batches on a busy host fit the wrong model up to
# ~3x better at times (2026-11-25: tests/integration/test_profile.py flipped on this 2-core VM),
# while a stage that really pads differently misses by far more (exact timings: a factor of
# thousands, tests/unit/test_costfit.py).
PADDING_MARGIN = 0.75


def _fit_forward(prior: Cost, rows: list[dict[str, Any]], padded: bool
                 ) -> tuple[tuple[float, ...], float, list[tuple[int, int, int, int]]]:
    """(fixed cost, FEATURES coefficients) of the forward times with the rows counted as a stage
    that pads (or not) is charged, the fit's sum of squared residuals, and each row's counts
    (samples, tokens, patches, frames) as charged."""
    used = [f == "per_sample_s" or getattr(prior, f) > 0 for f in FEATURES]
    # One micro-batch size: a fixed cost per micro-batch cannot be told from the cost per sample,
    # so it is 0, as `profile` says (found in QA: the two were split, the fixed part pulled to 0
    # and the cost per sample to the pipeline's declared one).
    fixed = 1.0 if len({r["samples"] for r in rows}) > 1 else 0.0
    as_charged = dataclasses.replace(prior, padded=padded)
    data, counted = [], []
    for r in rows:
        if "sizes" in r:  # recount: every sample at the longest one's lengths, or each at its own
            mb = [SampleMeta(id=i, num_tokens=t, num_patches=p, num_frames=f) for i, (t, p, f) in enumerate(r["sizes"])]
            counts = charged(as_charged, mb)
        else:
            counts = (r["samples"], r["tokens"], r["patches"], r["frames"])
        counted.append(counts)
        x = [float(v) for v in counts]
        data.append(([fixed] + [v if u else 0.0 for v, u in zip(x, used, strict=True)], r["forward_s"]))
    coef = fit_nonnegative(data, (0.0, *(getattr(prior, f) for f in FEATURES)), 0.05)
    residual = sum((y - sum(c * v for c, v in zip(coef, x, strict=True))) ** 2 for x, y in data)
    return coef, residual, counted


def default_sizes(micro_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, ... up to twice the section's micro-batch (at least 8)."""
    top, out, m = max(8, 2 * micro_batch), [], 1
    while m <= top:
        out.append(m)
        m *= 2
    return tuple(out)


def _size(s: SampleMeta) -> int:
    return s.num_tokens + s.num_patches + s.num_frames


def spread(samples: list[SampleMeta], n: int) -> list[SampleMeta]:
    """`n` samples evenly spaced over the size order (all of them when there are fewer)."""
    ordered = sorted(samples, key=lambda s: (_size(s), s.id))
    if len(ordered) <= n:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / (n - 1))] for i in range(n)] if n > 1 else ordered[:1]


def micro_batches(pool: list[SampleMeta], m: int) -> list[list[SampleMeta]]:
    """The micro-batches of size `m` (at most the pool's) timed from a size-ordered pool: its
    smallest, middle and largest samples, and one of mixed lengths spread over it (what padding
    costs)."""
    m = min(m, len(pool))
    starts = sorted({0, (len(pool) - m) // 2, len(pool) - m})
    mbs = [pool[start:start + m] for start in starts]
    if m > 1:
        mbs.append(pool[::max(1, len(pool) // m)][:m])
    return mbs


def state_copies(trainable: bool, optimizer: Mapping[str, Any]) -> int:
    """Bytes of training state per trained parameter byte: the weights, their gradients and the
    optimizer's buffers (AdamW: two moments, three with amsgrad; SGD: a momentum buffer where
    momentum is not 0); 1 (the weights) for a frozen section."""
    if not trainable:
        return 1
    if optimizer.get("name") == "adamw":
        return 5 if optimizer.get("amsgrad") else 4
    return 3 if optimizer.get("momentum") else 2


def fit_section(prior: Cost, rows: list[dict[str, Any]], trainable: bool, param_mb: float,
                optimizer: Mapping[str, Any], trained_mb: float | None = None) -> dict[str, Any]:
    """Cost coefficients, per-micro-batch overhead and memory model from the measurements.
    `trained_mb`: the bytes of the parameters that train (default all of param_mb); a frozen
    part of a trainable stage (a KD student's copy of the teacher's head) has no gradients or
    optimizer state. The measured peaks hold no gradients: they exist before each measured
    call, as in a run, where the state counts them.

    Padding is detected, not only declared: the forward times are fitted both ways (each
    micro-batch charged at its longest sample, or at its samples' own lengths) and the better
    fit sets `Cost.padded` (PADDING_MARGIN: by far better; otherwise the pipeline's setting
    stays). The mixed-length micro-batches tell the two apart; a stage whose time does not
    depend on lengths fits both alike."""
    fits = {padded: _fit_forward(prior, rows, padded) for padded in (False, True)}
    padded = prior.padded
    if fits[not padded][1] < fits[padded][1] * (1 - PADDING_MARGIN):
        padded = not padded
    coef, _, counted = fits[padded]
    for r, (_, tokens, patches, frames) in zip(rows, counted, strict=True):  # as the chosen model counts them
        r.update(tokens=tokens, patches=patches, frames=frames)
    fwd = sum(r["forward_s"] for r in rows)
    factor = sum(r["backward_s"] for r in rows) / fwd if trainable and fwd > 0 else prior.backward_factor
    cost = Cost(**dict(zip(FEATURES, coef[1:], strict=True)), backward_factor=factor, per_micro_batch_s=coef[0],
                padded=padded)
    mem = fit_nonnegative([((1.0, float(r["samples"])), r["peak_mb"]) for r in rows], (1.0, 1.0), 0.05)
    trained = param_mb if trained_mb is None else trained_mb
    state = param_mb + trained * (state_copies(trainable, optimizer) - 1)
    return {"cost": dataclasses.asdict(cost), "micro_batch_overhead_s": coef[0],
            "memory_base_mb": state + mem[0], "peak_memory_mb_per_sample": mem[1],
            "padding": {"declared": prior.padded, "detected": padded,
                        "residual_padded": fits[True][1], "residual_summed": fits[False][1]}}


def planning_s(pipeline: Pipeline, graph: SectionGraph, metadata: list[SampleMeta], repeats: int) -> float:
    """Seconds for one plan of a global batch (the coordinator plans every step)."""
    from maestro_flow.planner import make_planner
    from maestro_flow.planner.cost import CostModel

    if not metadata:
        return 0.0
    batch = metadata[:pipeline.global_batch]
    # The rules alone: a run's search (planner/refine.py) runs only on a core of its own, ahead of
    # the step (runtime/cpus.search_share; a plan held back at a checkpoint aside), so it is not
    # part of the step's planning time.
    planner = make_planner(pipeline.schedule, graph, CostModel(costs={s.name: s.cost for s in pipeline.sections}),
                           search=0.0)
    times = []
    for step in range(repeats + 1):
        t0 = time.perf_counter()
        planner.plan(step, batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])
