"""What a run shows and writes: the progress line, the metrics JSON Lines, the final summary.

Runs in the coordinator process. A progress bar redraws in place on a terminal; elsewhere
(CI, pipes) a plain line is printed every few steps. Writes to stderr so stdout stays clean.
Rows also go to any sinks given (e.g. runtime/tensorboard.py). A metrics file is strict JSON Lines
(NaN and inf written null), written whole lines at a time, and locked while the run writes it
(another run given it is refused). One that cannot be written (full disk) is reported once and
dropped, training goes on (runtime/guard.py), and the summary says from which step. The first
step whose loss or gradient norm is NaN or inf is warned about at once, with or without progress
output, and the summary says from which step. A resumed run goes on with its metrics files (the
rows of the steps before the checkpoint kept) instead of starting them again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from maestro_flow.errors import Diverged, PipelineError
from maestro_flow.runtime.guard import WriteGuard
from maestro_flow.wording import count

GRADLESS_STEPS = 2  # steps running with samples and an all-zero gradient before a trainable section is warned of


def json_line(row: dict[str, Any]) -> bytes:
    """A metrics row as one line of strict JSON: a NaN or inf (a diverged loss) is written null
    (found in QA: json.dumps wrote NaN, which JSON parsers other than Python's refuse)."""
    def finite(v: Any) -> Any:
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return (json.dumps(finite(row), allow_nan=False) + "\n").encode()


def _write_line(f: Any, line: bytes) -> None:
    """Append one whole line, or nothing (found in QA: a full disk left half a row, which the next
    row then followed on the same line): what a failed write left of it is cut off again."""
    st = os.fstat(f.fileno())
    end = st.st_size if stat.S_ISREG(st.st_mode) else None
    try:
        view = memoryview(line)
        while view:
            view = view[f.write(view):]
    except OSError:
        if end is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), end)
        raise


