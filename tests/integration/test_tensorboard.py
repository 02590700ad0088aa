"""`--tensorboard DIR`: per-step curves a TensorBoard reads back (loss, lr, grad norm, throughput,
busy share per section), equal to the metrics rows."""

from __future__ import annotations

import json

import pytest

from maestro_flow.runtime.tensorboard import scalars
from tests.integration.conftest import maestro

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_tensorboard_curves_match_the_metrics(demo_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = tmp_path / "metrics.jsonl"
    result = maestro("run", "pipelines/distill.py", "--quiet", "--no-run-dir",
                     "--steps", "3", "--set", f"data.path={demo_data}", "--set", "grad_clip=1.0",
                     "--set", "sections.student.optimizer={\"name\": \"adamw\", \"lr\": 0.003, \"warmup_steps\": 2}",
                     "--metrics-out", str(metrics), "--tensorboard", str(tmp_path / "tb"))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    [run] = (tmp_path / "tb").iterdir()  # one folder per run
    assert run.name.startswith("distill-")
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr/student", "throughput/samples_per_s", "throughput/tokens_per_s",
            "busy/teacher", "busy/student", "step_time_s", "restarts"} <= tags
    for tag in tags:
        points = events.Scalars(tag)
        assert [p.step for p in points] == [0, 1, 2], tag
        for point, row in zip(points, rows, strict=True):
            assert point.value == pytest.approx(scalars(row)[tag], rel=1e-6), tag
    assert [p.value for p in events.Scalars("lr/student")] == pytest.approx([0.0015, 0.003, 0.003])


def test_each_run_gets_its_own_tensorboard_folder(demo_data, tmp_path):
    """Two runs into one --tensorboard DIR draw two curves (they drew one, with two points a step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for lr in ("0.001", "0.01"):
        result = maestro("run", "pipelines/distill.py", "--quiet", "--no-run-dir", "--colocated", "--steps", "2",
                         "--set", f"data.path={demo_data}", "--set", f"sections.student.optimizer.lr={lr}",
                         "--tensorboard", str(tmp_path / "tb"))
        assert result.returncode == 0, result.stderr[-2000:]
    runs = sorted((tmp_path / "tb").iterdir())
    assert len(runs) == 2
    for run in runs:
        events = EventAccumulator(str(run))
        events.Reload()
        assert [p.step for p in events.Scalars("loss")] == [0, 1]
