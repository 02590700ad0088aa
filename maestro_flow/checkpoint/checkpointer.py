"""The coordinator's side of checkpoints: when to save, the folder, the manifest, keep-last, failures.

Runs in the coordinator process; touches files, never tensors (workers write those). The
coordinator calls it, it does not contain it:

    checkpointer.plan_limit(completed)  plans may go out only for steps below this, so that at a
                                        checkpoint boundary no sample is in flight
    checkpointer.due(completed, total)  a checkpoint is owed after `completed` steps (every N, and the last)
    checkpointer.begin(step)            create step-<N>/ (an unwritable folder fails here)
    checkpointer.commit(step, manifest) every worker saved: write the manifest last, drop old ones
    checkpointer.failed(step, errors)   a worker could not save: delete the partial folder, then
                                        raise CheckpointError, or warn and go on with
                                        `on_error="continue"` (begin and commit fail the same way)
    checkpointer.take_term()            SIGTERM with --checkpoint-on-term: finish the planned steps,
                                        save them, stop (the coordinator reads term_asked)
    checkpointer.committed              the newest checkpoint this job wrote: where a restart
                                        resumes (never a folder another run left in the directory)
    checkpointer.unsaved                the step of the newest checkpoint when it failed (and the
                                        run went on): after the last step, its state is in none

Before any of these, `claim` takes the directory for the job (its lock, held until `close`) and
refuses one that holds another training's checkpoints, or this training's past its start.

One Checkpointer serves a whole job, across automatic restarts. Once the job stops or fails,
`go_on_note()` says where its training can go on from (the CLI's last line).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from maestro_flow.checkpoint import manifest as mf
from maestro_flow.errors import CheckpointError, PipelineError
from maestro_flow.runtime.outputs import CKPT_LOCK, hold_folder

ON_ERROR = ("stop", "continue")
LEGACY = "legacy"  # the lineage of a training whose first checkpoints were written without one
_UNREADABLE = object()  # a complete checkpoint whose manifest cannot be read: never resumed from


_CLAIMED: Checkpointer | None = None  # the checkpointer of this process's job, once it claimed its folder


TERM_UNTAKEN = ("--checkpoint-on-term: the SIGTERM came while no training was under way (startup, a restart "
                "or the final save), so no checkpoint was written for it")


def go_on_note(failed: bool = False, term_untaken: bool = False) -> str | None:
    """For a `maestro run` that stopped or failed: where its training can go on from (Checkpointer.
    go_on_note), or None where this process claimed no checkpoint directory (refused before, or a
    node other than 0) or the directory cannot be read now. `term_untaken`: a SIGTERM under
    --checkpoint-on-term came before the run took SIGTERM its own way (its checks, its startup)."""
    if _CLAIMED is None:
        return TERM_UNTAKEN if term_untaken else None
    _CLAIMED.term_untaken |= term_untaken
    try:
        return _CLAIMED.go_on_note(failed)
    except OSError:  # an unreadable directory: the failure's own message stands (a manifest: _lineage)
        return None


def _lineage(folder: str) -> object:
    """A complete checkpoint's Manifest.lineage, or _UNREADABLE."""
    try:
        return mf.read(folder).lineage
    except PipelineError:
        return _UNREADABLE


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointOptions:
    dir: str | None = None  # where step-<N>/ folders go
    every: int | None = None  # save after every N steps
    keep_last: int | None = None  # keep the newest K complete checkpoints (None: all)
    on_error: str | None = None  # a failed save stops the run ("stop", the default: None), or ("continue") is
    # reported and skipped; None tells the default from a flag given (the baseline refuses either)
    resume: str | None = None  # a checkpoint folder, or a folder of them (the newest complete one)
    max_restarts: int = 0  # restarts from the newest checkpoint after a worker dies or hangs
    on_term: bool = False  # SIGTERM ends the run with a checkpoint of the steps under way (take_term)

    def validate(self) -> None:
        if self.every is not None and self.every < 1:
            raise PipelineError(f"--checkpoint-every must be a number of steps >= 1, got {self.every}")
        if self.every is not None and not self.dir:
            raise PipelineError("--checkpoint-every needs --checkpoint-dir (where the checkpoints go)")
        if self.dir is not None and self.every is None:
            raise PipelineError("--checkpoint-dir needs --checkpoint-every N (how often to save)")
        if self.keep_last is not None and not self.dir:
            raise PipelineError("--keep-last says how many of --checkpoint-dir's checkpoints to keep: give "
                                "--checkpoint-dir too")
        if self.keep_last is not None and self.keep_last < 1:
            raise PipelineError(f"--keep-last must be a count >= 1, got {self.keep_last}")
        if self.on_error is not None and self.on_error not in ON_ERROR:
            raise PipelineError(f"--checkpoint-errors must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")
        if self.on_error is not None and not self.dir:  # (it was taken in vain, without a word)
            raise PipelineError("--checkpoint-errors says what a failed save into --checkpoint-dir does: give "
                                "--checkpoint-dir too")
        if self.max_restarts < 0:
            raise PipelineError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.on_term and not self.enabled:
            raise PipelineError("--checkpoint-on-term saves into --checkpoint-dir: give --checkpoint-dir DIR and "
                                "--checkpoint-every N too")
        if self.resume is not None:
            mf.find_folder(self.resume, "--resume")  # a missing one is refused listing what there is

    @property
    def enabled(self) -> bool:
        return self.dir is not None and self.every is not None


