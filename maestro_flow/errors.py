"""The error types users see, and the one-line forms of an exception they quote. Pure (standard library only).

Two kinds of runtime failure are never mixed: a `StageError` is user code that raised (it carries
the section, replica, step and the traceback formatted as text in the process that raised it); a
`SystemFailure` is the runtime itself failing (a dead process, a closed channel, a protocol
mismatch, a timeout). `PipelineError` is bad input, found before any process starts (or, for a
checkpoint that does not fit the pipeline, when a worker first reads it). `CheckpointError` is a
checkpoint that could not be written; `Diverged` a run stopped by `--stop-on-nan`.
"""

from __future__ import annotations


class MaestroError(Exception):
    """Base class of every error maestro_flow raises on purpose."""


class PipelineError(MaestroError):
    """The pipeline, its data or its overrides are invalid; the message names the field to change."""


class StageError(MaestroError):
    """User stage code raised in a worker."""

    def __init__(self, *, section: str, replica: int, rank: int, step: int | None, phase: str,
                 traceback: str) -> None:
        self.section, self.replica, self.rank = section, replica, rank
        self.step, self.phase, self.traceback = step, phase, traceback
        where = f"section {section!r} replica {replica} (rank {rank})"
        # Counted from 1, as the progress line and every other message of a run count (found in QA:
        # "the run failed after step 4 ... at step 4" for the fifth step); `step` stays the index.
        when = f" at step {step + 1}" if step is not None else "" if phase == "setup" else " at setup"
        super().__init__(f"stage error in {where} during {phase}{when}:\n{traceback.rstrip()}")


class StageOutputError(MaestroError):
    """A stage's forward returned outputs that break the Stage contract (stage.output_problem),
    found where no run reports it as a StageError: `maestro stage` and `maestro profile`."""


class CheckpointError(MaestroError):
    """A checkpoint could not be written (full disk, unwritable folder); the previous one is intact.
    Not a SystemFailure: restarting would fail the same way."""


class Diverged(MaestroError):
    """A step's loss or gradient norm was NaN or inf and `--stop-on-nan` asked to stop there (no
    checkpoint of that step is written). Not a SystemFailure: restarting would diverge the same way."""


class SystemFailure(MaestroError):
    """The runtime failed (dead worker, timeout, protocol mismatch); the pipeline is dead."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP taken as an interrupt (a scheduler's preemption or eviction, a closed
    terminal), told apart from Ctrl-C where it matters (runtime/agent.py)."""


class WorkerLost(SystemFailure):
    """A worker died or went silent: what `--max-restarts` recovers from (with TimeoutFailure)."""


class TimeoutFailure(SystemFailure):
    """A bounded wait ran out; the message says what was awaited and which setting changes it."""

    def __init__(self, what: str, waited_s: float, setting: str) -> None:
        super().__init__(
            f"timed out after {waited_s:.1f}s waiting for {what} "
            f"(raise it with the environment variable {setting})"
        )


def exit_code_of(exc: BaseException) -> int:
    """maestro's exit code for a command ended by `exc`: 130 interrupted, 2 bad input (a
    PipelineError: the field to change), 1 anything else (a stage error, a failed run)."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 2 if isinstance(exc, PipelineError) else 1


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name where the message is blank: the
    one-line cause a wrapping error quotes."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip() if text else type(exc).__name__


def notes_of(exc: BaseException) -> list[str]:
    """The notes the runtime added to `exc` and to the errors it ended (`__context__`), oldest
    last: a second interrupt while the run stopped keeps the first one's notes (found in review)."""
    notes, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        notes += [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str) and n not in notes]
        exc = exc.__context__
    return notes


def brief(exc: BaseException) -> str:
    """'Type: first line of the message' (the type alone where the message is blank)."""
    return f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__


def traceback_tail(text: str) -> str:
    """A formatted traceback's exception in one line: the lines after its last frame (the
    exception's type and message, the message's further lines, its notes), joined with "; ".
    A frame is its '  File "..."' line and the indented source and caret lines under it; an
    indented line of the message itself is kept. Text that holds no frame: its last line."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return lines[-1].strip() if lines else ""
    rest = lines[frames[-1] + 1:]
    while rest and rest[0].startswith(" "):  # the frame's source line and its carets
        rest = rest[1:]
    return "; ".join(line.strip() for line in rest).removeprefix("maestro_flow.errors.")
