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
    with pytest.raises(PipelineError, match=f"^--trace {path}: another run is writing this file"):
        TraceWriter(str(path))
    first.close()
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["name"] for e in events} == {"process_name", "process_sort_index", "thread_name"}
    TraceWriter(str(path)).close()  # free again once the first run is done
    assert json.loads(path.read_text()) == {"displayTimeUnit": "ms", "traceEvents": []}