class Checkpointer:
    def __init__(self, options: CheckpointOptions, *, log: Callable[[str], None] | None = None) -> None:
        global _CLAIMED
        _CLAIMED = None  # a new job: an earlier one's folder is not where this one goes on from
        self.options = options
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.committed: str | None = None
        self.unsaved: int | None = None  # the step of the newest checkpoint, if it failed (on_error "continue")
        self.on_event: Callable[[dict[str, Any]], None] = lambda event: None  # the run dir's events.jsonl
        self.lineage: str | None = None  # this job's training (Manifest.lineage): set by claim()
        self.resumed_from: str | None = None  # the checkpoint the job resumed from (go_on_note)
        self.steps: int | None = None  # the job's total steps: set by claim()
        self._legacy = False
        self._lock = None
        self.training = False  # the coordinator trains (steps under way can end with a checkpoint)
        self.term_asked = False  # a SIGTERM taken by take_term: save after the planned steps, then stop
        self.term_untaken = False  # a first SIGTERM under on_term with no training under way (go_on_note)
        # The index of the run's first step whose loss or gradient norm was not finite (RunReport.diverged_from)
        self.diverged_from: Callable[[], int | None] = lambda: None
        self._kept: str | None = None  # the checkpoint before it, which --keep-last keeps (_purge)

    def take_term(self) -> bool:
        """A SIGTERM under --checkpoint-on-term (a scheduler's preemption, with a grace period
        before SIGKILL): True where the run goes on, to finish the steps already planned, save
        them and stop (the coordinator reads `term_asked`); False where it stops at once: the
        option off, no training under way (startup, a restart), or a second SIGTERM."""
        if not (self.options.on_term and self.training) or self.term_asked:
            self.term_untaken = self.options.on_term and not self.term_asked
            return False
        self.term_asked = True
        return True

    def claim(self, resume: mf.Manifest | None, pipeline: dict[str, Any] | None = None) -> None:
        """Take the checkpoint directory for this job, before any worker starts: hold its lock
        (a second run given the same directory is refused: the two would replace and delete each
        other's checkpoints), and refuse it when it holds checkpoints this job must not touch:
        another training's (another lineage: --keep-last or a restart would delete or resume
        them), or this training's own past the step it resumes at (they would be overwritten).
        `pipeline` (to_dict()): another training's checkpoints are offered for --resume only
        where they fit it."""
        if not self.options.enabled:
            return
        root = self.options.dir
        # A training resumed from a checkpoint written before lineages keeps the lineage LEGACY, so
        # that its checkpoints without one stay its own at every later resume (found in review:
        # the second resume refused them).
        self.lineage = resume.lineage or LEGACY if resume is not None else uuid.uuid4().hex
        self._legacy = self.lineage == LEGACY
        self._lock = hold_folder(root, f"--checkpoint-dir {root} is in use by a run still going (it holds {CKPT_LOCK} "
                                       "there): give another --checkpoint-dir, or wait for it to end", CKPT_LOCK,
                                 flag="--checkpoint-dir")
        start = resume.step if resume is not None else 0
        for step, folder, ok in mf.checkpoints(root):
            lineage = _lineage(folder) if ok else _UNREADABLE
            if lineage is _UNREADABLE:  # never resumed from, never purged: not in the way
                continue
            if not self._ours(lineage):
                self.close()
                fits = pipeline is None or _fits(mf.latest(root), pipeline)  # --resume ROOT takes the newest
                how = f"resume from it with --resume {shlex.quote(root)}, or " if resume is None and fits else ""
                if not fits:  # found in review: --resume was offered, and then refused
                    folder = f"{folder}; this pipeline cannot resume from them"
                raise PipelineError(f"--checkpoint-dir {root} holds another training's checkpoints ({folder}): "
                                    f"{how}choose another --checkpoint-dir")
            if step > start:
                self.close()
                newest = [f for _, f, done in mf.checkpoints(root) if done][-1]
                raise PipelineError(f"--checkpoint-dir {root} holds this training's checkpoints past step {start} "
                                    f"(newest: {newest}), which this run would overwrite: resume from the newest "
                                    f"with --resume {shlex.quote(root)}, or to go back to step {start}, move the "
                                    "later ones away or choose another --checkpoint-dir")
        global _CLAIMED
        self.steps = (pipeline or {}).get("steps")
        _CLAIMED = self

    def go_on_note(self, failed: bool = False) -> str:
        """Where this training can go on from, once the run stopped or failed (found in QA: nothing
        said what was kept): the newest complete checkpoint of its own, and the --resume that takes
        it, or `maestro export` where it is after the last step (--resume would be refused); with
        none yet, the checkpoint the job resumed from, if any. `failed`: the run failed (not
        interrupted), so the --resume goes with "once the cause above is dealt with"."""
        note = self._where(", once the cause above is dealt with" if failed else "")
        if self.term_untaken:  # found in QA: a SIGTERM in a slow startup said "interrupted" alone
            return f"{TERM_UNTAKEN}\n{note}"
        return note

    def _where(self, cause: str) -> str:
        root = self.options.dir
        ours = [(step, f) for step, f, ok in mf.checkpoints(root) if ok and self._ours(_lineage(f))]
        if not ours:
            was = self.resumed_from  # found in review: a run resumed from elsewhere named no place to go on from
            return f"checkpoints: none complete in {root} yet" + (
                f"; the run resumed from {was} (--resume {shlex.quote(was)}{cause})" if was else "")
        step, newest = ours[-1]  # (the folder's step is its manifest's: step_dir)
        if self.steps is not None and step >= self.steps:  # the commands quoted for a shell (QA: a space broke them)
            return (f"checkpoints: the newest complete one, {newest}, is after the last step: `maestro export "
                    f"{shlex.quote(newest)} --section SECTION -o DIR` takes a section's weights from it")
        return (f"checkpoints: the newest complete one is {newest}; go on from it with the same command and "
                f"--resume {shlex.quote(root)}{cause}")

    def _ours(self, lineage: object) -> bool:
        """Whether a checkpoint of this lineage (_lineage) belongs to this job's training (an
        unreadable one does not: it is left alone)."""
        return lineage is not _UNREADABLE and (lineage == self.lineage or (lineage is None and self._legacy))

    def close(self) -> None:
        """Let go of the checkpoint directory's lock (the end of the job; the process's exit does too)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def due(self, completed: int, total: int | None = None) -> bool:
        """After every `every` steps, and after the last step (`total`), so that the state a run
        ends with can be resumed from, whatever its step count."""
        return self.options.enabled and completed > 0 and (completed % self.options.every == 0 or completed == total)

    def plan_limit(self, completed: int) -> int | None:
        """The first step whose plan must wait for the next checkpoint (None: no limit)."""
        if not self.options.enabled:
            return None
        every = self.options.every
        return (completed // every + 1) * every

    def begin(self, step: int) -> str | None:
        """The folder to save into; None when it cannot be made and the run goes on without it.
        Incomplete folders of earlier steps go first (found in QA: with --checkpoint-errors
        continue, every failed save's folder stayed until a save succeeded; a failed save's
        workers write on after it is discarded, and they are done by the next save)."""
        folder = mf.step_dir(self.options.dir, step)
        for s, earlier, ok in mf.checkpoints(self.options.dir):
            if not ok and s < step:  # by step, not by name (found in review: an unpadded name sorts apart)
                self._discard(earlier)
        try:
            if os.path.isdir(folder):  # an incomplete save of an earlier attempt, or this step again
                shutil.rmtree(folder)
            os.makedirs(os.path.join(folder, mf.RNG_DIR))
        except OSError as exc:
            self._fail(step, f"cannot create {folder}: {exc.strerror or exc}", prefix=f"checkpoint at step {step}: ")
            return None
        return folder

    def commit(self, step: int, manifest: mf.Manifest) -> bool:
        folder = mf.step_dir(self.options.dir, step)
        try:
            mf.write(folder, dataclasses.replace(manifest, lineage=self.lineage))
        except OSError as exc:
            self._discard(folder)
            self._fail(step, f"writing the manifest failed: {exc}")
            return False
        self.committed = folder
        self.unsaved = None
        self.on_event({"checkpoint": os.path.abspath(folder), "step": step})  # (read from elsewhere: rundir)
        self._purge(step)
        return True

    def failed(self, step: int, errors: dict[str, str]) -> None:
        """`errors`: who -> one line on why (and where its traceback is)."""
        self._discard(mf.step_dir(self.options.dir, step))
        lines = {}
        for who, text in errors.items():
            lines.setdefault(text, []).append(who)
        detail = "; ".join(f"{', '.join(whos)}: {text}" for text, whos in lines.items())
        self._fail(step, detail)

    def _fail(self, step: int, detail: str, prefix: str | None = None) -> None:
        text = f"{prefix or f'checkpoint at step {step} failed: '}{detail}{self.previous()}"
        self.on_event({"checkpoint_failed": text, "step": step})
        if self.options.on_error == "continue":
            self.log(f"warning: {text}; training goes on (--checkpoint-errors continue)")
            self.unsaved = step
            return
        raise CheckpointError(text + "; the run stopped (--checkpoint-errors continue would train on without it)")

    def unsaved_note(self) -> str:
        return (f"the checkpoint after the last step (step {self.unsaved}) failed, so the run's final state is in "
                f"no checkpoint{self.previous()}")

    def final_state_lost(self, save_dir: str | None) -> str | None:
        """Why the run fails though it trained every step: the checkpoint after its last step failed
        (--checkpoint-errors continue) and no --save-dir holds the weights (found in review: exit 0)."""
        if self.unsaved is None or save_dir:
            return None
        return (f"{self.unsaved_note()}, and without --save-dir nothing holds the trained weights "
                "(--checkpoint-errors continue trained on)")

    def previous(self) -> str:
        """'; the newest complete checkpoint is ...' (or that none exists yet), for a message."""
        newest = mf.latest(self.options.dir) if self.options.dir else None
        return f"; the newest complete checkpoint is {newest}" if newest else "; no complete checkpoint exists yet"

    def _discard(self, folder: str) -> None:
        # The manifest first: a process stopped while the rest goes leaves an incomplete folder
        # (never resumed from), not a "complete" one missing its data.
        try:
            os.remove(os.path.join(folder, mf.MANIFEST))
        except OSError:
            pass
        shutil.rmtree(folder, ignore_errors=True)

    def _purge(self, step: int) -> None:
        """Incomplete folders older than this checkpoint, and complete ones of this training beyond
        keep_last (among those up to this one: a folder of a later step is never touched), except
        the newest one from before the run's first step whose loss or gradient norm was not finite
        (found in QA: one NaN step, the run training on, and --keep-last deleted every checkpoint
        whose weights were not NaN)."""
        found = [c for c in mf.checkpoints(self.options.dir) if c[0] <= step]
        complete = [(s, folder) for s, folder, ok in found if ok and self._ours(_lineage(folder))]
        stale = [folder for s, folder, ok in found if not ok and s < step]
        if self.options.keep_last is not None:
            bad = self.diverged_from()  # a checkpoint at step s holds the weights before step index s
            good = [folder for s, folder in complete if bad is not None and s <= bad][-1:]
            beyond = [folder for _, folder in complete[:-self.options.keep_last]]
            stale += [folder for folder in beyond if folder not in good]
            if good and good[0] in beyond and self._kept != good[0]:
                self._kept = good[0]
                self.log(f"maestro: --keep-last keeps {good[0]} too: the newest checkpoint from before step "
                         f"{bad + 1}, whose loss or gradient norm was not finite")
        for folder in stale:
            self._discard(folder)


def _fits(folder: str | None, pipeline: dict[str, Any]) -> bool:
    """Whether `folder`'s checkpoint can resume `pipeline` (a damaged one cannot)."""
    try:
        return folder is not None and not mf.incompatibilities(mf.read(folder), pipeline)
    except PipelineError:
        return False


def resume_point(path: str) -> tuple[str, mf.Manifest]:
    """The checkpoint `--resume PATH` means (PATH itself or its newest complete one; ckpt/step-2 for
    ckpt/step-00000002) and its manifest."""
    path = mf.find_folder(path, "--resume")
    folder = mf.latest(path)
    if folder is None:
        incomplete = [f for _, f, ok in mf.checkpoints(path) if not ok]
        hint = f" ({len(incomplete)} incomplete: interrupted or failed saves)" if incomplete else ""
        if os.path.isfile(os.path.join(path, "pipeline.json")) and any(
                n.endswith(".safetensors") for n in os.listdir(path)):  # found in QA: no word of what it is
            hint += (": it is a --save-dir (the trained sections' weights, without the optimizer's state or the "
                     "data's position); resume from a --checkpoint-dir, or start a run from these weights")
        from maestro_flow.runtime.rundir import checkpoints_note

        raise PipelineError(f"--resume {path}: no complete checkpoint there{hint}{checkpoints_note(path)}")
    return folder, mf.read(folder)
