"""The run directory: everything one `maestro run` leaves behind, in one folder.

Runs in the coordinator process. Layout:
    pipeline.json        the resolved pipeline configuration (after --set overrides)
    metrics.jsonl        one JSON object per step (DESIGN 5.4)
    plans.jsonl          every step's plan (DESIGN 5.5 format, without "simulated": a run does not
                         simulate its plans; `maestro plan --step N` shows one with its simulation)
    workers/S-R.log      worker stdout/stderr, every line prefixed with [section/replica]
                         (S-R.T.log and [section/replica.T] for tensor-parallel rank T)
    events.jsonl         what happened to the run besides steps: automatic restarts (with cause),
                         checkpoints written or failed, and last {"ended": "done" | "failed" |
                         "interrupted", "why": ...} (none: its process was killed; `maestro top`)
    trace.json           the timeline, when `--trace` is given without a path of its own
    status.json          while the job runs: where `maestro top` finds it (runtime/status.py); removed
                         when the job is over, kept across its automatic restarts
    previous-N/          what an earlier run left in a reused --run-dir (moved aside, never lost)
    node-I/              node I's own run dir in a multi-node run (I > 0: its workers' logs and
                         its pipeline.json; the plans, metrics and events are node 0's), so
                         the same --run-dir on a filesystem the nodes share is one tree; node 0
                         leaves these alone (each node moves aside its own)
    .lock                locked (flock) by the job while it runs: a second run is refused the folder

Every run starts with its own empty run directory: a default one is created atomically (two runs
started in the same second get two), and a reused one has its earlier contents moved aside, unless
a run still going uses it (it holds the folder's .lock, or its status.json names a live process):
that is refused.
Writes here never take training down (runtime/guard.py).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from maestro_flow.checkpoint.manifest import STEP_DIR
from maestro_flow.config import Pipeline
from maestro_flow.errors import PipelineError
from maestro_flow.runtime import status
from maestro_flow.runtime.guard import WriteGuard
from maestro_flow.runtime.outputs import LOCK, LOCKS, hold_folder

RUNS = "runs"  # where default run directories go (runs/NAME-TIMESTAMP)


def default_run_dir(pipeline: Pipeline, root: str = RUNS,
                    instead: str = "pass --run-dir DIR somewhere writable, or --no-run-dir") -> str:
    """A new run directory, created here: mkdir either creates it or fails, so two runs started
    in the same second cannot both take one name. One that cannot be made is refused in a line
    ending with `instead` (found in QA: a read-only working folder ended in a traceback)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n = 1
    try:
        os.makedirs(root, exist_ok=True)
        while True:
            path = os.path.join(root, f"{pipeline.name}-{stamp}" + (f"-{n}" if n > 1 else ""))
            try:
                os.mkdir(path)
                return path
            except FileExistsError:
                n += 1
    except OSError as exc:
        raise PipelineError(f"{os.path.abspath(root)}: cannot create a run directory there "
                            f"({exc.strerror or exc}): {instead}") from None


NODE = re.compile(r"node-[1-9][0-9]*")  # another node's folder (node_run_dir)


def node_run_dir(run_dir: str, node_rank: int) -> str:
    """Where node `node_rank` keeps its files when the run dir is `run_dir` (node 0: there)."""
    return run_dir if node_rank == 0 else os.path.join(run_dir, f"node-{node_rank}")


def set_aside(path: str) -> str | None:
    """Move what an earlier run left in `path` into path/previous-N; the folder it went to.
    Other nodes' folders stay: each node sets aside its own, and may be using it already; so do
    the locks and checkpoints of a folder that is also another output (found in review: a run
    dir that is the --checkpoint-dir moved the checkpoint being resumed)."""
    entries = [e for e in os.listdir(path) if not e.startswith("previous-") and e not in LOCKS
               and not NODE.fullmatch(e) and not STEP_DIR.match(e)] if os.path.isdir(path) else []
    if not entries:
        return None
    n = 1
    while os.path.exists(os.path.join(path, f"previous-{n}")):
        n += 1
    aside = os.path.join(path, f"previous-{n}")
    os.mkdir(aside)
    for e in entries:
        os.rename(os.path.join(path, e), os.path.join(aside, e))
    return aside


