"""`maestro validate --payloads`: every payload a section will read, checked before any worker starts.

A stage says what it checks (`Stage.payload_checks`: modality -> a check of one sample's payload
and metadata; the built-in VisionEncoder checks each image as its decoder would take it, and the
data's num_patches against the patches the image decodes to; the AudioEncoder, a PayloadCheck
that also reads "sample_rate", each clip's frames at its framing against max_frames and the
data's num_frames). `check_payloads` reads the modality's column (and a PayloadCheck's columns)
for every sample the section reads that carries the modality (unless the section's `columns`
leave that column out), CHUNK rows at a time, and runs the check; what the
run tolerates (a PayloadNote, e.g. an image decode.skip_corrupt skips) is listed, not failed.
`check_and_report` is the command's side: the lines to show, then the error counting them.
Unlike the rest of validate it reads whole payloads (every image's bytes), so it runs only when
asked: minutes for a large dataset, with progress every few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maestro_flow.config import Pipeline
from maestro_flow.errors import PipelineError, brief
from maestro_flow.runtime.build import resolve
from maestro_flow.samples import MODALITIES, SampleMeta
from maestro_flow.stage import PayloadCheck, PayloadNote

CHUNK = 256  # rows read at a time
PROGRESS_S = 5.0  # at most one progress line this often


@dataclass
class PayloadReport:
    checked: int = 0  # payloads checked (a sample read by two sections with checks counts twice)
    found: int = 0  # problems found
    notes: int = 0  # what the run tolerates (PayloadNote: e.g. images it will skip)
    problems: list[str] = field(default_factory=list)  # the first `limit` of both, in data order per section
    by_section: dict[str, int] = field(default_factory=dict)  # section -> payloads it checks


def check_payloads(pipeline: Pipeline, source: Any, metadata: list[SampleMeta],
                   log: Callable[[str], None] = lambda line: None, limit: int = 20) -> PayloadReport:
    """Run every section's payload checks over the samples it reads; see the module docstring."""
    jobs = []
    for s in pipeline.sections:
        where = f"sections.{s.name}.stage"
        cls = resolve(s.stage, where)
        try:
            checks = cls.payload_checks(dict(s.config)) or {}
        except Exception as exc:
            raise PipelineError(f"{where}: {s.stage}.payload_checks(config) failed: {brief(exc)}") from exc
        for modality, found in checks.items():
            if modality not in MODALITIES or modality == "text":
                raise PipelineError(f"{where}: {s.stage}.payload_checks names {modality!r}, not a payload modality "
                                    f"({', '.join(m for m in MODALITIES if m != 'text')})")
            column = pipeline.data.column_of(modality)
            if s.columns is not None and column not in s.columns:
                continue  # the section never reads it (its payloads come by an edge, decoded upstream)
            reads = [m for m in metadata if modality in m.modalities
                     and (s.activates_on is None or s.activates_on in m.modalities)]
            if not isinstance(found, PayloadCheck):
                found = PayloadCheck(lambda value, meta, row, check=found: check(value, meta), ())
            jobs.append((s.name, column, found, reads))
    report = PayloadReport()
    total, last = sum(len(j[3]) for j in jobs), time.monotonic()
    for name, column, check, reads in jobs:
        report.by_section[name] = report.by_section.get(name, 0) + len(reads)
        for start in range(0, len(reads), CHUNK):
            chunk = reads[start:start + CHUNK]
            columns = source.read([m.row for m in chunk], [column, *check.columns])
            for i, (meta, value) in enumerate(zip(chunk, columns[column], strict=True)):
                try:
                    problem = check.check(value, meta, {c: columns[c][i] for c in check.columns})
                except Exception as exc:  # a stage's own check that breaks: said, not a traceback
                    problem = f"its check failed: {brief(exc)}"
                if problem:
                    tolerated = isinstance(problem, PayloadNote)
                    report.found += not tolerated
                    report.notes += tolerated
                    if len(report.problems) < limit:
                        report.problems.append(f"sections.{name}: sample {meta.id} (row {meta.row}): {problem}")
            report.checked += len(chunk)
            if time.monotonic() - last >= PROGRESS_S and report.checked < total:
                last = time.monotonic()
                log(f"payloads: {report.checked}/{total} checked, {report.found} with problems")
    return report


def check_and_report(pipeline: Pipeline, checked: Any, echo: Callable[[str], None]) -> None:
    """`maestro validate --payloads`: progress and every problem listed through `echo`, then a
    PipelineError counting the failing ones, or a line saying none fails."""
    report = check_payloads(pipeline, checked.source, checked.metadata, log=echo)
    for line in report.problems:
        echo(line)
    if report.found:
        more = f" (the first {len(report.problems)} above)" if report.found > len(report.problems) else " (above)"
        raise PipelineError(f"{report.found} payload{'' if report.found == 1 else 's'} of {report.checked} checked "
                            f"would fail in the run or mislead its plans{more}")
    checks = ", ".join(f"{n}: {k}" for n, k in report.by_section.items()) or "no section checks its payloads"
    tolerated = f", {report.notes} the run tolerates (above)" if report.notes else ""
    echo(f"payloads: {report.checked} checked ({checks}){tolerated}, none failing")
