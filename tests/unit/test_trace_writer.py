"""The trace file (runtime/trace.py TraceWriter): one run's at a time."""

from __future__ import annotations

import json

import pytest

from maestro_flow.errors import PipelineError
from maestro_flow.runtime.trace import TraceWriter


def test_a_trace_file_another_run_writes_is_refused_and_left_whole(tmp_path):
    """Found in QA: two runs given one --trace FILE both wrote it; the file held one run's trace."""
    path = tmp_path / "trace.json"
    path.write_text("an older trace")
    first = TraceWriter(str(path))  # emptied once it is this run's
    first.process(1, "student[0]", 0)
    first._f.flush()
    size = path.stat().st_size
    assert size > 0
    with pytest.raises(PipelineError, match=f"^--trace {path}: another run is writing this file"):
        TraceWriter(str(path))
    assert path.stat().st_size == size  # not emptied by the refused one (found in review: the test could not tell)
    first.close()
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["name"] for e in events} == {"process_name", "process_sort_index", "thread_name"}
    TraceWriter(str(path)).close()  # free again once the first run is done
    assert json.loads(path.read_text()) == {"displayTimeUnit": "ms", "traceEvents": []}


def test_a_trace_file_held_before_the_run_dir_is_set_up_is_taken_over(tmp_path):
    """Found in review: a busy --trace was refused only after the run dir had moved an earlier
    run's files aside. check_outputs now holds it first (report.hold), and the writer takes that
    lock over; a run refused before it lets go (release_held)."""
    from maestro_flow.runtime.report import hold, lock_file, release_held

    path = tmp_path / "trace.json"
    path.write_text("")
    hold(str(path), "--trace")  # as check_outputs does, before the run dir
    with open(path, "a") as other:  # another run's open of the file
        assert not lock_file(other)
    writer = TraceWriter(str(path))  # takes the held lock over, not refused by it
    release_held()  # nothing left to release: the writer has it
    with pytest.raises(PipelineError, match="another run is writing this file"):
        TraceWriter(str(path))
    writer.close()
    TraceWriter(str(path)).close()  # free once the writer is closed
