"""Automatic restart (`--max-restarts N`): the supervisor around one coordinator run.

Runs in the `maestro run` process. An attempt is one Coordinator run, which on any failure has
already stopped every worker (its close() is bounded). When the failure is a system failure — a
worker died, went silent (heartbeat timeout) or a step stopped making progress (step timeout) —
the supervisor starts a fresh attempt from the newest checkpoint this job wrote (else where the
job started: its --resume checkpoint or step 0), up to N times; each restart is logged with its
cause and counted in the metrics (`restarts`). Only those failures (WorkerLost, TimeoutFailure)
are retried: stage errors (user code raised), bad input, protocol mismatches, a worker's own
system-error report and failed checkpoint writes would fail the same way again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from maestro_flow.checkpoint import manifest as mf
from maestro_flow.errors import TimeoutFailure, WorkerLost, first_line

Resume = tuple[str, mf.Manifest] | None
Attempt = Callable[[Resume, int], None]  # (where to resume, restarts so far)


def supervise(attempt: Attempt, *, max_restarts: int, committed: Callable[[], str | None], resume: Resume,
              restarts: int, log: Callable[[str], None],
              on_restart: Callable[[dict[str, Any]], None] = lambda event: None,
              stopping: Callable[[], bool] = lambda: False) -> int:
    """Run `attempt` until it succeeds or fails for good; returns the restarts it took.
    `committed()`: the newest checkpoint this job has written (None: none yet); `stopping()`: the
    job was asked to stop (a SIGTERM --checkpoint-on-term took): a failure then is not restarted."""
    used = 0
    while True:
        try:
            attempt(resume, restarts)
            return used
        except (WorkerLost, TimeoutFailure) as exc:
            if stopping():  # found in review: restarted within the scheduler's grace period
                log(f"no restart: a SIGTERM asked the run to stop (--checkpoint-on-term): {first_line(exc)}")
                raise
            if used >= max_restarts:
                if max_restarts:  # found in QA: the last failure alone, as if no restart had been tried
                    log(f"no restart left (--max-restarts {max_restarts} used up): {first_line(exc)}")
                raise
            used += 1
            restarts += 1
            cause = first_line(exc)
            newest = committed()
            if newest is not None:
                resume = (newest, mf.read(newest))
            where = (f"the checkpoint {resume[0]} (after step {resume[1].step})" if resume
                     else "the start (no checkpoint yet)")
            log(f"restart {used}/{max_restarts}: {cause}; every worker was stopped; resuming from {where}")
            on_restart({"restart": used, "cause": cause, "resume": resume[0] if resume else None,
                        "step": resume[1].step if resume else 0})
