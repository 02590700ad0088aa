"""Fitting `maestro profile`'s measurements: a section's Cost, fixed cost and memory model.

Pure (standard library only; called by runtime/profiling.py with the rows it measured, each one
micro-batch: its samples and their sizes, forward and backward seconds, peak memory). The forward
times are fitted by planner.costfit.fit_nonnegative as seconds = overhead + a*samples + b*tokens
+ c*patches + d*frames (the terms the section's Cost uses), once with the rows counted as a
stage that pads is charged (every sample at its micro-batch's longest: planner/cost.charged) and
once without; the by far better fit (PADDING_MARGIN) sets `Cost.padded`. backward_factor = total backward / total
forward time; memory = parameter state + a fitted line in the micro-batch size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from maestro_flow.config import Cost
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
        data.append(([1.0] + [v if u else 0.0 for v, u in zip(x, used, strict=True)], r["forward_s"]))
    coef = fit_nonnegative(data, (0.0, *(getattr(prior, f) for f in FEATURES)), 0.05)
    residual = sum((y - sum(c * v for c, v in zip(coef, x, strict=True))) ** 2 for x, y in data)
    return coef, residual, counted


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
