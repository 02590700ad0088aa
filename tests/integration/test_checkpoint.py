"""Checkpoints, exact resume, automatic restart (the real CLI, real processes, real kills).

The job: pipelines/distill.py on 48 samples (3 steps per epoch of 16, so runs cross epoch
boundaries and reshuffles), the student with dropout 0.1 (its RNG state matters), plans that
depend on the data alone (adapt_costs=false: measured timings differ between runs). Its
checkpoint holds the student's parameters, AdamW state and lr schedule (DCP), every worker's
RNG states, the sampler position and the planner's cost model.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from maestro_flow.checkpoint import manifest as mf
from pipelines.distill import TEACHER
from tests.integration.conftest import ROOT, descendants, maestro, wait_gone, worker_pids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 10
COMMON = ("--quiet", "--no-run-dir", "--set", "adapt_costs=false", "--set", "sections.student.config.student.dropout=0.1",
          "--set", "sections.student.optimizer={\"name\": \"adamw\", \"lr\": 0.003, \"weight_decay\": 0.1, "
          "\"warmup_steps\": 2, \"decay\": \"cosine\", \"min_lr\": 0.0003}")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    from loaders.demo import build_text_demo

    return build_text_demo(tmp_path_factory.mktemp("ckpt-data"), num_samples=48, parquet=False)


def args(data: Path, dtype: str, *more: str, steps: int = STEPS) -> list[str]:
    return ["run", "pipelines/distill.py", *COMMON, "--steps", str(steps), "--set", f"data.path={data}",
            "--set", f"dtype={dtype}", *more]


def run_ok(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    result = maestro(*argv, timeout=180, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def params(save_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(save_dir / "student.safetensors")


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key}: max abs difference {(a[key] - b[key]).abs().max().item()}"


@pytest.fixture(scope="module")
def uninterrupted(small_data, tmp_path_factory):
    """dtype -> the final student parameters of an uninterrupted run (checkpointing as the others do)."""
    out = {}
    for dtype in ("float32", "float64"):
        base = tmp_path_factory.mktemp(f"straight-{dtype}")
        run_ok(*args(small_data, dtype, "--checkpoint-dir", str(base / "ck"), "--checkpoint-every", "2",
                     "--save-dir", str(base / "out")))
        out[dtype] = (params(base / "out"), base / "ck")
    return out




def _wait_for_checkpoint(root: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if mf.latest(str(root)) is not None:
            return
        assert proc.poll() is None, f"the run ended before its first checkpoint: {proc.communicate()[1][-2000:]}"
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("victim", ["coordinator", "worker"])
def test_sigkill_then_resume_is_bitwise_identical(small_data, uninterrupted, tmp_path, dtype, victim):
    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli",
                             *args(small_data, dtype, "--checkpoint-dir", str(ck), "--checkpoint-every", "2")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_checkpoint(ck, proc)
        time.sleep(random.Random(f"{dtype}-{victim}").uniform(0.0, 0.6))  # an arbitrary point, even mid-save
        everything = descendants(proc.pid)
        workers = worker_pids(proc.pid)
        assert proc.poll() is None and len(workers) == 3, "the run must still be going when it is killed"
        os.kill(proc.pid if victim == "coordinator" else workers[-1], signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = proc.communicate()[1]
    assert proc.returncode != 0
    if victim == "worker":
        assert "student" in stderr and "was killed by SIGKILL" in stderr
    assert not wait_gone(everything, 10.0), "processes outlived the killed run"
    newest = mf.latest(str(ck))
    assert newest is not None and mf.read(newest).step < STEPS
    if victim == "worker":  # found in QA: nothing said what was kept, or how to go on
        assert (f"checkpoints: the newest complete one is {newest}; go on from it with the same command and "
                f"--resume {ck}, once the cause above is dealt with") in stderr, stderr[-2000:]
    run_ok(*args(small_data, dtype, "--resume", str(ck), "--save-dir", str(tmp_path / "out")))
    assert_bitwise(params(tmp_path / "out"), uninterrupted[dtype][0])


def test_sigterm_with_checkpoint_on_term_saves_the_steps_under_way_then_resumes_bitwise(small_data, uninterrupted,
                                                                                       tmp_path):
    """--checkpoint-on-term: a scheduler's SIGTERM to every process of the job (its process group)
    is not a lost run: the planned steps finish, a checkpoint of them is written, the run stops
    (exit 130) naming it, no process is left, and resuming from it ends where an uninterrupted run
    ends."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli",
                             *args(small_data, "float64", "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
                                   "--checkpoint-on-term")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_checkpoint(ck, proc)
        everything = descendants(proc.pid)
        assert proc.poll() is None and len(worker_pids(proc.pid)) == 3, "the run must still be going"
        os.killpg(proc.pid, signal.SIGTERM)  # the coordinator and every worker, as a scheduler does
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        stderr = proc.communicate()[1]
    assert proc.returncode == 130, stderr[-3000:]
    assert not wait_gone(everything, 10.0), "processes outlived the run"
    newest = mf.latest(str(ck))
    step = mf.read(newest).step
    assert 3 < step < STEPS, (step, stderr[-2000:])  # after the SIGTERM, not a boundary of --checkpoint-every
    assert f"saving a checkpoint after step {step} (the last one planned), then stopping" in stderr, stderr[-2000:]
    assert f"checkpoints: the newest complete one is {newest}; go on from it with the same command and --resume {ck}" \
        in stderr, stderr[-2000:]
    run_ok(*args(small_data, "float64", "--resume", str(ck), "--save-dir", str(tmp_path / "out")))
    assert_bitwise(params(tmp_path / "out"), uninterrupted["float64"][0])


