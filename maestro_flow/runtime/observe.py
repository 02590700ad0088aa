"""What a run records besides its metrics: plans, the timeline trace, worker log locations.

Runs in the coordinator process (section mode) or the colocated process. `RunObserver` gets the
plan of every step as it is made (with the planning time) and every replica's done report,
from which it takes the trace events before the ledger sees the stats.
"""

from __future__ import annotations

import time
from typing import Any

from maestro_flow.planner.plan import Placement, Plan
from maestro_flow.runtime.rundir import RunDir
from maestro_flow.runtime.trace import Tracer, TraceWriter

COORDINATOR_PID = 0


class RunObserver:
    def __init__(self, *, run_dir: RunDir | None = None, trace_path: str | None = None) -> None:
        self.run_dir = run_dir
        self.trace = TraceWriter(trace_path) if trace_path else None
        self.tracer = Tracer(enabled=self.trace is not None)  # the coordinator's own track
        self._placement: Placement | None = None

    @property
    def tracing(self) -> bool:
        return self.trace is not None

    def start(self, placement: Placement) -> None:
        self._placement = placement
        if self.trace is not None:
            self.trace.process(COORDINATOR_PID, "coordinator (planning)", 0)
            for rank in range(placement.world_size):
                section, replica = placement.who(rank)
                if placement.tp(section) > 1:
                    replica = f"{replica}.{placement.tp_index(rank)}"
                self.trace.process(rank + 1, f"{section}[{replica}] rank {rank}", rank + 1)

    def planned(self, plan: Plan, started: float, finished: float) -> None:
        """`started`/`finished`: time.perf_counter() around the planner call."""
        if self.run_dir is not None:
            entry = plan.to_json_dict()
            if not entry["simulated"]:  # a run does not simulate its plans: `maestro plan --step N` does
                del entry["simulated"]
            self.run_dir.plan(entry)
        if self.trace is not None:
            self.tracer.span(f"plan step {plan.step}", "plan", started, finished, step=plan.step,
                             samples=len(plan.samples), schedule=plan.schedule)
            self.trace.events(COORDINATOR_PID, self.tracer.take())

    def done(self, rank: int, stats: dict[str, Any]) -> None:
        events = stats.pop("trace", None)
        if self.trace is not None and events:
            self.trace.events(rank + 1, events)

    def worker_log(self, name: str) -> str | None:
        return self.run_dir.worker_log(name) if self.run_dir is not None else None

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.run_dir is not None:
            self.run_dir.close()


def timed_plan(planner: Any, step: int, samples: list, observer: RunObserver | None) -> Plan:
    started = time.perf_counter()
    plan = planner.plan(step, samples)
    if observer is not None:
        observer.planned(plan, started, time.perf_counter())
    return plan
