"""tools/bench/tune_report's published-scale comparison (part (b)): both sides get the same GPUs."""

from __future__ import annotations

import pytest

from maestro_flow.planner.cost import CostModel
from tools.bench import tune_report as t


def test_the_published_scale_baseline_says_the_gpus_it_uses_and_can_spread_over_all():
    """Found in QA: tune_report's monolithic side of distill ran one replica of the 48 GPUs its
    sections need, 16 of 64 idle, while section mode used all 64, and the table did not say so.
    It now reports each side's GPUs and a second baseline spread over every GPU (scaled for free)."""
    pipeline, gpus = t.distill_workload(64)
    costs = CostModel(costs={s.name: s.cost for s in pipeline.sections})
    batch = t.synthetic_samples(64, 0.0, seed=0)
    fixed, width = t.monolithic(pipeline, costs, batch, gpus, 64)
    assert (fixed.devices, width) == (1, 48)  # as wide as the sections need, as section mode's replicas
    spread, width = t.monolithic(pipeline, costs, batch, gpus, 64, spread=True)
    assert (spread.devices, width) == (1, 64)  # one replica of 48 cannot be doubled: spread over all 64
    assert spread.step_s == pytest.approx(fixed.step_s * 48 / 64, rel=0.05)  # the compute scales; overheads do not
    spread, width = t.monolithic(pipeline, costs, batch, gpus, 100, spread=True)
    assert spread.devices * width <= 100 and width >= sum(gpus.values())