def test_the_summary_names_what_the_run_leaves(small_data, tmp_path):
    """Found in QA: the end of a run named neither its newest checkpoint nor its --save-dir files."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    result = run_ok("run", "pipelines/distill.py", "--no-run-dir", "--steps", "2", "--set", f"data.path={small_data}",
                    "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--save-dir", str(out))
    lines = result.stderr.strip().splitlines()
    assert lines[-2:] == [f"newest checkpoint: {ck / 'step-00000002'}",
                          f"weights: {out} (student.safetensors; `maestro export {out} --section S -o OUT` takes one "
                          "out)"], \
        result.stderr[-2000:]


def test_a_checkpoint_holds_the_promised_state(uninterrupted):
    root = uninterrupted["float64"][1]
    found = mf.checkpoints(str(root))
    assert [s for s, _, ok in found if ok] == [2, 4, 6, 8, 10]
    folder = mf.latest(str(root))
    manifest = mf.read(folder)
    assert manifest.step == 10
    for key in ("data_fingerprint", "data_sizes"):  # which samples: checked on resume
        fingerprint = manifest.sampler.pop(key)
        assert isinstance(fingerprint, str) and len(fingerprint) == 16
    assert manifest.sampler == {"step": 10, "epoch": 3, "batch_in_epoch": 1, "batches_per_epoch": 3,
                                "num_samples": 48, "global_batch": 16, "seed": 0, "shuffle": True}
    assert manifest.pipeline["name"] == "distill" and manifest.sections["student"]["dp"] == 2
    assert "model.tok_emb.weight" in manifest.sections["student"]["params"]
    assert sorted(os.listdir(os.path.join(folder, mf.RNG_DIR))) == ["student-0.pt", "student-1.pt", "teacher-0.pt"]
    assert os.path.isfile(os.path.join(folder, "student", ".metadata"))  # DCP, over the student's group
    assert not os.path.exists(os.path.join(folder, "teacher"))  # frozen: nothing to save but RNG


@pytest.mark.parametrize("student_dp", [1, 4])
def test_resume_with_another_dp_reshards(small_data, tmp_path, student_dp):
    """Saved with the student at dp 2, resumed at dp 1 or 4: within 1e-8 of the straight run."""
    straight = tmp_path / "straight"
    run_ok(*args(small_data, "float64", "--steps", "6", "--checkpoint-dir", str(straight / "ck"),
                 "--checkpoint-every", "3", "--save-dir", str(straight / "out"),
                 "--set", "sections.student.config.student.dropout=0.0"))
    resumed = tmp_path / "resumed"
    result = run_ok(*args(small_data, "float64", "--steps", "6", "--resume", str(straight / "ck" / "step-00000003"),
                          "--save-dir", str(resumed), "--set", f"sections.student.dp={student_dp}",
                          "--set", "sections.student.config.student.dropout=0.0"))
    # Its folder holds a later checkpoint (step 6), which the next run there would refuse to pass.
    assert ("warning: --resume without --checkpoint-dir: this run writes no checkpoints (to go on saving: "
            "--checkpoint-dir DIR (a folder without later checkpoints) --checkpoint-every N)") in result.stderr
    a, b = params(straight / "out"), params(resumed)
    for key in a:
        assert (a[key] - b[key]).abs().max().item() <= 1e-8, key


@pytest.fixture(scope="module")
def one_checkpoint(small_data, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("one") / "ck"
    run_ok(*args(small_data, "float32", "--checkpoint-dir", str(root), "--checkpoint-every", "2", steps=2))
    return root


@pytest.mark.parametrize("change, expected", [
    (("pipelines/chain.py",), ["the checkpoint has trainable section 'student', the pipeline does not",
                               "sections.embed: trainable here, but not in the checkpoint"]),
    (("--set", "sections.student.stage=stages.hf:HFCausalLM", "--set", "sections.student.config=" + json.dumps(
        {"role": "kd_student", "init_seed": 5, "teacher": TEACHER})),
     ["sections.student.stage: 'stages.hf:HFCausalLM' here, 'stages.distill:KDStudent' in the checkpoint"]),
    (("--set", "sections.student.config.student.d_model=32"),
     ["section 'student' (stages.distill:KDStudent) does not fit the checkpoint",
      "model.decoder.blocks.0.attn.qkv.bias is [192] in the checkpoint, [96] here",
      "29 parameters differ in shape in all"]),
    (("--set", "global_batch=8"), ["global_batch: 8 here, 16 in the checkpoint"]),
], ids=["other-sections", "other-stage-class", "other-shapes", "other-batch"])
def test_an_incompatible_checkpoint_is_refused(small_data, one_checkpoint, change, expected):
    if change[0].endswith(".py"):
        argv = ["run", change[0], "--quiet", "--no-run-dir", "--steps", "4", "--set", f"data.path={small_data}",
                "--set", "global_batch=16", "--resume", str(one_checkpoint)]
    else:
        argv = args(small_data, "float32", "--resume", str(one_checkpoint), *change, steps=4)
    result = maestro(*argv, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in result.stderr


def test_resume_needs_a_complete_checkpoint(small_data, tmp_path):
    (tmp_path / "ck" / "step-00000004" / "student").mkdir(parents=True)  # a save that never finished
    result = maestro(*args(small_data, "float32", "--resume", str(tmp_path / "ck")), timeout=60)
    assert result.returncode == 2
    assert "no complete checkpoint there (1 incomplete" in result.stderr


def test_an_unwritable_checkpoint_folder_stops_cleanly_and_keeps_the_previous(small_data, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step-00000004").write_text("a file where the folder must go")
    result = maestro(*args(small_data, "float32", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", steps=6),
                     timeout=120)
    assert result.returncode == 1
    assert "checkpoint at step 4: cannot create" in result.stderr
    assert f"the newest complete checkpoint is {ck / 'step-00000002'}" in result.stderr
    assert "Traceback" not in result.stderr
    assert mf.latest(str(ck)) == str(ck / "step-00000002")


def _limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("layout", [(), ("--set", "sections.student.tp=2")], ids=["replicated", "tp2"])
def test_a_failing_save_dir_write_names_the_last_step(small_data, tmp_path, layout):
    """Found in QA: a --save-dir that cannot be written said "at step 0" for a tensor-parallel
    (or FSDP) student, whose ranks had not moved their step on; the save follows the last step."""
    argv = [sys.executable, "-m", "maestro_flow.cli", *args(small_data, "float32", *layout, "--save-dir",
                                                           str(tmp_path / "save"), steps=3)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                            preexec_fn=_limit_file_size(20_000))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "during saving to --save-dir at step 3:" in result.stderr, result.stderr[-2000:]  # the last, from 1
    assert "File too large" in result.stderr


def test_a_failing_write_stops_cleanly_or_is_skipped_with_the_flag(small_data, tmp_path):
    """The OS refuses the write (RLIMIT_FSIZE: 'File too large', as a full disk refuses with
    ENOSPC): the error names the worker and the cause; the partial folder is removed."""
    ck = tmp_path / "ck"
    argv = [sys.executable, "-m", "maestro_flow.cli",
            *args(small_data, "float32", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", steps=4)]
    argv[argv.index("--no-run-dir")] = f"--run-dir={tmp_path / 'run'}"  # tracebacks go to its worker logs
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                            preexec_fn=_limit_file_size(200_000))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "checkpoint at step 2 failed: " in result.stderr
    assert "File too large" in result.stderr and "section 'student' replica 0" in result.stderr
    assert f"(traceback: {tmp_path / 'run' / 'workers' / 'student-0.log'})" in result.stderr
    assert "Traceback" in (tmp_path / "run" / "workers" / "student-0.log").read_text()
    assert "no complete checkpoint exists yet" in result.stderr
    assert "Traceback" not in result.stderr
    assert mf.checkpoints(str(ck)) == []
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e.get("step") for e in events] == [2, None] and "File too large" in events[0]["checkpoint_failed"]
    assert events[1]["ended"] == "failed" and "File too large" in events[1]["why"]  # what `maestro top` says
    assert events[1]["code"] == result.returncode  # and the code it exits with
    result = subprocess.run(argv + ["--checkpoint-errors", "continue"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, preexec_fn=_limit_file_size(200_000))
    assert result.stderr.count("warning: checkpoint at step") == 2  # steps 2 and 4, training went on
    # Found in review: exit 0 when the last one failed too, the final state in no checkpoint.
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.endswith("error: the checkpoint after the last step (step 4) failed, so the run's final state "
                                  "is in no checkpoint; no complete checkpoint exists yet, and without --save-dir "
                                  "nothing holds the trained weights (--checkpoint-errors continue trained on)\n")
    last = json.loads((tmp_path / "run" / "events.jsonl").read_text().splitlines()[-1])  # found in review: "done"
    assert last["ended"] == "failed" and last["why"].startswith("the checkpoint after the last step (step 4) failed")
    assert last["code"] == result.returncode
    # The weights saved (no file size limit: the checkpoints fail by their time limit instead): a warning.
    result = subprocess.run(argv + ["--checkpoint-errors", "continue", "--save-dir", str(tmp_path / "save")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MAESTRO_CHECKPOINT_S": "0.001"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.endswith(f"warning: the checkpoint after the last step (step 4) failed, so the run's final "
                                  f"state is in no checkpoint; no complete checkpoint exists yet; the trained weights "
                                  f"are in --save-dir {tmp_path / 'save'}\n")


def test_a_save_slower_than_its_limit_is_a_failed_checkpoint_not_a_restart(small_data, tmp_path):
    """Reproduced before: a save past MAESTRO_CHECKPOINT_S was taken for a hung worker, so each of
    --max-restarts retrained up to the checkpoint and timed out at the same save again."""
    ck = tmp_path / "ck"
    result = maestro(*args(small_data, "float32", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                           "--max-restarts", "2", steps=4), timeout=120,
                     env={**os.environ, "MAESTRO_CHECKPOINT_S": "0.01"})
    assert result.returncode == 1, result.stderr[-2000:]
    assert "checkpoint at step 2 failed: " in result.stderr and "did not finish saving within 0.01s" in result.stderr
    assert "MAESTRO_CHECKPOINT_S" in result.stderr and "restart" not in result.stderr
    # Workers still writing when it was given up may leave an incomplete folder: never resumed.
    assert mf.latest(str(ck)) is None and all(not complete for _, _, complete in mf.checkpoints(str(ck)))


def test_a_full_disk_keeps_the_previous_checkpoint(small_data, tmp_path):
    """A real ENOSPC: a tmpfs with room for one checkpoint but not two."""
    ck = tmp_path / "ck"
    ck.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3000k", "tmpfs", str(ck)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        result = maestro(*args(small_data, "float32", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                               steps=6), timeout=120)
        assert result.returncode == 1, result.stderr[-2000:]
        assert "checkpoint at step 4 failed" in result.stderr and "No space left on device" in result.stderr
        assert mf.latest(str(ck)) == str(ck / "step-00000002")
        assert [s for s, _, _ in mf.checkpoints(str(ck))] == [2]
        out = tmp_path / "out"
        run_ok(*args(small_data, "float32", "--resume", str(ck), "--save-dir", str(out), steps=6))
    finally:
        subprocess.run(["umount", str(ck)], capture_output=True)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_max_restarts_recovers_from_a_lost_or_hung_worker(small_data, uninterrupted, tmp_path, fault):
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    argv = args(small_data, "float32", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--max-restarts", "1",
                "--save-dir", str(tmp_path / "out"), "--metrics-out", str(tmp_path / "metrics.jsonl"))
    argv[argv.index("--no-run-dir")] = "--run-dir"
    argv.insert(argv.index("--run-dir") + 1, str(run_dir))
    proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MAESTRO_HEARTBEAT_TIMEOUT_S": "4"})
    try:
        _wait_for_checkpoint(ck, proc)
        victim = worker_pids(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "restart 1/1:" in stderr
    assert ("was killed by SIGKILL" if fault == "kill" else "heartbeat timeout") in stderr
    assert not wait_gone([victim], 10.0)
    assert_bitwise(params(tmp_path / "out"), uninterrupted["float32"][0])
    for metrics in (tmp_path / "metrics.jsonl", run_dir / "metrics.jsonl"):  # one row a step (found in QA: twice)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(STEPS)) and rows[-1]["restarts"] == 1
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    restarts = [e for e in events if "restart" in e]
    assert [e["restart"] for e in restarts] == [1] and restarts[0]["cause"]
    assert [e["step"] for e in events if "checkpoint" in e][-1] == STEPS  # the one after the last step


def test_an_unreadable_checkpoint_is_a_clear_error(small_data, one_checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(one_checkpoint, broken)
    data_file = next((broken / "step-00000002" / "student").glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated
    shutil.copytree(one_checkpoint / "step-00000002", broken / "step-00000001")  # an intact one before it
    result = maestro(*args(small_data, "float32", "--resume", str(broken), steps=4), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]  # refused by its checksums, before any worker starts
    assert (f"error: --resume {broken / 'step-00000002'}: 1 of its 6 files is not as saved (checksums in its "
            f"manifest): student/{data_file.name}: 100 bytes, ") in result.stderr, result.stderr[-2000:]
    assert f"the complete checkpoint before it: {broken / 'step-00000001'}" in result.stderr
    assert "workers" not in result.stderr
    # One written before checksums were kept: the workers' loader finds it (a clear error too).
    manifest = broken / "step-00000002" / "manifest.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "files"}))
    result = maestro(*args(small_data, "float32", "--resume", str(broken), steps=4), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot read the state of section 'student' ({data_file.parent}): " in result.stderr
    # Found in review: the detail was "EOFError: ", and nothing said where to go back to.
    assert "EOFError: a file ended early (truncated or damaged)" in result.stderr, result.stderr[-2000:]
    assert f"the complete checkpoint before it: {broken / 'step-00000001'}" in result.stderr
    assert "Traceback" not in result.stderr.split("error:")[-1]
    # Found in QA: a section folder without its DCP .metadata was said to be missing itself.
    (broken / "step-00000002" / "student" / ".metadata").unlink()
    result = maestro(*args(small_data, "float32", "--resume", str(broken / "step-00000002"), steps=4), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"holds no state for it ({broken / 'step-00000002' / 'student' / '.metadata'} is missing)" in result.stderr


def test_a_directory_of_another_run_is_refused(small_data, one_checkpoint):
    result = maestro(*args(small_data, "float32", "--checkpoint-dir", str(one_checkpoint), "--checkpoint-every", "2",
                           steps=4), timeout=60)
    assert result.returncode == 2
    assert f"holds another training's checkpoints ({one_checkpoint / 'step-00000002'}): resume from it" in result.stderr
