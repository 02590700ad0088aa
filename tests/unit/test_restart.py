"""The restart supervisor (`--max-restarts`) and the one-line forms of an exception it and other
wrapping errors quote (errors.first_line, errors.brief)."""

from __future__ import annotations

import pytest

from maestro_flow.errors import PipelineError, TimeoutFailure, WorkerLost, brief, first_line
from maestro_flow.runtime.restart import supervise


def test_first_line_and_brief():
    assert first_line(ValueError("bad value\nmore detail")) == "bad value"
    assert first_line(ValueError("\n  \n")) == "ValueError"
    assert first_line(EOFError()) == "EOFError"
    assert brief(OSError("  disk full \nsecond")) == "OSError: disk full"
    assert brief(KeyError()) == "KeyError"


def _failing(errors):
    calls = []

    def attempt(resume, restarts):
        calls.append((resume, restarts))
        if errors:
            raise errors.pop(0)

    return attempt, calls


def test_system_failures_are_retried_and_logged_with_their_cause():
    attempt, calls = _failing([WorkerLost("worker 3 died\ntraceback..."), WorkerLost("")])
    logs, events = [], []
    used = supervise(attempt, max_restarts=2, committed=lambda: None, resume=None, restarts=0,
                     log=logs.append, on_restart=events.append)
    assert used == 2 and [c[1] for c in calls] == [0, 1, 2]
    # a blank message (it raised IndexError before) is named by its type
    assert logs == ["restart 1/2: worker 3 died; every worker was stopped; resuming from the start (no checkpoint yet)",
                    "restart 2/2: WorkerLost; every worker was stopped; resuming from the start (no checkpoint yet)"]
    assert [e["cause"] for e in events] == ["worker 3 died", "WorkerLost"]


def test_the_last_failure_is_raised_once_the_restarts_are_used_up():
    attempt, calls = _failing([TimeoutFailure("step 4", 1.0, "X"), TimeoutFailure("step 5", 1.0, "X")])
    logs = []
    with pytest.raises(TimeoutFailure, match="step 5"):
        supervise(attempt, max_restarts=1, committed=lambda: None, resume=None, restarts=0, log=logs.append)
    assert len(calls) == 2
    assert logs[-1].startswith("no restart left (--max-restarts 1 used up): ")


def test_bad_input_is_not_retried():
    attempt, calls = _failing([PipelineError("sections.student.dp: must be positive")])
    with pytest.raises(PipelineError):
        supervise(attempt, max_restarts=3, committed=lambda: None, resume=None, restarts=0, log=lambda _: None)
    assert len(calls) == 1


def test_a_failure_after_a_sigterm_taken_by_checkpoint_on_term_is_not_restarted():
    """Found in review: a worker lost after the SIGTERM was restarted within the scheduler's grace period."""
    attempt, calls = _failing([WorkerLost("worker 3 died")])
    logs = []
    with pytest.raises(WorkerLost):
        supervise(attempt, max_restarts=3, committed=lambda: None, resume=None, restarts=0, log=logs.append,
                  stopping=lambda: True)
    assert len(calls) == 1
    assert logs == ["no restart: a SIGTERM asked the run to stop (--checkpoint-on-term): worker 3 died"]
