"""`maestro run` as a function: load, check, then train in section or colocated mode.

Runs in the coordinator process. Returns the metrics rows; raises PipelineError (bad input,
found before any worker starts), StageError or SystemFailure.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Any

from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.checks import check_pipeline
from maestro_flow.runtime.report import RunReport
from maestro_flow.runtime.sampler import EpochSampler


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
    checked = check_pipeline(pipeline)  # bad input is refused here, before any worker starts
    sampler = EpochSampler(checked.metadata, pipeline.global_batch, pipeline.seed)
    skipped = getattr(checked.source, "num_skipped", 0)
    if options.show_progress:
        mode = "colocated" if options.colocated else f"{sum(s.dp for s in pipeline.sections)} workers"
        print(f"{pipeline.name}: {len(checked.metadata)} samples from {pipeline.data.path}"
              f"{f' ({skipped} bad rows skipped)' if skipped else ''}, {pipeline.steps} steps of "
              f"{pipeline.global_batch}, {mode}", file=sys.stderr)
    report = RunReport(total_steps=pipeline.steps, metrics_out=options.metrics_out, show_progress=options.show_progress)
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        if options.colocated:
            from maestro_flow.runtime.colocated import run_colocated

            run_colocated(pipeline, checked.source, sampler, report, save_dir=options.save_dir)
        else:
            from maestro_flow.runtime.coordinator import Coordinator

            Coordinator(pipeline, checked.graph, sampler, report, paths=paths, save_dir=options.save_dir).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        report.close()
    if options.show_progress:
        print(report.summary(), file=sys.stderr)
    return report.rows