def open_metrics(paths: Sequence[str]) -> list[tuple[str, Any]]:
    """Each metrics file (one file given under two names: once), unbuffered, for appending whole
    lines, and held with an exclusive lock while the run writes it: another run given the same
    file is refused (found in QA: two runs wrote one file, each row of either cut into the
    other's), before any of them is touched. Not a regular file (/dev/stdout, a pipe): as it is.
    `start` then empties them, or keeps the rows of a resumed run."""
    opened: list[tuple[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    try:
        for path in paths:
            if os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            f = open(path, "ab", buffering=0)  # noqa: SIM115 (closed by RunReport); not "w": the lock comes first
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) in seen:  # the run dir's metrics.jsonl as --metrics-out too, a hard link
                f.close()
                continue
            seen.add((st.st_dev, st.st_ino))
            held = _HELD.pop((st.st_dev, st.st_ino), None)
            if held is not None:  # locked by `hold` for this run: that file, its lock with it
                f.close()
                f = held
            opened.append((path, f))
            if held is None and stat.S_ISREG(st.st_mode) and not lock_file(f):
                raise PipelineError(f"--metrics-out {path}: another run is writing this file (give each run its own)")
    except BaseException:
        for _, f in opened:
            f.close()
        raise
    return opened


def lock_file(f: Any) -> bool:
    """Lock `f` for this run: False where another run holds it. A file system without locks
    (NFS without its lock daemon) is written unlocked, as before locks were taken."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


_HELD: dict[tuple[int, int], Any] = {}  # (dev, inode) -> a metrics file `hold` locked, until open_metrics takes it


def hold(path: str, flag: str = "--metrics-out") -> None:
    """Lock the output file at `path` (a metrics file, or `flag`'s), if there is one, for the run
    this process is setting up, before it sets anything up: refused (PipelineError naming `flag`)
    when another run writes it. The lock stays
    on until `open_metrics` takes this very file over (found in review: a probe that let go of it
    left a gap in which a second run moved the run dir's files aside before being refused), or
    `release_held` drops it with a run refused before (a trace's: `take_held`). A file not there
    yet is not created."""
    try:  # not opened unless a regular file: opening a FIFO waits for a reader, closing it ends the reader's input
        fd = os.open(path, os.O_WRONLY | os.O_APPEND) if stat.S_ISREG(os.stat(path).st_mode) else None
    except OSError:  # not there (check_writable has said whether it can be made)
        return
    if fd is None:
        return
    st = os.fstat(fd)
    f = open(fd, "ab", buffering=0)  # noqa: SIM115 (kept open: the lock goes with it)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in _HELD:
        f.close()
        return
    if not lock_file(f):
        f.close()
        raise PipelineError(f"{flag} {path}: another run is writing this file (give each run its own)")
    _HELD[(st.st_dev, st.st_ino)] = f


def take_held(f: Any) -> Any | None:
    """The file `hold` locked that the open file `f` is (the same device and inode), taken over:
    the caller keeps it open while it writes `f`, so that its lock stays on; None when none is."""
    st = os.fstat(f.fileno())
    return _HELD.pop((st.st_dev, st.st_ino), None)


def release_held() -> None:
    """Unlock what `hold` locked and no run took over (the run was refused before its report)."""
    while _HELD:
        _HELD.popitem()[1].close()


def start(f: Any, path: str, resume_at: int | None) -> None:
    """Empty a locked metrics file for a fresh run, or keep the rows before `resume_at`, in place
    (the lock stays on the file)."""
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        return
    if resume_at is None:
        os.ftruncate(f.fileno(), 0)
        return
    try:
        with open(path, "rb") as old:
            whole = old.read()
    except OSError:  # not a metrics file this can read: appended to as it is
        return
    kept = _rows_before(whole, resume_at)
    if kept is None:
        return
    if whole.startswith(kept):  # the usual case, the rows after the checkpoint at the end: cut, nothing rewritten
        os.ftruncate(f.fileno(), len(kept))
    else:  # (a line that is not a row after them, kept)
        os.ftruncate(f.fileno(), 0)
        _write_line(f, kept)


def _rows_before(whole: bytes, step: int) -> bytes | None:
    """A metrics file's lines without the rows of `step` and later (lines that are not a row are
    kept), or None to leave it as it is (nothing to drop, or not text this can read)."""
    try:
        lines = whole.decode().splitlines(keepends=True)
    except UnicodeDecodeError:  # not a metrics file this can read: appended to as it is
        return None
    kept = []
    for line in lines:
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            row_step = None
        if not isinstance(row_step, int) or row_step < step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return "".join(kept).encode() if len(kept) != len(lines) else None


class RunReport:
    def __init__(self, *, total_steps: int, metrics_out: str | Sequence[str] | None, stream: TextIO | None = None,
                 show_progress: bool = True, sinks: Sequence[Any] = (), resume_at: int | None = None,
                 stop_on_nan: bool = False, batches_per_epoch: int | None = None) -> None:
        """`resume_at`: the step a resumed run starts at. Its metrics files then go on where the
        checkpoint left them: the rows of earlier steps are kept, those of this step and later
        (steps run after the checkpoint, before the run stopped) are replaced by the new ones.
        `stop_on_nan`: `step` raises Diverged on the first row whose loss or gradient norm is not
        finite (once it is written); without it the run is warned and goes on.
        `batches_per_epoch`: each row gets its `epoch` (from 0), and the progress line shows it
        when the run spans more than one (found in QA: the epoch was in no row and no line)."""
        self.total = total_steps
        self.per_epoch = batches_per_epoch
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.show = show_progress
        self.rows: list[dict[str, Any]] = []
        paths = [metrics_out] if isinstance(metrics_out, str) else list(metrics_out or ())
        self._metrics: list[tuple[Any, WriteGuard]] = []
        self._paths: list[str] = []
        self._sinks = list(sinks)  # objects with step(row) and close()
        self.lost: dict[str, tuple[int, str]] = {}  # "metrics to FILE" -> (first step not written, why)
        try:
            opened = open_metrics(paths)  # every one locked first: a refusal leaves all of them as they were
            self._metrics = [(f, WriteGuard(f"metrics to {path}")) for path, f in opened]
            self._paths = [path for path, _ in opened]
            for (path, f), (_, guard) in zip(opened, self._metrics, strict=True):
                guard(start, f, path, resume_at)
        except BaseException:
            self.close()
            raise
        self._t0 = time.monotonic()
        self.stop_on_nan = stop_on_nan
        self.non_finite: int | None = None  # the first step (its index) whose loss or gradient norm was NaN or inf
        self.diverged_from: int | None = None  # the same, known before that step's checkpoint (stops_at)
        self.gradless: dict[str, int] = {}  # trainable section -> steps running with samples and an all-zero gradient
        self.gradless_said: set[str] = set()  # sections warned of (once each)

    def step(self, row: dict[str, Any]) -> None:
        if self.rows and row["step"] <= self.rows[-1]["step"]:
            # An automatic restart went back to its checkpoint: the files drop their rows from this
            # step on, as --resume does (found in QA: they held those steps twice), and TensorBoard.
            for path, (f, guard) in zip(self._paths, self._metrics, strict=True):
                guard(start, f, path, row["step"])
        if self.per_epoch:
            row["epoch"] = row["step"] // self.per_epoch
        self.rows.append(row)
        line = json_line(row)
        for f, guard in self._metrics:
            if not guard(_write_line, f, line) and guard.what not in self.lost:
                self.lost[guard.what] = (row["step"], guard.failed or "?")
        for sink in self._sinks:
            sink.step(row)
        if self.non_finite is None and not _finite(row):
            # Said once, with or without progress output: the run goes on (the loss may recover, or
            # the user may want the steps after it), but nobody should learn it from the summary.
            self.non_finite = row["step"]
            self._newline()
            if self.stop_on_nan:
                raise Diverged(f"step {row['step'] + 1}: {_what_diverged(row)}; the run stopped "
                               "(--stop-on-nan) before writing any checkpoint or --save-dir of that step")
            self.stream.write(f"maestro: warning: step {row['step'] + 1}: {_what_diverged(row)} "
                              "(training diverged, or a stage computes NaN/inf); the run goes on (--stop-on-nan stops it)\n")
            self.stream.flush()
        self._warn_frozen_in_fact(row)
        if not self.show:
            return
        n = row["step"] + 1  # a resumed or restarted run starts (or goes back) to a later step
        loss = row["loss"]
        loss_s = (f"{loss:.4f}" if isinstance(loss, float)
                  else " ".join(f"{k}={v:.4f}" for k, v in (loss or {}).items()))
        if self.per_epoch and self.total > self.per_epoch:
            loss_s = f"{loss_s}  epoch {row['epoch'] + 1}/{-(-self.total // self.per_epoch)}"
        if self.tty:
            width = 24
            filled = int(width * n / max(self.total, 1))
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r[{bar}] step {n}/{self.total}  loss {loss_s}  {row['step_time_s']:.2f} s/step ")
            if n == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif len(self.rows) == 1 or n == self.total or n % max(1, self.total // 10) == 0:
            self.stream.write(f"step {n}/{self.total}  loss {loss_s}  {row['step_time_s']:.3f} s/step\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line on how the run goes outside its steps (node 0 waiting for another node to join),
        shown with or without --quiet, as a warning is: a run that stands still says why."""
        self._newline()
        self.stream.write(f"maestro: {text}\n")
        self.stream.flush()

    def stops_at(self, row: dict[str, Any]) -> bool:
        """Whether `step(row)` will stop the run (--stop-on-nan): its step's checkpoint is then not
        written, so the newest one comes from steps whose loss and gradient norm were finite. Called
        before the step's checkpoint; the first such step is noted (`diverged_from`)."""
        if self.diverged_from is None and not _finite(row):
            self.diverged_from = row["step"]
        return self.stop_on_nan and not _finite(row)

    def _warn_frozen_in_fact(self, row: dict[str, Any]) -> None:
        """Said once per section, with or without progress output, after GRADLESS_STEPS steps
        running in which it ran samples and its gradient was all zero (found in review: a distill
        teacher set trainable, whose student reads its outputs under no_grad, trained nothing,
        saved its unchanged weights, and nothing said so; one step alone can be all zero for a
        reason of its own, e.g. its only images skipped as corrupt)."""
        for name, sec in (row.get("sections") or {}).items():
            if "grad_norm" not in sec or not sec.get("samples") or name in self.gradless_said:
                continue  # not trainable, nothing run this step, or warned of already
            self.gradless[name] = self.gradless.get(name, 0) + 1 if sec["grad_norm"] == 0.0 else 0
            if self.gradless[name] == GRADLESS_STEPS:
                self.gradless_said.add(name)
                self._newline()
                loss = row.get("loss")
                losses = list(loss.values()) if isinstance(loss, dict) else [loss]
                why = ("the loss is exactly 0: do the samples hold anything to predict? A causal LM needs two tokens "
                       "or more a sample" if losses and all(v == 0.0 for v in losses)  # found in QA: rows of one token
                       else "the loss does not reach its parameters: does a consumer detach its outputs, or read "
                            "them under torch.no_grad?")
                self.stream.write(f"maestro: warning: step {row['step'] + 1}: section {name!r} is trainable but its "
                                  f"gradient has been all zero for {GRADLESS_STEPS} steps ({why}); its parameters "
                                  "do not change while it stays so\n")
                self.stream.flush()

    def summary(self) -> str:
        if not self.rows:
            return "no step completed"
        first, last = self.rows[0]["loss"], self.rows[-1]["loss"]
        times = sorted(r["step_time_s"] for r in self.rows)
        median = times[len(times) // 2]
        steps = len({r["step"] for r in self.rows})  # a step replayed after a restart counts once (found in QA)
        replayed = f" ({len(self.rows) - steps} replayed after restarts)" if len(self.rows) > steps else ""
        text = f"{count(steps, 'step')}{replayed} in {time.monotonic() - self._t0:.1f}s, median {median:.3f} s/step"
        if isinstance(first, float) and isinstance(last, float):
            text += f", loss {first:.4f} -> {last:.4f}"
        if self.non_finite is not None:
            text += f" (not finite from step {self.non_finite + 1})"
        counters = [f"{name} {key} {value:g}" for name, sec in (self.rows[-1].get("sections") or {}).items()
                    for key, value in (sec.get("stage") or {}).items() if value]  # Stage.stats: over the training
        if counters:  # found in QA: the corrupt images a run skipped were in its metrics only
            text += "\nstage counters: " + ", ".join(counters)  # (carried across restarts and resumes: ledger.py)
        for what, (step, why) in self.lost.items():  # found in QA: said once mid-run, then exit 0 as if whole
            text += f"\n{what}: stopped at step {step + 1} ({why}); the file lacks that step and the later ones"
        return text

    def _newline(self) -> None:
        """End the progress bar's line (a terminal), so a message does not overwrite it."""
        if self.tty and self.show and self.rows[:-1]:
            self.stream.write("\n")

    def table(self) -> str:
        """Each section's share of its replicas' time: computing, waiting, transferring.

        Transfers run on their own threads, overlapping compute and waits, so the three need
        not add up to 100%. The run's first step, and the first after each automatic restart, are
        not counted where others remain: they hold the workers' start (found in QA: an encoder's
        first step showed a 93%-busy LLM as 75% busy)."""
        if not self.rows:
            return ""
        rows = [r for before, r in zip(self.rows, self.rows[1:], strict=False)
                if r.get("restarts", 0) == before.get("restarts", 0)] or self.rows
        lines = [f"{'section':<12} {'busy':>7} {'waiting':>8} {'transfers':>10}"]
        for name in self.rows[0]["sections"]:
            busy = sum(r["sections"][name]["busy_s"] for r in rows)
            idle = sum(r["sections"][name]["idle_s"] for r in rows)
            comm = sum(r["sections"][name].get("comm_s", 0.0) for r in rows)
            total = max(busy + idle, 1e-12)
            lines.append(f"{name:<12} {busy / total:>7.1%} {idle / total:>8.1%} {comm / total:>10.1%}")
        if rows is not self.rows:
            lines.append(f"(over {len(rows)} of the {len(self.rows)} steps run: not counting the first after each start "
                         "of the workers)")
        return "\n".join(lines)

    def close(self) -> None:
        for f, guard in self._metrics:
            guard.close(f)
        self._metrics = []
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def _losses(row: dict[str, Any]) -> list[Any]:
    loss = row.get("loss")
    return list(loss.values()) if isinstance(loss, dict) else [loss]


def _finite(row: dict[str, Any]) -> bool:
    values = [*_losses(row), row.get("grad_norm")]
    return all(not isinstance(v, float) or math.isfinite(v) for v in values)


def _what_diverged(row: dict[str, Any]) -> str:
    bad = [f"loss {v}" for v in _losses(row) if isinstance(v, float) and not math.isfinite(v)]
    norm = row.get("grad_norm")
    if isinstance(norm, float) and not math.isfinite(norm):
        bad.append(f"gradient norm {norm}")
    return " and ".join(bad) + (" are not finite" if len(bad) > 1 else " is not finite")
