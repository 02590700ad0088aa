"""The monolithic baseline (`maestro run --baseline monolithic`) and `--pin-cpus`.

Its maths is checked against a plain PyTorch loop in test_oracle.py (distillation and the VLM,
with clipping, schedules per section and layers without gradients). Here: what it runs (each
rank a contiguous share of every global batch, one micro-batch size for every section), its
refusals, a stage error naming the section inside the fused model, and the cores each worker
gets with --pin-cpus.
"""

from __future__ import annotations

import json
import os

import pytest

from maestro_flow.runtime.run import RunOptions, run_pipeline
from tests.integration.conftest import ASSETS, ROOT, maestro

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_each_rank_runs_every_section_on_a_contiguous_share(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    rows = run_pipeline(str(ROOT / "pipelines/distill.py"), RunOptions(
        overrides={"steps": 2, "global_batch": 10, "data.path": str(demo_data), "data.shuffle": False},
        baseline="monolithic", devices=3, micro_batch=2, run_dir=str(run_dir), show_progress=False))
    assert [r["step"] for r in rows] == [0, 1]
    assert set(rows[0]["sections"]) == {"model"} and rows[0]["samples"] == 10
    plans = [json.loads(line) for line in (run_dir / "plans.jsonl").read_text().splitlines()]
    for step, plan in enumerate(plans):
        replicas = plan["sections"]["model"]["replicas"]
        assert len(replicas) == 3
        shares = [[sid for mb in rep for sid in mb] for rep in replicas]
        assert [len(s) for s in shares] in ([4, 3, 3], [3, 4, 3], [3, 3, 4])  # balanced by count
        assert sum(shares, []) == list(range(step * 10, step * 10 + 10))  # contiguous, in order
        assert all(len(mb) <= 2 for rep in replicas for mb in rep)


def test_refusals_name_what_to_change(demo_data):
    cases = [
        (["--baseline", "monolithic", "--colocated"], "drop --colocated"),
        (["--baseline", "monolithic", "--checkpoint-dir", "ckpt", "--checkpoint-every", "1"], "drop --checkpoint-dir"),
        (["--devices", "2"], "add --baseline monolithic"),
        (["--colocated", "--micro-batch", "2"], "which is not --colocated: drop --micro-batch"),  # (not a circle: QA)
        (["--baseline", "monolithic", "--checkpoint-every", "1"], "drop --checkpoint-every"),
        (["--baseline", "monolithic", "--devices", "0"], "--devices must be an integer >= 1"),
        (["--baseline", "monolithic", "--micro-batch", "0"], "--micro-batch must be an integer >= 1"),
    ]
    for args, message in cases:
        result = maestro("run", "pipelines/distill.py", "--quiet", "--no-run-dir", "--set", f"data.path={demo_data}",
                         *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)


def test_a_stage_error_names_the_section_inside_the_model(demo_data):
    result = maestro("run", str(ASSETS / "faulty.py"), "--quiet", "--no-run-dir", "--baseline", "monolithic",
                     "--devices", "2", "--set", f"data.path={demo_data}", "--set", "sections.student.config.fail=forward",
                     "--set", "sections.student.config.at_step=1", timeout=90)
    assert result.returncode == 1, result.stderr
    assert "section 'model'" in result.stderr and "during forward at step 2" in result.stderr
    assert "in section 'student'" in result.stderr


def test_pinned_workers_get_their_own_cores(demo_data):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs at least 2 cores")
    rows = run_pipeline(str(ASSETS / "plain.py"), RunOptions(
        overrides={"steps": 1, "data.path": str(demo_data), "sections.head.dp": 1}, pin_cpus=True,
        show_progress=False))
    embed, head = (rows[0]["sections"][n]["stage"] for n in ("embed", "head"))
    mine = set(cores)
    as_set = lambda mask: {c for c in range(mask.bit_length()) if mask >> c & 1}  # noqa: E731
    assert as_set(embed["cpu_mask"]) | as_set(head["cpu_mask"]) == mine  # every core used
    assert not as_set(embed["cpu_mask"]) & as_set(head["cpu_mask"])  # none shared
    # One torch thread per core of its own (blocks differ by one core where the count is odd).
    assert embed["threads"] == len(as_set(embed["cpu_mask"])) and head["threads"] == len(as_set(head["cpu_mask"]))
    # The coordinator (this process) on all its own cores after the run (one step: it never moved, as its first
    # step moves nothing; the test below runs long enough to move it).
    assert sorted(os.sched_getaffinity(0)) == cores
    # More workers than cores: every worker may run anywhere, one thread each.
    rows = run_pipeline(str(ASSETS / "plain.py"), RunOptions(
        overrides={"steps": 1, "data.path": str(demo_data), "sections.head.dp": len(cores)}, pin_cpus=True,
        show_progress=False))
    assert as_set(rows[0]["sections"]["embed"]["stage"]["cpu_mask"]) == mine
    assert rows[0]["sections"]["embed"]["stage"]["threads"] == 1
    assert sorted(os.sched_getaffinity(0)) == cores


def test_the_busiest_sections_message_threads_move_to_the_spare_cores(demo_data):
    """The whole wiring of --pin-cpus: the coordinator chooses after each step (from step 1's busy
    times on), the plans made after it name the spare cores (io_cpus), and the busiest section's
    worker moves its ZeroMQ threads there; the other worker's stay on its own cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs at least 2 cores")
    rows = run_pipeline(str(ASSETS / "plain.py"), RunOptions(
        overrides={"steps": 5, "data.path": str(demo_data), "sections.head.dp": 1,
                   "sections.head.config.spin_s": 0.02}, pin_cpus=True, show_progress=False))
    embed = [r["sections"]["embed"]["stage"] for r in rows]
    head = [r["sections"]["head"]["stage"] for r in rows]
    # The choices that reach a plan (steps 3 and 4) are made after steps 1 and 2.
    assert all(r["sections"]["head"]["busy_s"] > 2 * r["sections"]["embed"]["busy_s"] for r in rows[1:3])
    assert all(e["io_mask"] == e["cpu_mask"] for e in embed)  # not the busiest: its own cores throughout
    # The choice is made after step 1 (whose stats are taken before it) and goes out in step 3's plan
    # (lookahead 1), which head may receive during step 2; steps 3 and 4 run with its threads moved.
    own = [h["io_mask"] == h["cpu_mask"] for h in head]
    assert own[:2] == [True, True] and own[3:] == [False, False], own
    assert [h["io_mask"] == e["cpu_mask"] for h, e in zip(head, embed, strict=True)][3:] == [True, True]
    assert sorted(os.sched_getaffinity(0)) == cores



def test_the_baseline_trains_a_stages_own_optimizer_groups(demo_data, tmp_path):
    """Found in review: the baseline trained every parameter of a stage that asks for optimizer
    groups (Stage.optimizer_groups) with the section's one spec: 4e-2 from section mode."""
    import torch
    from safetensors.torch import load_file

    saved = {}
    for mode, extra in (("colocated", {"colocated": True}), ("monolithic", {"baseline": "monolithic", "devices": 2})):
        rows = run_pipeline(str(ASSETS / "grouped.py"), RunOptions(overrides={"data.path": str(demo_data)},
                                                                   save_dir=str(tmp_path / mode), show_progress=False,
                                                                   **extra))
        saved[mode] = load_file(tmp_path / mode / "lm.safetensors")
        if mode == "colocated":  # each group's lr in the metrics (found in QA: only the first group's)
            lm = rows[0]["sections"]["lm"]
            assert lm["lr_groups"] == pytest.approx([lm["lr"], lm["lr"] * 0.1], rel=1e-12), lm
    for key, value in saved["colocated"].items():
        assert torch.allclose(value, saved["monolithic"][key], rtol=0, atol=1e-10), key