class RunDir:
    def __init__(self, path: str, pipeline: Pipeline, overrides: dict[str, Any]) -> None:
        self.path = path
        running = status.live_pid(path)
        if running is not None and running != os.getpid():  # moving its files aside would hide it from top
            raise PipelineError(f"--run-dir {path} is in use by a run still going (pid {running}): give another "
                                f"--run-dir, or wait for it to end (if pid {running} is no maestro run, delete "
                                f"{os.path.join(path, 'status.json')})")
        # Before anything is moved: of two runs starting together, one is refused. (On a filesystem
        # without locks, the status.json check above is all there is.)
        self._lock = hold_folder(path, f"--run-dir {path} is in use by a run still going (it holds {LOCK} there): "
                                 "give another --run-dir, or wait for it to end", flag="--run-dir")
        self.set_aside = set_aside(path)  # an earlier run's files, if this folder is reused
        os.makedirs(os.path.join(path, "workers"), exist_ok=True)
        with open(os.path.join(path, "pipeline.json"), "w") as f:
            json.dump({"pipeline": pipeline.to_dict(), "overrides": overrides}, f, indent=1, default=str)
        self._plans: Any = None  # opened at the first plan (found in QA: other nodes' folders held an empty one)
        self._closed = False
        self._plans_guard = WriteGuard(f"plans to {path}/plans.jsonl")
        self._events_guard = WriteGuard(f"events to {path}/events.jsonl")

    @property
    def metrics(self) -> str:
        return os.path.join(self.path, "metrics.jsonl")

    def worker_log(self, name: str) -> str:
        """`name`: Placement.worker_name (section-replica[.tp])."""
        return os.path.join(self.path, "workers", f"{name}.log")

    def event(self, event: dict[str, Any]) -> None:
        self._events_guard(self._append_event, json.dumps({"time": time.time(), **event}) + "\n")

    def _append_event(self, line: str) -> None:
        with open(os.path.join(self.path, "events.jsonl"), "a") as f:
            f.write(line)

    def plan(self, plan_json: dict[str, Any]) -> None:
        if not self._closed:
            self._plans_guard(self._write_plan, json.dumps(plan_json) + "\n")

    def _write_plan(self, line: str) -> None:
        if self._plans is None:
            self._plans = open(os.path.join(self.path, "plans.jsonl"), "w")  # noqa: SIM115 (closed in close())
        self._plans.write(line)
        self._plans.flush()

    def close(self) -> None:
        """The job is over (after its last attempt)."""
        status.release(self.path)
        if self._lock is not None:
            self._lock.close()  # lets go of the flock
            self._lock = None
        self._closed = True
        if self._plans is not None:
            self._plans_guard.close(self._plans)
            self._plans = None


def checkpoints_note(path: str) -> str:
    """For a run directory given where checkpoints are expected (`--resume`, `maestro export`):
    ": " and where its run wrote them, from its events.jsonl, to end their refusal with (found in
    QA: "no complete checkpoint there", with no word that it is a run directory); "" for any
    other folder."""
    events = os.path.join(path, "events.jsonl")
    if not os.path.isfile(events) or not os.path.isfile(os.path.join(path, "pipeline.json")):
        return ""
    written = None
    try:
        with open(events, errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and isinstance(event.get("checkpoint"), str):
                    written = event["checkpoint"]
    except OSError:
        return ""
    if written is None:
        return ": it is a run directory, and its run wrote no checkpoint (a run writes them with --checkpoint-dir)"
    where = os.path.dirname(os.path.normpath(written))
    relative = "" if os.path.isabs(written) else ", relative to where that run was started"
    return (f": it is a run directory; its run wrote its checkpoints in {where} (the last: {written}{relative}): "
            f"give {where}")
