"""A worker started by the Launcher takes no Ctrl-C while its interpreter starts: the terminal's
SIGINT reaches the whole process group, and the coordinator stops the workers itself."""

from __future__ import annotations

import os
import signal
import time

import pytest

from maestro_flow.runtime.launcher import Launcher


def _write_done(boot: dict) -> None:
    with open(boot["path"], "w") as f:
        f.write("done")


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_workers_start_is_no_traceback(tmp_path):
    """Found in QA: Ctrl-C during the workers' start printed 50-90 lines of KeyboardInterrupt
    tracebacks from their imports (multiprocessing's spawn_main)."""
    before = signal.getsignal(signal.SIGINT)
    launcher = Launcher(_write_done)
    path = tmp_path / "done"
    handle = launcher.start(0, "s", 0, {"path": str(path)})
    for _ in range(5):  # while it imports
        time.sleep(0.05)
        if handle.process.exitcode is None:
            os.kill(handle.process.pid, signal.SIGINT)
    handle.process.join(30)
    assert handle.process.exitcode == 0 and path.read_text() == "done"
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # this process lets it through
    assert signal.getsignal(signal.SIGINT) is before


def _outlive_term_forever(boot: dict) -> None:
    from maestro_flow.runtime.worker import _outlive_term

    signal.signal(signal.SIGTERM, _outlive_term)  # as a worker under --checkpoint-on-term
    with open(boot["path"], "w") as f:
        f.write("ready")
    while True:
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_an_interrupted_shutdown_kills_the_workers_at_once(tmp_path, monkeypatch):
    """Found in QA: a SIGTERM during the shutdown's joins skipped the kill, and workers that
    outlive SIGTERM (--checkpoint-on-term) kept the run's exit waiting a minute."""
    launcher = Launcher(_outlive_term_forever)
    path = tmp_path / "ready"
    handle = launcher.start(0, "s", 0, {"path": str(path)})
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    joins = []

    def join(timeout_s: float) -> bool:  # the second join, after the terminate it outlives, is interrupted
        joins.append(timeout_s)
        if len(joins) == 2:
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(launcher, "join", join)
    with pytest.raises(KeyboardInterrupt):
        launcher.shutdown(0.1, 30.0)
    handle.process.join(10)
    assert handle.process.exitcode == -signal.SIGKILL
