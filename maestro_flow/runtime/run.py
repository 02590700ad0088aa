"""`maestro run` as a function: load, check, then train in section or colocated mode.

Runs in the coordinator process. Returns the metrics rows; raises PipelineError (bad input,
found before any worker starts), StageError or SystemFailure.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.checks import check_pipeline
from maestro_flow.runtime.report import RunReport


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    overrides: dict[str, Any]
    colocated: bool = False
    metrics_out: str | None = None
    save_dir: str | None = None
    show_progress: bool = True


def _sigterm_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_pipeline(path: str, options: RunOptions) -> list[dict[str, Any]]:
    pipeline, paths = load_pipeline(path, options.overrides)
    graph, source = check_pipeline(pipeline)
    report = RunReport(total_steps=pipeline.steps, metrics_out=options.metrics_out, show_progress=options.show_progress)
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        if options.colocated:
            from maestro_flow.runtime.colocated import run_colocated

            run_colocated(pipeline, source, report, save_dir=options.save_dir)
        else:
            from maestro_flow.runtime.coordinator import Coordinator

            Coordinator(pipeline, graph, source, report, paths=paths, save_dir=options.save_dir).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        report.close()
    if options.show_progress:
        import sys

        print(report.summary(), file=sys.stderr)
    return report.rows
