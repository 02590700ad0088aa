"""Paths a command will write to, checked before any work: a run's `--save-dir`, checkpoint
folder, metrics file, trace, TensorBoard folder and run directory, `maestro profile --out`.

A path that cannot be written is refused at once naming the flag, rather than after hours of
training (an unwritable `--save-dir` failed once every step had run, losing the weights) or with a
Python traceback. What is checked: the path is not the wrong kind (a folder for a file, a file for
a folder), and its nearest existing folder is one this process may create entries in (a read-only
filesystem counts: access(2) answers EROFS). A disk that fills up later is not foreseen here; the
writers report that themselves.

`hold_folder` locks a folder a job writes for as long as it runs (the run directory, the
checkpoint directory): a second job given the same folder is refused rather than mixing its
files with the first's.
"""

from __future__ import annotations

import os
from typing import Any

from maestro_flow.errors import PipelineError


def check_writable(path: str, flag: str, *, folder: bool) -> None:
    """Refuse (PipelineError naming `flag`) a `path` this process cannot write: a file (`folder`
    False) or a folder to create files in (`folder` True)."""
    where = f"{flag} {path}"
    if os.path.isdir(path):
        if not folder:
            raise PipelineError(f"{where}: is a folder; give a file path")
        if not os.access(path, os.W_OK | os.X_OK):
            raise PipelineError(f"{where}: cannot write in this folder ({_why(path)})")
        return
    if os.path.exists(path):
        if folder:
            raise PipelineError(f"{where}: is a file, not a folder")
        if not os.access(path, os.W_OK):
            raise PipelineError(f"{where}: cannot write this file ({_why(path)})")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PipelineError(f"{where}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PipelineError(f"{where}: cannot create it in {parent} ({_why(parent)})")


def _why(path: str) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "read-only filesystem"
    except OSError:
        pass
    return "permission denied"


LOCK = ".lock"  # held (flock) by the job that uses the folder, for as long as it runs


def hold_folder(path: str, refusal: str, name: str = LOCK) -> Any:
    """Create `path` if need be and hold its lock (the file `name` there) until the returned file is closed (or the
    process ends: the kernel lets go). Raises PipelineError(`refusal`) when another process holds
    it; on a filesystem without locks, returns None and nothing is held."""
    import fcntl

    os.makedirs(path, exist_ok=True)
    lock = open(os.path.join(path, name), "a")  # noqa: SIM115 (held open by the caller)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise PipelineError(refusal) from None
    except OSError:
        lock.close()
        return None
    return lock
