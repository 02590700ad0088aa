"""The failure matrix: every failure ends the run quickly, names where it happened, leaks nothing.

Each case runs the real CLI (`python -m maestro_flow.cli run ...`) on tests/integration/assets/
faulty.py, whose student stage fails on purpose as configured by --set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from maestro_flow.checkpoint.manifest import step_dir
from maestro_flow.transport.host import OWNER_SUFFIX, SHM_DIR, sweep_orphans
from tests.integration.conftest import ASSETS, ROOT, descendants, maestro, wait_gone, worker_pids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PIPELINE = str(ASSETS / "faulty.py")


def run_faulty(demo_data, *sets: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    args = ["run", PIPELINE, "--quiet", "--set", f"data.path={demo_data}"]
    for s in sets:
        args += ["--set", s]
    t0 = time.monotonic()
    result = maestro(*args, timeout=90, env={**os.environ, **(env or {})})
    return result, time.monotonic() - t0


def test_exception_in_setup(demo_data):
    result, elapsed = run_faulty(demo_data, "sections.student.config.fail=setup",
                                 "sections.student.config.on_replica=1")
    assert result.returncode == 1
    err = result.stderr
    assert "section 'student' replica 1" in err and "during setup" in err
    assert "deliberate failure while building the stage" in err
    assert "faulty_stages.py" in err  # the worker's own traceback, formatted where it was raised
    assert elapsed < 60


@pytest.mark.parametrize("sharding", [(), ("sections.student.fsdp=true",)], ids=["replicated", "lockstep-fsdp"])
def test_exception_in_forward_at_step_k(demo_data, sharding):
    """With FSDP in lockstep the other replica is inside a collective with the failed one: the
    run still stops at once, naming the replica that failed."""
    result, elapsed = run_faulty(demo_data, "sections.student.config.fail=forward",
                                 "sections.student.config.at_step=2", "sections.student.config.on_replica=1", *sharding)
    assert result.returncode == 1
    err = result.stderr
    assert "section 'student' replica 1" in err and "during forward at step 3" in err  # at_step 2, counted from 1
    assert "ValueError: deliberate failure in forward at step 2" in err
    assert "Traceback" in err and "faulty_stages.py" in err
    assert elapsed < 60


def test_worker_killed_mid_step(demo_data):
    result, elapsed = run_faulty(demo_data, "sections.student.config.fail=kill", "sections.student.config.at_step=1")
    assert result.returncode == 1
    err = result.stderr
    assert "section 'student' replica 0" in err and "was killed by SIGKILL" in err
    assert "while the run was at step" in err
    assert "Traceback" not in err  # a system error is one clear message
    assert elapsed < 60


def test_a_worker_hung_in_setup_is_named_with_the_whole_wait(demo_data):
    """Found in review: the startup timeout named no worker and reported the time since the last
    message (12.6 s of a 20 s limit), not the wait."""
    import re

    result, elapsed = run_faulty(demo_data, "sections.student.config.fail=setup_hang",
                                 "sections.student.config.on_replica=1", env={"MAESTRO_STARTUP_S": "15"})
    assert result.returncode == 1
    err = result.stderr
    assert "waiting for every worker to be ready" in err and "rank 2 (student-1)" in err, err
    waited = float(re.search(r"timed out after ([0-9.]+)s", err).group(1))
    assert 15.0 <= waited < 20.0, err
    assert elapsed < 60


def test_a_worker_that_exits_with_code_0_mid_step_is_the_one_named(demo_data):
    """Found in review: a worker gone with exit code 0 counted as one that had said bye, so the
    replica whose all-reduce it broke ("Connection reset by peer") was blamed instead."""
    result, elapsed = run_faulty(demo_data, "sections.student.config.fail=exit0", "sections.student.config.at_step=1",
                                 "sections.student.config.on_replica=1")
    assert result.returncode == 1
    err = result.stderr
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "section 'student' replica 1 (rank 2, pid" in line and "exited with code 0" in line, err
    assert elapsed < 60


def test_sys_exit_in_a_stage_is_the_stages_error(demo_data):
    """Found in review: SystemExit escaped the stage guard (an Exception handler), so the worker
    died with no traceback, or of SIGABRT in a native frame."""
    result, elapsed = run_faulty(demo_data, "sections.student.config.fail=sys_exit",
                                 "sections.student.config.at_step=1", "sections.student.config.on_replica=1")
    assert result.returncode == 1
    err = result.stderr
    assert "stage error in section 'student' replica 1 (rank 2) during forward at step 2" in err, err
    assert "SystemExit: 3" in err and "faulty_stages.py" in err, err
    assert elapsed < 60


def _sleeping(seconds: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"^sleep {seconds}$"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_what_a_stage_started_is_stopped_with_it_and_its_atexit_handlers_run(demo_data, tmp_path):
    """Found in review: a worker ends with os._exit, so the stage's atexit handlers never ran,
    and a helper process the stage started outlived the run, failed or not (orphaned to init).
    A worker now runs them, then stops what is left of its children, as it exits."""
    marks = tmp_path / "atexit.txt"
    result, _ = run_faulty(demo_data, "sections.student.config.helper_s=3001.25",
                           f"sections.student.config.atexit_file={marks}")
    assert result.returncode == 0, result.stderr
    assert sorted(marks.read_text().split()) == ["0", "1"]  # both student replicas ran theirs
    assert _sleeping("3001.25") == []
    result, _ = run_faulty(demo_data, "sections.student.config.helper_s=3002.5", "sections.student.config.fail=forward",
                           "sections.student.config.at_step=1")
    assert result.returncode == 1 and "deliberate failure in forward at step 1" in result.stderr
    assert _sleeping("3002.5") == []


def test_what_a_stage_started_is_stopped_when_its_worker_is_killed(demo_data):
    """A worker killed by a signal runs no code: the helper its stage started was orphaned to
    init and outlived the run. `maestro run` adopts such orphans (a child subreaper) and stops
    them with the run (runtime/reaper.py)."""
    result, _ = run_faulty(demo_data, "sections.student.config.helper_s=3003.75", "sections.student.config.fail=kill",
                           "sections.student.config.at_step=1")
    assert result.returncode == 1 and "was killed by SIGKILL" in result.stderr, result.stderr
    assert _sleeping("3003.75") == []


def test_a_crash_in_native_code_shows_the_python_stack(demo_data):
    """SIGSEGV: the run names the worker and the signal, and the worker's Python stack (every
    thread's, from faulthandler) reaches the terminal, down to the stage's line."""
    result, elapsed = run_faulty(demo_data, "sections.student.config.fail=segfault", "sections.student.config.at_step=1")
    assert result.returncode == 1
    err = result.stderr
    assert "section 'student' replica 0" in err and "was killed by SIGSEGV" in err
    assert "Fatal Python error: Segmentation fault" in err
    assert "faulty_stages.py" in err and "in forward" in err
    assert elapsed < 60


def test_hung_worker_hits_the_step_timeout(demo_data):
    result, _ = run_faulty(demo_data, "sections.student.config.fail=hang", "sections.student.config.at_step=1",
                           env={"MAESTRO_STEP_S": "5"})
    assert result.returncode == 1
    assert "timed out after" in result.stderr and "step 2 to finish" in result.stderr  # at_step 1: the second
    assert "MAESTRO_STEP_S" in result.stderr


def test_a_hung_replica_is_named_with_what_it_is_stuck_in(demo_data):
    # Reproduced before: the healthy peer was blamed, or no one, and only after 300-600 s,
    # although the heartbeats showed which replica was stuck in what.
    result, elapsed = run_faulty(demo_data, "sections.student.config.fail=hang", "sections.student.config.at_step=2",
                                 "sections.student.config.on_replica=1", env={"MAESTRO_HANG_S": "4"})
    assert result.returncode == 1
    err = result.stderr
    assert "section 'student' replica 1 (rank 2) is hung" in err, err
    assert "in forward of step 3" in err and "MAESTRO_HANG_S" in err  # at_step 2, counted from 1
    assert "replica 0 (rank 1) is hung" not in err
    assert elapsed < 45


def test_a_failed_save_dir_write_names_the_writer_not_a_worker_that_exited(demo_data, tmp_path):
    # Reproduced before: a worker that had exited normally was blamed for another worker's
    # failed --save-dir write (no space left).
    save = tmp_path / "save"
    (save / "student.safetensors").mkdir(parents=True)  # the student's file cannot be written
    args = ["run", PIPELINE, "--quiet", "--steps", "2", "--set", f"data.path={demo_data}", "--save-dir", str(save)]
    result = maestro(*args, timeout=90)
    assert result.returncode == 1
    err = result.stderr
    assert "section 'student' replica 0 (rank 1)" in err and "--save-dir" in err, err
    assert "teacher" not in err and "exited with code 0" not in err


def _start_slow_run(demo_data, *more: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "maestro_flow.cli", "run", PIPELINE, "--quiet", "--steps", "1000", "--no-run-dir",
         "--set", f"data.path={demo_data}", "--set", "sections.student.config.sleep_s=0.2", *more],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = worker_pids(proc.pid)
        if len(workers) == 3:
            time.sleep(3.0)  # let it train for a moment
            return proc, workers
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("workers did not start")



def test_a_run_whose_output_reader_goes_trains_on(demo_data, tmp_path):
    """Found in QA: `maestro run ... 2>&1 | head -3` stopped the run at the closed pipe (a tee or a
    log shipper that dies under a scheduler) and exited 0; it now trains on without its output."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", "run", "pipelines/distill.py", "--steps", "12",
                             "--set", f"data.path={demo_data}", "--set", "sections.student.dp=1", "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout.readline().startswith(b"distill: ")
        proc.stdout.close()  # as head does once it has its lines
        assert proc.wait(timeout=100) == 0
    finally:
        proc.kill()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 12
    assert json.loads((run_dir / "events.jsonl").read_text().splitlines()[-1])["ended"] == "done"


