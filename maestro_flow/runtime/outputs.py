"""Paths a command will write to, checked before any work: a run's `--save-dir`, checkpoint
folder, metrics file, trace, TensorBoard folder and run directory, `maestro profile --out`.

A path that cannot be written is refused at once naming the flag, rather than after hours of
training (an unwritable `--save-dir` failed once every step had run, losing the weights) or with a
Python traceback. What is checked: the path is not the wrong kind (a folder for a file, a file for
a folder), it is not a link to nothing (nor is a folder on the way to it), and its nearest
existing folder is one this process may create entries in (a read-only filesystem counts:
access(2) answers EROFS; and an entry is made there and removed, since access(2) lets root
everywhere). A disk that fills up later is not foreseen here; the writers report that themselves.

`hold_folder` locks a folder a job writes for as long as it runs (the run directory, the
checkpoint directory, the --save-dir): a second job given the same folder is refused rather than
mixing its files with the first's. `check_outputs` checks (and holds) every output of a run.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

from maestro_flow.checkpoint import manifest as mf
from maestro_flow.errors import PipelineError
from maestro_flow.runtime.report import hold, release_held


def check_save_dir(save_dir: str, checkpoint_dir: str | None, pipeline: Any) -> None:
    """A --save-dir is not the --checkpoint-dir and holds no checkpoints (found in QA: `maestro
    export` of such a folder took the older of the two, in silence), nor the weights of a section
    `pipeline` does not train (found in QA: another pipeline's files stayed beside this run's,
    under a pipeline.json that no longer described them)."""
    if checkpoint_dir and os.path.realpath(checkpoint_dir) == os.path.realpath(save_dir):
        raise PipelineError(f"--save-dir and --checkpoint-dir are one folder ({save_dir}): `maestro export` could "
                            "not tell the saved weights from the checkpoints; give --save-dir a folder of its own")
    held = mf.holds_checkpoints(save_dir)  # (a checkpoint itself, ckpt/step-2: found in review)
    if held:
        raise PipelineError(f"--save-dir {save_dir} {held}: `maestro export` could not tell the saved weights from "
                            "the checkpoints; give --save-dir a folder of its own")
    if not os.path.isdir(save_dir):
        return
    trained = sorted(s.name for s in pipeline.sections if s.trainable)
    loaded = {os.path.realpath(p) for s in pipeline.sections for p in _checkpoints(s.config)}  # a stage reads them
    others = sorted(n for n in os.listdir(save_dir) if n.endswith(".safetensors")
                    and n.removesuffix(".safetensors") not in trained
                    and os.path.realpath(os.path.join(save_dir, n)) not in loaded)
    if others:
        raise PipelineError(f"--save-dir {save_dir} holds {', '.join(others)}, which this run does not write (it "
                            f"trains {', '.join(trained) or 'nothing'}): its "
                            "pipeline.json would no longer describe them; give --save-dir a folder of its own, or "
                            "move them away")


def _checkpoints(config: Any) -> list[str]:
    """Every `checkpoint` path in a stage config, nested ones too (a KD student's teacher copy's)."""
    if isinstance(config, dict):
        own = [config["checkpoint"]] if isinstance(config.get("checkpoint"), str) else []
        return own + [p for v in config.values() for p in _checkpoints(v)]
    return [p for v in config for p in _checkpoints(v)] if isinstance(config, (list, tuple)) else []


def check_writable(path: str, flag: str, *, folder: bool) -> None:
    """Refuse (PipelineError naming `flag`) a `path` this process cannot write: a file (`folder`
    False) or a folder to create files in (`folder` True)."""
    where = f"{flag} {path}"
    path = path.rstrip(os.sep) or os.sep  # "link/" would follow the link (found in review: a broken one passed)
    path = _not_dangling(path, where, folder)
    if os.path.isdir(path):
        if not folder:
            raise PipelineError(f"{where}: is a folder; give a file path")
        if not os.access(path, os.W_OK | os.X_OK):
            raise PipelineError(f"{where}: cannot write in this folder ({_why(path)})")
        _probe(path, f"{where}: cannot write in this folder")
        return
    if os.path.exists(path):
        if folder:
            raise PipelineError(f"{where}: is a file, not a folder")
        if not os.access(path, os.W_OK):
            raise PipelineError(f"{where}: cannot write this file ({_why(path)})")
        return
    missing = os.path.abspath(path)  # the first entry a writer would create (QA: /proc/foo/m.jsonl named only /proc)
    parent = os.path.dirname(missing)
    while not os.path.exists(parent):
        _not_dangling(parent, where, True)
        missing, parent = parent, os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise PipelineError(f"{where}: {parent} is a file, not a folder")
    what = "it" if missing == os.path.abspath(path) else f"the folder {missing}"
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PipelineError(f"{where}: cannot create {what} in {parent} ({_why(parent)})")
    _probe(parent, f"{where}: cannot create {what} in {parent}")


def _not_dangling(path: str, where: str, folder: bool) -> str:
    """`path`, or where a link to a file not yet made leads (a writer creates it through the link,
    whose folder exists); refused: a link to nothing else (a scratch disk not mounted, a loop of
    links), which the writers would fail on after the work (found in review: --save-dir lost the
    trained weights with a FileExistsError traceback)."""
    if not os.path.islink(path) or os.path.exists(path):
        return path
    target = os.path.realpath(path)
    if not folder and not os.path.islink(target) and os.path.isdir(os.path.dirname(target)):
        return target
    raise PipelineError(f"{where}: {path} is a link that leads nowhere ({os.readlink(path)}: a disk not "
                        "mounted, or a loop of links?)")


def _probe(folder: str, refusal: str) -> None:
    """Create and remove an entry in `folder`: access(2) says yes to root everywhere, also where
    nothing can be created (/proc, /sys, an NFS export that squashes root; found in review: a
    traceback then)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".maestro-probe-", dir=folder))
    except OSError as exc:
        raise PipelineError(f"{refusal} ({exc.strerror or exc})") from None


