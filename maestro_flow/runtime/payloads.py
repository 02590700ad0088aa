"""`maestro validate --payloads`: every payload a section will read, checked before any worker starts.

A stage says what it checks (`Stage.payload_checks`: modality -> a check of one sample's payload
and metadata; the built-in VisionEncoder checks each image as its decoder would take it, and the
data's num_patches against the patches the image decodes to; the AudioEncoder, a PayloadCheck
that also reads "sample_rate", each clip's frames at its framing against max_frames and the
data's num_frames). `check_payloads` reads the modality's column (and a PayloadCheck's columns)
for every sample the section reads that carries the modality (unless the section's `columns`
leave that column out), as many rows at a time as CHUNK_BYTES of payload make (at most CHUNK),
and runs the check; what the run tolerates (a PayloadNote, e.g. an image decode.skip_corrupt skips) is listed, not failed.
`declared_checks` also runs in every run's pre-flight checks (runtime/checks.py): a column a
PayloadCheck reads with the payload that the data lacks or the section's `columns` leave out is
refused there. `check_and_report` is the command's side: the lines to show, then the error counting them.
Unlike the rest of validate it reads whole payloads (every image's bytes), so it runs only when
asked: minutes for a large dataset, with progress every few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maestro_flow.config import Pipeline, Section
from maestro_flow.errors import PipelineError, brief
from maestro_flow.runtime.build import resolve
from maestro_flow.samples import MODALITIES, SampleMeta
from maestro_flow.stage import PayloadCheck, PayloadNote
from maestro_flow.wording import count

CHUNK = 256  # rows read at a time, at most
FIRST_CHUNK = 16  # the first read of a section's payloads; then as many rows as CHUNK_BYTES hold
CHUNK_BYTES = 64 << 20
PROGRESS_S = 5.0  # at most one progress line this often


@dataclass
class PayloadReport:
    checked: int = 0  # payloads checked (a sample read by two sections with checks counts twice)
    found: int = 0  # problems found
    notes: int = 0  # what the run tolerates (PayloadNote: e.g. images it will skip)
    problems: list[str] = field(default_factory=list)  # the first `limit` of both, in data order per section
    by_section: dict[str, int] = field(default_factory=dict)  # section -> payloads it checks


def declared_checks(pipeline: Pipeline, source: Any, strict: bool = True
                    ) -> list[tuple[Section, str, str, PayloadCheck]]:
    """(section, modality, payload column, check) for every check a section's stage declares on a payload
    it reads from the data (its `columns` include the column, or are not given, and the data has
    it). A PayloadCheck's own columns are what the stage reads with the payload: a name that is
    not a column of the data, or that the section's `columns` leave out, is refused naming the
    field (the run would fail at the first such sample). `strict=False` (every run's pre-flight
    checks) leaves a stage whose payload_checks fail or name no payload modality to
    `validate --payloads` and the workers."""
    found_checks = []
    for s in pipeline.sections:
        where = f"sections.{s.name}.stage"
        cls = resolve(s.stage, where)
        try:
            checks = cls.payload_checks(dict(s.config)) or {}
        except Exception as exc:
            if not strict:
                continue
            raise PipelineError(f"{where}: {s.stage}.payload_checks(config) failed: {brief(exc)}") from exc
        wrong = next((m for m in checks if m not in MODALITIES or m == "text"), None)
        if wrong is not None:
            if not strict:
                continue
            raise PipelineError(f"{where}: {s.stage}.payload_checks names {wrong!r}, not a payload modality "
                                f"({', '.join(m for m in MODALITIES if m != 'text')})")
        for modality, check in checks.items():
            column = pipeline.data.column_of(modality)
            if (s.columns is not None and column not in s.columns) or column not in source.column_names:
                continue  # the section never reads it (its payloads come by an edge, decoded upstream)
            if not isinstance(check, PayloadCheck):
                check = PayloadCheck(lambda value, meta, row, plain=check: plain(value, meta), ())
            names = check.columns
            if not isinstance(names, tuple | list) or not all(isinstance(c, str) for c in names):
                raise PipelineError(f"{where}: {s.stage}.payload_checks: the {modality} check's columns must be a "
                                    f"tuple of column names, got {names!r}")
            for c in names:
                if c not in source.column_names:
                    raise PipelineError(f"{where}: {s.stage} reads column {c!r} with its {modality} payload, and "
                                        f"{pipeline.data.path} has no such column")
                if s.columns is not None and c not in s.columns:
                    raise PipelineError(f"sections.{s.name}.columns: {s.stage} reads {c!r} with the {modality} "
                                        f"column {column!r}, and columns= leaves it out (add {c!r})")
            found_checks.append((s, modality, column, check))
    return found_checks


def check_payloads(pipeline: Pipeline, source: Any, metadata: list[SampleMeta],
                   log: Callable[[str], None] = lambda line: None, limit: int = 20) -> PayloadReport:
    """Run every section's payload checks over the samples it reads; see the module docstring."""
    jobs = []
    for s, modality, column, check in declared_checks(pipeline, source):
        reads = [m for m in metadata if modality in m.modalities
                 and (s.activates_on is None or s.activates_on in m.modalities)]
        jobs.append((s.name, column, check, reads))
    report = PayloadReport()
    total, last = sum(len(j[3]) for j in jobs), time.monotonic()
    for name, column, check, reads in jobs:
        report.by_section[name] = report.by_section.get(name, 0) + len(reads)
        start, rows = 0, FIRST_CHUNK
        while start < len(reads):
            chunk = reads[start:start + rows]
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
            start += len(chunk)
            # Rows read at once: as many as CHUNK_BYTES of these payloads hold (long audio clips
            # are megabytes each), at most CHUNK.
            size = sum(_nbytes(v) for v in columns[column])
            rows = max(1, min(CHUNK, CHUNK_BYTES * len(chunk) // max(size, 1)))
            del columns
            if time.monotonic() - last >= PROGRESS_S and report.checked < total:
                last = time.monotonic()
                log(f"payloads: {report.checked}/{total} checked, {report.found} with problems")
    return report


def _nbytes(value: Any) -> int:
    """About the bytes a payload as read holds (bytes, numpy arrays; 8 per element of a list)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    return 8 * len(value) if isinstance(value, list) else 0


def check_and_report(pipeline: Pipeline, checked: Any, echo: Callable[[str], None],
                     problem: Callable[[str], None] | None = None, where: str = "above") -> None:
    """`maestro validate --payloads`: progress through `echo`, every problem listed through
    `problem` (`echo` where None; --json gathers them, `where`: "in payloads"), then a
    PipelineError counting the failing ones, or a line saying none fails."""
    report = check_payloads(pipeline, checked.source, checked.metadata, log=echo)
    for line in report.problems:
        (problem or echo)(line)
    if report.found:
        more = f" (the first {len(report.problems)} {where})" if report.found > len(report.problems) else f" ({where})"
        raise PipelineError(f"{count(report.found, 'payload')} of {report.checked} checked "
                            f"would fail in the run or mislead its plans{more}")
    checks = ", ".join(f"{n}: {k}" for n, k in report.by_section.items()) or "no section checks its payloads"
    tolerated = f", {report.notes} the run tolerates (above)" if report.notes else ""
    echo(f"payloads: {report.checked} checked ({checks}){tolerated}, none failing")
