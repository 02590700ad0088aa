"""Timeline tracing in the Chrome/Perfetto trace-event format (JSON), loadable in ui.perfetto.dev.

`Tracer` runs in every worker (and the coordinator): it records spans against the process's
monotonic clock and converts them to microseconds on the coordinator's wall clock (the offset is
measured at the handshake), so all processes share one time axis. Compute spans (forward,
backward, waiting, gradient reduction, optimizer) are complete events ("X") on the compute
track and nest; transfers overlap each other, so they are async events ("b"/"e", with
process-local ids) on the comm track. `TraceWriter` runs in the coordinator and streams events
to the file as steps finish, so a run that fails still leaves a loadable trace.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from typing import Any

from maestro_flow.errors import PipelineError
from maestro_flow.runtime.guard import WriteGuard
from maestro_flow.runtime.report import lock_file, take_held

COMPUTE, COMM = 0, 1  # thread ids within a process's track
Event = list  # [ph, name, cat, ts_us, dur_us_or_id, tid, args]


class Tracer:
    def __init__(self, enabled: bool, offset_s: float = 0.0, epoch: float | None = None) -> None:
        self.enabled = enabled
        # Monotonic time -> the coordinator's wall clock (one reading of both clocks here, plus
        # the offset between this host's wall clock and the coordinator's), counted from the
        # run's epoch: microseconds since 1970 would leave a double only ~0.25 us of precision.
        self.epoch = time.time() if epoch is None else epoch
        self._origin = time.time() - time.perf_counter() + offset_s - self.epoch
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._ids = 0

    def us(self, t: float) -> float:
        return (self._origin + t) * 1e6

    def span(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        """A complete event on the compute track; start/end from time.perf_counter()."""
        if self.enabled:
            with self._lock:
                self._events.append(["X", name, cat, self.us(start), max(0.0, (end - start) * 1e6), COMPUTE, args])

    def transfer(self, name: str, start: float, end: float, **args: Any) -> None:
        """An async event on the comm track (transfers overlap; called from comm threads)."""
        if self.enabled:
            with self._lock:
                self._ids += 1
                self._events.append(["b", name, "comm", self.us(start), self._ids, COMM, args])
                self._events.append(["e", name, "comm", self.us(max(start, end)), self._ids, COMM, {}])

    def take(self) -> list[Event]:
        with self._lock:
            out, self._events = self._events, []
        return out


class TraceWriter:
    """Streams trace events to a JSON file ({"traceEvents": [...]}); close() completes it."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)  # as --metrics-out does
        self._f = open(path, "a")  # noqa: SIM115 (closed in close()); emptied once it is this run's
        self._held = None  # the lock check_outputs took on it, if it was there then (found in review)
        if stat.S_ISREG(os.fstat(self._f.fileno()).st_mode):
            self._held = take_held(self._f)
            if self._held is None and not lock_file(self._f):  # found in QA: two runs given one --trace both wrote it
                self._f.close()
                raise PipelineError(f"--trace {path}: another run is writing this file (give each run its own)")
            self._f.truncate(0)
        self._guard = WriteGuard(f"the trace to {path}")  # a full disk ends the trace, not the run
        self._guard(self._f.write, '{"displayTimeUnit": "ms", "traceEvents": [\n')
        self._first = True

    def process(self, pid: int, name: str, sort_index: int) -> None:
        self._write({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        self._write({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort_index}})
        for tid, label in ((COMPUTE, "compute"), (COMM, "transfers")):
            self._write({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})

    def events(self, pid: int, events: list[Event]) -> None:
        for ph, name, cat, ts, extra, tid, args in events:
            ev = {"ph": ph, "name": name, "cat": cat, "ts": round(ts, 3), "pid": pid, "tid": tid, "args": args}
            if ph == "X":
                ev["dur"] = round(extra, 3)
            else:  # numbered per process: a process-local id (found in QA: a plain id is global, so
                ev["id2"] = {"local": extra}  # viewers could pair one rank's begin with another's end)
            self._write(ev)

    def _write(self, ev: dict) -> None:
        if self._f is None:
            return
        self._guard(self._f.write, ("" if self._first else ",\n") + json.dumps(ev))
        self._first = False

    def close(self) -> None:
        if self._f is not None:
            self._guard(self._f.write, "\n]}\n")
            self._guard.close(self._f)
            self._f = None
        if self._held is not None:
            self._held.close()
            self._held = None
