"""What `maestro tune`, `plan --trace-in`, `stage` and `profile` tell a user, each found by a QA
pass playing a new user (reproduced before each fix)."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

from click.testing import CliRunner

from maestro_flow.cli import main

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def _trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"id": i, **row}) + "\n" for i, row in enumerate(rows)))
    return path


def test_tune_searches_no_tensor_parallelism_on_the_cpu_unless_asked(tmp_path):
    """Before: `tune pipelines/multimodal.py --devices 4` ranked llm tp=2 first, predicted 0.7%
    faster; it ran about 4x slower than the shipped layout (gloo all-reduces on 2 cores). And its
    note listed tp 4 for a 2-device budget."""
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.tuning import TuneOptions, _tp_options, allowed_tp

    pipeline, _ = load_pipeline(str(ROOT / "pipelines" / "multimodal.py"), {})
    trace = _trace(tmp_path / "t.jsonl", [{"modalities": ["text"], "num_tokens": 20 + i} for i in range(32)])
    searched = _tp_options(pipeline, TuneOptions(overrides={}, devices=4), [])
    assert searched["llm"] == [1]  # sections on the CPU
    assert allowed_tp(pipeline, 8)["llm"][:2] == [1, 2]  # asked for with --max-tp
    assert allowed_tp(pipeline, 8, devices=2)["llm"] == [1, 2]
    result = invoke("tune", ROOT / "pipelines" / "multimodal.py", "--devices", 4, "--trace-in", trace, "--top", 1)
    assert result.exit_code == 0, result.output
    assert "tensor parallelism not searched for vision, audio, llm: on the CPU" in result.output
    assert "tp, fsdp" not in result.output  # no candidate with tp
    result = invoke("tune", ROOT / "pipelines" / "multimodal.py", "--devices", 3, "--trace-in", trace, "--top", 1,
                    "--max-tp", 8)
    assert "tensor parallelism searched:" in result.output and "/4" not in result.output, result.output


def test_tune_says_when_no_section_declares_a_cost(tmp_path):
    """Before: 'costs: the pipeline's Cost records' for chain.py, which declares none: every
    section was costed at the 1 ms default and micro-batch 1 was picked, slower than shipped."""
    trace = _trace(tmp_path / "t.jsonl", [{"modalities": ["text"], "num_tokens": 20 + i} for i in range(32)])
    result = invoke("tune", ROOT / "pipelines" / "chain.py", "--devices", 3, "--trace-in", trace, "--top", 1)
    assert result.exit_code == 0, result.output
    assert "costs: no section declares a Cost, so the defaults are used there (1 ms a sample" in result.output


def test_the_monolithic_baseline_is_compared_at_its_fastest_rank_count():
    """Before: the baseline was charged for every --devices, 4 ranks sharing the cores, so the
    same #1 was '1.42x' at --devices 2 and '1.78x' at --devices 4."""
    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner.cost import CostModel
    from maestro_flow.planner.monolithic import best_monolithic
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.samples import SampleMeta

    p, _ = load_pipeline(str(ROOT / "pipelines" / "chain.py"), {})
    graph, costs = SectionGraph(p), CostModel(costs={s.name: s.cost for s in p.sections})
    batch = [SampleMeta(id=i, row=i, modalities=frozenset({"text"}), num_tokens=10) for i in range(16)]
    at = {d: best_monolithic(graph, costs, [batch], devices=d, micro_batches=[1, 2, 4], cpu_cores=2,
                             step_s={"lm": 0.01, "embed": 0.01}).step_s for d in (1, 2, 4)}
    best = best_monolithic(graph, costs, [batch], devices=4, micro_batches=[1, 2, 4], cpu_cores=2,
                           step_s={"lm": 0.01, "embed": 0.01}, fewer=True)
    assert best.devices < 4 and best.step_s == min(at.values()) < at[4]


def test_stage_refuses_a_bad_config_in_one_line_as_validate_does():
    """Before: a traceback through the stage's constructor and exit 3 ('the stage raised'), where
    validate, plan and tune say it in one line with exit 2."""
    result = invoke("stage", ROOT / "pipelines" / "distill.py", "student", "--set",
                    "sections.student.config.student.d_model=63")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    # (the stage's check_config now refuses it before the build, as run does)
    assert "error: sections.student.config: student.d_model (63) must be divisible by student.n_heads (4)\n" \
           in result.output


