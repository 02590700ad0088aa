"""What a stage started ends with its worker, even a worker killed by a signal.

A worker that exits stops what is left of its children itself (`stop_children`, called by
worker.worker_main). A worker killed by a signal (SIGKILL, SIGSEGV, the OOM killer) runs no code:
its children used to be orphaned to init and outlive the run, holding a port, a file or a GPU's
memory. The `maestro run` process is therefore a child subreaper (Linux's
PR_SET_CHILD_SUBREAPER, `subreaper`, for the run): such orphans, and a helper that detached itself with
a double fork, become its children, and the launcher stops them once its workers are gone
(`stop_adopted`). Only a process that asked to be a subreaper stops anything it did not start:
a program that runs pipelines through the Python API keeps its own children. Linux's /proc and
prctl only; elsewhere these do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import time
from collections.abc import Iterable, Iterator

PR_SET_CHILD_SUBREAPER = 36
_known: set[int] | None = None  # this process's children when it became a subreaper; None: it is not one


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:  # gone meanwhile, or no /proc
        pass
    return found


def _kill_trees(roots: Iterable[int]) -> None:
    """SIGKILL each root and everything under it, parents before their children: none is left
    to start another."""
    todo, seen = list(roots), []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += children(pid)
    for pid in seen:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def stop_children() -> None:
    """SIGKILL every process this one started, and theirs, still running: what a stage started
    and did not stop (a helper process, a pool) ends with its worker."""
    _kill_trees(children(os.getpid()))


def _prctl(on: bool) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def subreaper() -> Iterator[bool]:
    """While in the block, orphaned descendants of this process become its children (see the
    module docstring); yields False where the system does not offer it. On leaving, the process
    is as it was (found in review: a process that ran `maestro run` through click's test runner
    stayed a subreaper, and a later run stopped children it had not started)."""
    global _known
    on = _prctl(True)
    if on:
        _known = set(children(os.getpid()))
    try:
        yield on
    finally:
        if on:
            _known = None
            _prctl(False)


def stop_adopted(keep: Iterable[int] = (), timeout_s: float = 2.0) -> list[int]:
    """SIGKILL and reap the processes this subreaper adopted (every child that is not in `keep`,
    not one of its own multiprocessing children, and not one it had before becoming a subreaper),
    with everything under them. Returns their pids; [] when this process is not a subreaper."""
    if _known is None:
        return []
    mine = set(keep) | _known | {p.pid for p in multiprocessing.active_children()}
    tracker = getattr(getattr(multiprocessing, "resource_tracker", None), "_resource_tracker", None)
    if getattr(tracker, "_pid", None):
        mine.add(tracker._pid)
    stopped: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # A killed parent's own children come to this process in turn: looked for again.
        adopted = [pid for pid in children(os.getpid()) if pid not in mine]
        if not adopted:
            break
        _kill_trees(adopted)
        for pid in adopted:
            if pid not in stopped:
                stopped.append(pid)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.01)
    return stopped