def test_a_run_started_with_stderr_closed_trains(demo_data, tmp_path):
    """Found in QA: `maestro run ... 2>&-` ended with exit 1 and no word (Python has no sys.stderr
    then, and the workers started with the descriptor closed)."""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "maestro_flow.cli", "run", "pipelines/distill.py", "--steps", "2",
                             "--set", f"data.path={demo_data}", "--set", "sections.student.dp=1", "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, preexec_fn=lambda: os.close(2),
                            timeout=100)
    assert result.returncode == 0
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def test_killing_the_coordinator_leaves_no_worker(demo_data):
    proc, workers = _start_slow_run(demo_data)
    everything = descendants(proc.pid)
    # The run's mark on this host's shared memory (transport/host.py), held by the coordinator.
    shm = os.access(SHM_DIR, os.W_OK)  # else no slots and no mark
    owners = [n for n in os.listdir(SHM_DIR) if n.endswith(f".{proc.pid}{OWNER_SUFFIX}")] if shm else []
    assert len(owners) == int(shm)
    session = owners[0][len("maestro-"):].split(".")[0] if shm else None
    proc.kill()
    proc.wait(10)
    assert not wait_gone(everything, 10.0), "workers outlived their coordinator"
    assert workers
    if shm:
        sweep_orphans()  # what the next run's start does: nothing of the killed run stays in memory
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"maestro-{session}")]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hangup"])
def test_ctrl_c_shuts_down_cleanly(demo_data, tmp_path, signum):
    """A closed terminal or ssh session (SIGHUP) stops the run as Ctrl-C does (found in review:
    it killed the coordinator outright, leaving its status file and shared-memory owner file).
    The last line says where to go on from (found in QA: nothing said what was kept)."""
    from maestro_flow.checkpoint import manifest as mf

    ck = tmp_path / "ck"
    proc, workers = _start_slow_run(demo_data, "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    everything = descendants(proc.pid)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    assert not wait_gone(everything, 10.0)
    newest = mf.latest(str(ck))
    assert err.strip().splitlines()[-1] == (f"checkpoints: the newest complete one is {newest}; go on from it with the "
                                            f"same command and --resume {ck}" if newest else
                                            f"checkpoints: none complete in {ck} yet"), err[-2000:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_in_the_first_second_is_an_interrupt(demo_data, signum):
    """Found in review: Ctrl-C while torch was being imported gave click's "Aborted!" (exit 1), or
    aborted the process (SIGABRT, a KeyboardInterrupt inside a pybind11 callback), whichever
    import it reached; found in QA: a SIGTERM in the first 2 s exited 143 and said nothing."""
    for delay in (0.3, 0.6, 0.9):
        proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", "run", PIPELINE, "--quiet", "--no-run-dir",
                                 "--set", f"data.path={demo_data}"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        everything = descendants(proc.pid)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (delay, err[-2000:])
        assert "interrupted" in err and "Aborted!" not in err, err
        assert not wait_gone(everything, 10.0)


def test_a_sigterm_ends_maestro_profile_and_its_worker_at_once(demo_data, tmp_path):
    """A SIGTERM to `maestro profile` alone (its worker gets none) ends both, as an interrupt: it
    exited 143 and left the worker running before the thirty-sixth session. Found in review: in
    some phases it took 3 s, the parent waiting for the worker, which is now killed at once (the
    phase is not reproduced here: the worker ended as quickly before that change)."""
    proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", "profile", PIPELINE, "--set",
                             f"data.path={demo_data}", "--calibrate-steps", "0", "--out", str(tmp_path / "c.json")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr.readline()  # the worker measures
        time.sleep(0.5)
        everything = descendants(proc.pid)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
        assert time.monotonic() - start < 1.5  # 0.4-0.5 s here
        assert everything and not wait_gone(everything, 5.0)
    finally:
        proc.kill()


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_ctrl_c_in_any_command_is_an_interrupt(demo_data, command):
    """Found in review: commands other than `run` ended a Ctrl-C with click's "Aborted!" (exit 1),
    at any time; during torch's import it may abort the process (cli_signals.py)."""
    for delay in (0.3, 0.9, 1.6):
        proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", command, PIPELINE,
                                 "--set", f"data.path={demo_data}"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        if proc.returncode in (0, -signal.SIGINT) and out:  # done before the signal came, or exiting (a fast hour)
            continue
        if proc.returncode == -signal.SIGINT and "maestro_flow/cli.py" not in err:
            continue  # a loaded host: the interpreter was still starting, before any of the command's code ran
        assert proc.returncode == 130, (delay, err[-2000:])
        assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_colocated_run_is_an_interrupt_not_a_stage_error(demo_data, signum):
    """Found in review of the SystemExit fix: with KeyboardInterrupt counted as the stage's
    error, Ctrl-C (or SIGTERM) during a --colocated run, whose stages run in the main process,
    was reported as a stage error in backward (exit 1)."""
    proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", "run", PIPELINE, "--colocated",
                             "--no-run-dir", "--steps", "1000", "--set", f"data.path={demo_data}",
                             "--set", "sections.student.config.sleep_s=0.05"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:  # found by a loaded host: a fixed 6 s wait signalled it before it had started
        for line in proc.stderr:
            lines.append(line)
            if "step 1/1000" in line:
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert training.wait(90), "".join(lines)[-2000:]
    proc.send_signal(signum)
    proc.wait(60)
    reader.join(10)
    err = "".join(lines)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "stage error" not in err, err


@pytest.mark.parametrize("colocated", [False, True], ids=["sections", "colocated"])
def test_stop_on_nan_stops_at_that_step_and_keeps_the_finite_checkpoint(demo_data, tmp_path, colocated):
    """--stop-on-nan: the run stops at the first NaN step (exit 1, named as the progress line
    counts), its row written, no checkpoint or --save-dir of it; the newest checkpoint is named."""
    ckpt, save, metrics = tmp_path / "ckpt", tmp_path / "save", tmp_path / "metrics.jsonl"
    args = ["run", PIPELINE, "--quiet", "--no-run-dir", "--stop-on-nan", "--set", f"data.path={demo_data}",
            "--set", "sections.student.config.fail=nan", "--set", "sections.student.config.at_step=2",
            "--save-dir", str(save), "--metrics-out", str(metrics)]
    args += ["--colocated"] if colocated else ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    result = maestro(*args, timeout=90)
    assert result.returncode == 1, result.stderr
    err = result.stderr
    assert "error: step 3: loss nan" in err and "gradient norm nan are not finite; the run stopped (--stop-on-nan)" in err, err
    assert "Traceback" not in err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["loss"] is None
    assert not (save / "student.safetensors").exists()
    if not colocated:
        assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".")) == [
            os.path.basename(step_dir(str(ckpt), s)) for s in (1, 2)]  # none of the NaN step
        assert f"the newest complete checkpoint is {step_dir(str(ckpt), 2)}" in err


def test_without_stop_on_nan_a_nan_run_is_warned_of_and_trains_on(demo_data, tmp_path):
    """And --keep-last keeps the newest checkpoint from before the NaN step (found in QA: it deleted
    every checkpoint whose weights were not NaN)."""
    ckpt = tmp_path / "ckpt"
    result = maestro("run", PIPELINE, "--quiet", "--no-run-dir", "--set", f"data.path={demo_data}",
                     "--set", "sections.student.config.fail=nan", "--set", "sections.student.config.at_step=2",
                     "--save-dir", str(tmp_path / "save"), "--steps", "5", "--checkpoint-dir", str(ckpt),
                     "--checkpoint-every", "1", "--keep-last", "1", timeout=90)
    assert result.returncode == 0, result.stderr
    assert "maestro: warning: step 3: loss nan" in result.stderr and "the run goes on" in result.stderr
    assert (tmp_path / "save" / "student.safetensors").exists()
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".")) == [
        os.path.basename(step_dir(str(ckpt), s)) for s in (2, 5)]
    assert f"--keep-last keeps {step_dir(str(ckpt), 2)} too: the newest checkpoint from before step 3" in result.stderr