def test_stage_holds_its_samples_to_its_own_limits_only(tmp_path):
    """The section's (and its upstream's) token limits on the samples it runs: one line, exit 2
    (before: the stage's own error, a traceback and exit 3). Not other sections' limits, nor the
    global batch (found in review of the first fix, which ran all of validate's checks)."""
    from loaders.demo import build_text_demo

    data = build_text_demo(tmp_path, num_samples=16, parquet=False)
    distill, short = ROOT / "pipelines" / "distill.py", "sections.student.config.student.max_seq_len=4"
    result = invoke("stage", distill, "student", "--set", f"data.path={data}", "--set", short, "--samples", 2)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "error: sections.student: sample id" in result.output and "(max_tokens 4, from its config)" in result.output
    for other in (short, "global_batch=100000", "sections.student.tp=3"):
        result = invoke("stage", distill, "teacher", "--set", f"data.path={data}", "--set", other, "--samples", 2)
        assert result.exit_code == 0, (other, result.output)


def test_a_trace_is_held_to_what_a_run_takes(tmp_path):
    """Before: an image without num_patches was planned as 0 patches, and a sample of 10 million
    tokens was planned (a 300 s step) where a run refuses it in one line."""
    vlm = ROOT / "pipelines" / "vlm.py"
    no_size = _trace(tmp_path / "a.jsonl", [{"modalities": ["text", "image"], "num_tokens": 30}])
    result = invoke("plan", vlm, "--trace-in", no_size)
    assert result.exit_code == 2 and "a.jsonl:1: not a sample metadata line (no num_patches)" in result.output
    null_size = _trace(tmp_path / "n.jsonl", [{"modalities": ["text", "image"], "num_tokens": 30, "num_patches": None}])
    result = invoke("plan", vlm, "--trace-in", null_size)  # found in review: null was read as 0
    assert result.exit_code == 2 and "n.jsonl:1: not a sample metadata line (no num_patches)" in result.output
    long = _trace(tmp_path / "b.jsonl", [{"modalities": ["text"], "num_tokens": 10_000_000}])
    for command in (["plan", vlm], ["tune", vlm, "--devices", 3]):
        result = invoke(*command, "--trace-in", long)
        assert result.exit_code == 2, result.output
        assert "b.jsonl: sections.llm: sample id 0 has 10000000 positions" in result.output
        assert "(max_seq_len 320, from its config)" in result.output


def test_ctrl_c_ends_the_profiling_worker_quietly(monkeypatch):
    """Before: Ctrl-C during profile's measurements printed the worker's KeyboardInterrupt
    traceback ('Process maestro-profile: Traceback ...') above 'interrupted'."""
    from maestro_flow.runtime import profiling, worker

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(profiling, "profile_to", interrupted)
    monkeypatch.setattr(worker, "die_with_parent", lambda pid: None)  # (not this test process: a watchdog)
    cores = os.sched_getaffinity(0)
    try:
        assert profiling._profile_worker("unused.py", None, types.SimpleNamespace(put=None), os.getppid()) is None
    finally:
        os.sched_setaffinity(0, cores)  # the worker pins itself to one core


def test_a_reader_that_has_read_enough_is_a_success(tmp_path):
    """`maestro plan ... | head`: the reader leaves before the output ends. Before, click's EPIPE
    handling exited 1 (at random, as the output's end raced the reader); now 0, as stage does."""
    import subprocess
    import sys

    trace = _trace(tmp_path / "t.jsonl", [{"modalities": ["text"], "num_tokens": 20 + i % 200} for i in range(2000)])
    proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", "plan", str(ROOT / "pipelines" / "vlm.py"),
                             "--trace-in", str(trace)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline()  # the plan of 2000 samples goes on for long after (6 of 6 exited 1 before)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0 and not err, err
    finally:
        proc.kill()


def test_plan_warns_as_validate_and_run_do(tmp_path):
    """Before: `plan --set sections.llm.dp=64` (global batch 24) printed 40 empty replicas
    without the warning validate and run give."""
    trace = _trace(tmp_path / "t.jsonl", [{"modalities": ["text"], "num_tokens": 20 + i} for i in range(24)])
    result = invoke("plan", ROOT / "pipelines" / "vlm.py", "--trace-in", trace, "--set", "sections.llm.dp=64")
    assert result.exit_code == 0, result.output
    assert "warning: sections.llm.dp=64 is more than global_batch=24" in result.stderr
