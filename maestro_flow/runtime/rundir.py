"""The run directory: everything one `maestro run` leaves behind, in one folder.

Runs in the coordinator process. Layout:
    pipeline.json        the resolved pipeline configuration (after --set overrides)
    metrics.jsonl        one JSON object per step (DESIGN 5.4)
    plans.jsonl          every step's plan (DESIGN 5.5 format)
    workers/S-R.log      worker stdout/stderr, every line prefixed with [section/replica]
                         (S-R.T.log and [section/replica.T] for tensor-parallel rank T)
    events.jsonl         what happened to the run besides steps: automatic restarts (with cause)
    trace.json           the timeline, when `--trace` is given without a path of its own
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from maestro_flow.config import Pipeline


def default_run_dir(pipeline: Pipeline, root: str = "runs") -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(root, f"{pipeline.name}-{stamp}")
    n = 1
    while os.path.exists(path):  # two runs in the same second
        n += 1
        path = os.path.join(root, f"{pipeline.name}-{stamp}-{n}")
    return path


class RunDir:
    def __init__(self, path: str, pipeline: Pipeline, overrides: dict[str, Any]) -> None:
        self.path = path
        os.makedirs(os.path.join(path, "workers"), exist_ok=True)
        with open(os.path.join(path, "pipeline.json"), "w") as f:
            json.dump({"pipeline": pipeline.to_dict(), "overrides": overrides}, f, indent=1, default=str)
        self._plans = open(os.path.join(path, "plans.jsonl"), "w")  # noqa: SIM115 (closed in close())

    @property
    def metrics(self) -> str:
        return os.path.join(self.path, "metrics.jsonl")

    def worker_log(self, name: str) -> str:
        """`name`: Placement.worker_name (section-replica[.tp])."""
        return os.path.join(self.path, "workers", f"{name}.log")

    def event(self, event: dict[str, Any]) -> None:
        with open(os.path.join(self.path, "events.jsonl"), "a") as f:
            f.write(json.dumps({"time": time.time(), **event}) + "\n")

    def plan(self, plan_json: dict[str, Any]) -> None:
        if self._plans is not None:
            self._plans.write(json.dumps(plan_json) + "\n")
            self._plans.flush()

    def close(self) -> None:
        if self._plans is not None:
            self._plans.close()
            self._plans = None
