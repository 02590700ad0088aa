"""SIGTERM and SIGHUP in `maestro run`: an interrupt of the run, or with --checkpoint-on-term a
request to save the steps under way first.

SIGTERM (kill, a scheduler) and SIGHUP (the terminal or ssh session closed) stop the run as Ctrl-C
does: workers stopped, files closed (`Terminated`, a KeyboardInterrupt). A scheduler that preempts
a job sends SIGTERM, then SIGKILL after a grace period; with --checkpoint-on-term the first SIGTERM
during training is taken by the job's Checkpointer instead (`take_term`): the coordinator finishes
the steps it has planned (and plans no more), writes a checkpoint of the last one and then stops
the run as an interrupt; a failed worker is then not restarted (runtime/restart.py). The workers
let SIGTERM be under that option (runtime/worker.py), as a scheduler signals every process of the
job; the coordinator stops them, and they die with it.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from maestro_flow.errors import Terminated

# Set once this process started a worker (runtime/launcher.py): an interrupt before that stopped
# none, and `maestro run` says so (found in review: "interrupted: workers stopped" at the checks).
WORKERS_STARTED = threading.Event()


def catch_stops(checkpointer: Any = None) -> dict[int, Any]:
    """Take SIGTERM and SIGHUP as interrupts (a SIGHUP already ignored, as under nohup, stays
    ignored); a SIGTERM the checkpointer takes (`take_term`) lets the run go on to save. Returns
    the handlers to put back (`release`)."""

    def stop(signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and checkpointer is not None and checkpointer.take_term():
            return  # the coordinator saves the steps under way, then stops the run
        raise Terminated

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, stop)}
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, stop)
    return previous


def release(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
