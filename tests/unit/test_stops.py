"""SIGTERM and SIGHUP in `maestro run` (runtime/stops.py): interrupts, or with
--checkpoint-on-term a first SIGTERM during training taken by the job's Checkpointer."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

from loaders.demo import build_text_demo
from maestro_flow import cli as cli_module
from maestro_flow.checkpoint.checkpointer import Checkpointer, CheckpointOptions
from maestro_flow.cli import main
from maestro_flow.errors import Terminated
from maestro_flow.runtime.stops import catch_stops, release


def checkpointer(tmp_path, on_term: bool) -> Checkpointer:
    return Checkpointer(CheckpointOptions(dir=str(tmp_path), every=4, on_term=on_term), log=lambda text: None)


@pytest.mark.parametrize("on_term, training", [(False, True), (True, False)], ids=["option off", "not training"])
def test_a_sigterm_is_an_interrupt_unless_taken(tmp_path, on_term, training):
    ck = checkpointer(tmp_path, on_term)
    ck.training = training
    previous = catch_stops(ck)
    try:
        with pytest.raises(Terminated):
            signal.raise_signal(signal.SIGTERM)
    finally:
        release(previous)
    assert not ck.term_asked


def test_the_first_sigterm_while_training_is_taken_the_second_stops_at_once(tmp_path):
    ck = checkpointer(tmp_path, True)
    ck.training = True
    previous = catch_stops(ck)
    try:
        signal.raise_signal(signal.SIGTERM)  # taken: the run goes on to save
        assert ck.term_asked
        with pytest.raises(Terminated):
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(Terminated):  # SIGHUP (a closed terminal) is never taken
            signal.raise_signal(signal.SIGHUP)
    finally:
        release(previous)
    assert signal.getsignal(signal.SIGTERM) is previous[signal.SIGTERM]


def test_checkpoint_on_term_is_refused_over_several_nodes(tmp_path):
    data = build_text_demo(tmp_path, num_samples=16, parquet=False)
    result = CliRunner().invoke(main, [
        "run", "pipelines/distill.py", "--no-run-dir", "--set", f"data.path={data}", "--nnodes", "2",
        "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1", "--checkpoint-dir", str(tmp_path / "ck"),
        "--checkpoint-every", "2", "--checkpoint-on-term"])
    assert result.exit_code == 2, result.output
    assert ("error: --checkpoint-on-term works on one node for now: with several, a SIGTERM to a node stops that "
            "node's workers, so the checkpoint could not be written; drop it") in result.stderr
    assert not (tmp_path / "ck").exists()


def test_a_worker_outlives_sigterm_and_the_processes_it_starts_do_not():
    """Under --checkpoint-on-term a worker takes SIGTERM and lets it be; a process its stage starts
    gets the default action back (found in review: with SIG_IGN, a stage's own terminate() of
    its helper did nothing)."""
    from maestro_flow.runtime.worker import _outlive_term

    previous = signal.signal(signal.SIGTERM, _outlive_term)
    try:
        signal.raise_signal(signal.SIGTERM)  # still here
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        child.terminate()
        assert child.wait(30) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_interrupt_that_cuts_a_failure_short_names_the_failure(monkeypatch):
    """Found in QA: a SIGTERM while the run stopped after a worker died said only "interrupted"."""
    from maestro_flow.errors import WorkerLost
    from maestro_flow.runtime import run as run_module

    def failing(path, options):
        try:
            raise WorkerLost("worker section 'student' replica 1 was killed by SIGKILL\ndetails")
        finally:
            raise Terminated

    monkeypatch.setattr(run_module, "run_pipeline", failing)
    started = threading.Event()
    started.set()  # (the workers had started: runtime/launcher.py)
    monkeypatch.setattr(cli_module, "WORKERS_STARTED", started)
    result = CliRunner().invoke(main, ["run", "pipelines/distill.py", "--no-run-dir"])
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[:2] == [
        "interrupted: workers stopped",
        "(while the run was stopping after: worker section 'student' replica 1 was killed by SIGKILL)"]


@pytest.mark.parametrize("sigterm", [False, True], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_before_any_worker_started_says_so(monkeypatch, tmp_path, sigterm):
    """Found in review: an interrupt at the run's checks (before it takes SIGTERM its own way)
    said "interrupted: workers stopped", though none had started; under --checkpoint-on-term a
    SIGTERM there said nothing of the checkpoint it did not write."""
    from maestro_flow import cli_signals
    from maestro_flow.checkpoint import checkpointer as checkpointer_module
    from maestro_flow.runtime import run as run_module

    def interrupted(path, options):
        raise Terminated if sigterm else KeyboardInterrupt

    terminated = threading.Event()
    if sigterm:
        terminated.set()  # what cli_signals.term_as_interrupt sets
    monkeypatch.setattr(run_module, "run_pipeline", interrupted)
    monkeypatch.setattr(cli_module, "WORKERS_STARTED", threading.Event())
    monkeypatch.setattr(cli_signals, "TERMINATED", terminated)
    monkeypatch.setattr(checkpointer_module, "_CLAIMED", None)  # (the checks come before the claim)
    result = CliRunner().invoke(main, ["run", "pipelines/distill.py", "--no-run-dir", "--checkpoint-dir",
                                       str(tmp_path / "ck"), "--checkpoint-on-term"])
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines() == ["interrupted"] + ([checkpointer_module.TERM_UNTAKEN] if sigterm else [])
