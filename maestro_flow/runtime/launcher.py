"""Starting, watching and stopping worker processes.

Runs in the coordinator process. Workers start with multiprocessing's spawn (no inherited
locks or CUDA state); shutdown is idempotent and bounded: ask (done by the coordinator), wait a
grace period, terminate, join, kill. A worker that outlives its parent exits by itself
(see worker.die_with_parent), so nothing is left running when the coordinator dies. What a
stage started (a helper process, a data loader's workers) is stopped by its worker as it exits,
and, when a worker was killed by a signal, by `shutdown` here (runtime/reaper.py). A worker
takes MAESTRO_SECRET out of its environment first thing (found in review: every worker, and
whatever its stage started, inherited the user's secret; a worker gets the run's stretched
secret in its boot record). It does so itself: taking it out of this process's environment
while spawning would hide it from this process's other threads.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from maestro_flow.protocol.auth import SECRET_ENV
from maestro_flow.runtime.reaper import stop_adopted
from maestro_flow.runtime.stops import WORKERS_STARTED


def _spawned(entry: Callable[[dict[str, Any]], None], boot: dict[str, Any]) -> None:
    """A worker process's first code: the user's secret out of its environment, then `entry`."""
    os.environ.pop(SECRET_ENV, None)
    entry(boot)


@contextlib.contextmanager
def ctrl_c_ignored_by_children() -> Iterator[None]:
    """A process started inside inherits Ctrl-C ignored (a worker ignores it anyway: the
    coordinator stops the workers), so the terminal's Ctrl-C during its imports, a second or more,
    is not a KeyboardInterrupt traceback (found in QA: 50-90 lines of them). This thread keeps
    Ctrl-C meanwhile, blocked (Linux queues a blocked signal) and let through after; one that
    another thread of this process takes during the start (milliseconds) is lost."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # signal.signal works in the main thread only, and a handler set outside Python cannot be put back
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# A worker's own exit codes (runtime/worker.py), as exit_description names them.
NO_INIT_EXIT = 4  # the coordinator never sent its init (it reports the missing worker itself)
GAVE_UP_EXIT = 5  # nothing from the coordinator for MAESTRO_COORDINATOR_TIMEOUT_S: the worker took it as gone


@dataclass
class WorkerHandle:
    rank: int
    section: str
    replica: int
    process: Any

    @property
    def label(self) -> str:
        return f"section {self.section!r} replica {self.replica} (rank {self.rank}, pid {self.process.pid})"

    def exit_description(self) -> str | None:
        code = self.process.exitcode
        if code is None:
            return None
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        if code == GAVE_UP_EXIT:
            return f"exited with code {code} (it heard nothing from the coordinator for MAESTRO_COORDINATOR_TIMEOUT_S)"
        if code == NO_INIT_EXIT:
            return f"exited with code {code} (the coordinator sent it no init within MAESTRO_STARTUP_S)"
        return f"exited with code {code}"


def cause(dead: list[Any]) -> Any:
    """Of workers found dead together, the one to name (an agent's note, node 0's blame): one
    killed by a signal (the OOM killer, a kill) cannot have reported an error, and is no one's
    collateral, where one that exited with an error may have followed a peer's death (and node 0
    takes its report)."""
    return min(dead, key=blame_order)


def blame_order(w: WorkerHandle) -> tuple[bool, int]:
    # Not SIGABRT: what a collective's watchdog raises after a peer's death (found in review).
    return w.process.exitcode >= 0 or w.process.exitcode == -signal.SIGABRT, w.rank


class Launcher:
    def __init__(self, entry: Callable[[dict[str, Any]], None]) -> None:
        self.entry = entry  # worker.worker_main; tests pass an impostor to exercise the handshake
        self.workers: list[WorkerHandle] = []
        self._ctx = mp.get_context("spawn")

    def start(self, rank: int, section: str, replica: int, boot: dict[str, Any]) -> WorkerHandle:
        proc = self._ctx.Process(target=_spawned, args=(self.entry, boot), name=f"maestro-{section}-{replica}",
                                 daemon=True)
        with ctrl_c_ignored_by_children():
            proc.start()
        WORKERS_STARTED.set()
        handle = WorkerHandle(rank=rank, section=section, replica=replica, process=proc)
        self.workers.append(handle)
        return handle

    def dead(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.process.exitcode is not None]

    def join(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        return all(w.process.exitcode is not None for w in self.workers)

    def shutdown(self, grace_s: float, kill_grace_s: float) -> None:
        """Bounded and idempotent: join briefly, terminate, join, kill. Interrupted (a second
        Ctrl-C or SIGTERM), it kills what is left at once: found in QA, the interrupt skipped the
        kill, and workers outliving SIGTERM (--checkpoint-on-term) kept the exit waiting a minute."""
        try:
            if not self.join(grace_s):
                for w in self.workers:
                    if w.process.exitcode is None:
                        w.process.terminate()
                if not self.join(kill_grace_s):
                    _kill_all(self.workers)
                    self.join(kill_grace_s)
        except BaseException:
            _kill_all(self.workers)
            raise
        stop_adopted(keep=[w.process.pid for w in self.workers if w.process.exitcode is None])
        for w in self.workers:
            if w.process.exitcode is not None:
                w.process.close()
        self.workers = [w for w in self.workers if _alive(w)]


def _kill_all(workers: list[WorkerHandle]) -> None:
    for w in workers:
        if w.process.exitcode is None:
            w.process.kill()


def _alive(w: WorkerHandle) -> bool:
    try:
        return w.process.exitcode is None
    except ValueError:  # closed
        return False