def _why(path: str) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "read-only filesystem"
    except OSError:
        pass
    return "permission denied"


LOCK = ".lock"  # held (flock) by the job that uses the folder, for as long as it runs
# Each output's own lock file, not the run directory's: one folder may serve as two (found in review).
CKPT_LOCK = ".checkpoints.lock"  # a --checkpoint-dir's (Checkpointer.claim)
SAVE_LOCK = ".save.lock"  # a --save-dir's (hold_save_dir)
LOCKS = (LOCK, CKPT_LOCK, SAVE_LOCK)  # never moved aside (RunDir's set_aside: found in review)


def hold_folder(path: str, refusal: str, name: str = LOCK, flag: str = "") -> Any:
    """Create `path` if need be and hold its lock (the file `name` there) until the returned file is closed (or the
    process ends: the kernel lets go). Raises PipelineError(`refusal`) when another process holds
    it, and one naming `flag` when the folder or its lock cannot be made; on a filesystem without
    locks, returns None and nothing is held."""
    import fcntl

    try:
        os.makedirs(path, exist_ok=True)
        lock = open(os.path.join(path, name), "a")  # noqa: SIM115 (held open by the caller)
    except OSError as exc:
        raise PipelineError(f"{flag + ' ' if flag else ''}{path}: cannot create it or its lock file {name} "
                            f"({exc.strerror or exc})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise PipelineError(refusal) from None
    except OSError:
        lock.close()
        return None
    return lock


_SAVING: list[tuple[str, Any, str | None]] = []  # (folder, its lock, the outermost folder the run made or None)


def hold_save_dir(path: str) -> None:
    """Hold --save-dir `path` (made if need be) for this run until `release_save_dir`: a second
    run given the same folder is refused before it starts (found in QA: two runs into one folder
    both said they saved, and one's weights were lost, or another pipeline's stood beside them)."""
    made, parent = None, os.path.abspath(path)  # made: the outermost folder this run makes
    while not os.path.exists(parent):
        made, parent = parent, os.path.dirname(parent)
    lock = hold_folder(path, f"--save-dir {path} is in use by a run still going (it holds {SAVE_LOCK} there): give "
                             "each run a --save-dir of its own", SAVE_LOCK, "--save-dir")
    if lock is not None:
        _SAVING.append((os.path.abspath(path), lock, made))


def release_save_dir() -> None:
    """Let go of the --save-dir held; the folders this run made for it, left empty (the run was
    refused or failed before saving), are removed again."""
    while _SAVING:
        path, lock, made = _SAVING.pop()
        with contextlib.suppress(OSError):
            if made is not None and os.listdir(path) == [SAVE_LOCK]:
                os.remove(os.path.join(path, SAVE_LOCK))
                while True:  # up to the outermost one made, while empty (rmdir refuses one that is not)
                    os.rmdir(path)
                    if path == made:
                        break
                    path = os.path.dirname(path)
        lock.close()


def check_outputs(options: Any, pipeline: Any, trace: str | None) -> None:
    """Every path a run (RunOptions `options`; `trace`: where its trace goes) will write, checked
    before any worker starts; its --metrics-out file and --save-dir are held from here on, until
    the run takes them over or `release_outputs`."""
    for flag, path, folder in (("--save-dir", options.save_dir, True), ("--checkpoint-dir", options.checkpoint.dir, True),
                               ("--metrics-out", options.metrics_out, False), ("--trace", trace, False),
                               ("--tensorboard", options.tensorboard, True), ("--run-dir", options.run_dir, True)):
        if path:
            check_writable(path, flag, folder=folder)
    if trace and options.metrics_out and _same_file(trace, options.metrics_out):  # (found in review)
        raise PipelineError(f"--trace and --metrics-out name one file ({trace}): give each its own")
    if options.save_dir:
        check_save_dir(options.save_dir, options.checkpoint.dir, pipeline)
        hold_save_dir(options.save_dir)
    if options.metrics_out:  # found in review: refused after the run dir moved; locked until RunReport has it
        hold(options.metrics_out)
    if trace:  # the same (found in review: a busy --trace was refused after the run dir had moved files)
        hold(trace, "--trace")


def _same_file(a: str, b: str) -> bool:
    """One regular file (or one path not there yet); /dev/stdout or /dev/full may take both."""
    try:
        return os.path.samefile(a, b) and os.path.isfile(a)
    except OSError:  # one not there yet: the same path, then
        return os.path.realpath(a) == os.path.realpath(b)


def release_outputs() -> None:
    """Let go of what check_outputs held and no run has taken over."""
    release_held()
    release_save_dir()
