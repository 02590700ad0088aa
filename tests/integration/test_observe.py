"""What a run leaves behind: the run directory (plans, metrics, worker logs) and the trace.

The trace must load as Chrome/Perfetto JSON, its spans must be consistent (no negative
durations, compute spans of one track nest, async transfer events pair up), and every
micro-batch of every plan must appear as a forward span on its replica's track.
"""

from __future__ import annotations

import json
import re

import pytest

from maestro_flow.runtime.run import RunOptions, run_pipeline
from tests.integration.conftest import ASSETS, ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def check_trace(trace: dict, plans: list[dict], sections: dict[str, int]) -> None:
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names[0].startswith("coordinator")
    assert len(names) == 1 + sum(sections.values())
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] > -1e6 for e in spans)  # us since the run's start
    # Complete events of one track nest: sorted by start, each ends before the next starts or
    # contains it entirely.
    by_track: dict[tuple, list] = {}
    for e in spans:
        by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for track in by_track.values():
        track.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []
        for e in track:
            while stack and stack[-1] <= e["ts"] + 0.01:
                stack.pop()
            if stack:
                assert e["ts"] + e["dur"] <= stack[-1] + 0.01, ("spans overlap without nesting", e)
            stack.append(e["ts"] + e["dur"])
    # Async transfer events: each begin has its end, not before it.
    # Their ids are numbered per process, so process-local (a plain "id" is global: found in QA).
    assert not any("id" in e for e in events if e["ph"] in "be")
    begins = {(e["pid"], e["id2"]["local"]): e["ts"] for e in events if e["ph"] == "b"}
    ends = {(e["pid"], e["id2"]["local"]): e["ts"] for e in events if e["ph"] == "e"}
    assert begins.keys() == ends.keys()
    assert all(ends[k] >= begins[k] for k in begins)
    # Every planned micro-batch ran: one forward span per (section replica, step, micro-batch).
    pid_of = {name: pid for pid, name in names.items()}
    forwards = {(e["pid"], e["args"]["step"], e["args"]["mb"]): e["args"]["samples"]
                for e in spans if e["name"] == "forward"}
    for plan in plans:
        for section, body in plan["sections"].items():
            for r, mbs in enumerate(body["replicas"]):
                pid = next(p for n, p in pid_of.items() if n.startswith(f"{section}[{r}]"))
                for m, mb in enumerate(mbs):
                    assert forwards[(pid, plan["step"], m)] == mb, (section, r, plan["step"], m)
    # Backward spans belong to micro-batches that ran; a loss section's backward, which follows
    # its forward at once, is its own span (it was inside the forward span before).
    backwards = {(e["pid"], e["args"]["step"], e["args"]["mb"]) for e in spans if e["name"] == "backward"}
    assert backwards and backwards <= forwards.keys()
    loss = [p for p, n in names.items() if n.startswith(f"{list(sections)[-1]}[")]
    assert {k for k in forwards if k[0] in loss} <= backwards
    planning = [e for e in spans if e["pid"] == 0 and e["name"].startswith("plan step")]
    assert len(planning) == len(plans)
    # One time axis for every process: nothing of a step starts before the coordinator began
    # planning it, and no receive of a step begins before the first send of that step did.
    planned = {int(e["name"].split()[-1]): e["ts"] for e in planning}
    assert all(e["ts"] >= planned[e["args"]["step"]] for e in spans if e["pid"] != 0 and "step" in e["args"])
    for kind in ("fwd", "bwd"):
        first_send, first_recv = {}, {}
        for e in events:
            if e["ph"] == "b" and e["name"] in (f"send {kind}", f"recv {kind}"):
                first = first_send if e["name"].startswith("send") else first_recv
                first[e["args"]["step"]] = min(e["ts"], first.get(e["args"]["step"], e["ts"]))
        assert all(first_recv[s] >= first_send[s] for s in first_recv), (kind, first_send, first_recv)


@pytest.mark.parametrize("pipeline,colocated", [("pipelines/vlm.py", False), ("pipelines/chain.py", False),
                                                ("pipelines/distill.py", True)])
def test_trace_and_run_directory(demo_data, tmp_path, pipeline, colocated):
    from loaders.demo import build_image_demo

    data = build_image_demo(tmp_path / "vlm", num_samples=64) if "vlm" in pipeline else demo_data
    run_dir = tmp_path / "run"
    overrides = {"steps": 3, "data.path": str(data), "global_batch": 12}
    if "vlm" in pipeline:
        overrides["adapt_costs"] = False  # so that `maestro plan` has the run's costs (below)
    rows = run_pipeline(str(ROOT / pipeline), RunOptions(
        overrides=overrides, show_progress=False, run_dir=str(run_dir), trace="", colocated=colocated))
    assert len(rows) == 3
    for row in rows:  # CPU seconds per step: in section mode, each section's workers and the coordinator
        if colocated:
            assert "coordinator_cpu_s" not in row and all("cpu_s" not in s for s in row["sections"].values())
        else:
            assert row["coordinator_cpu_s"] > 0 and all(s["cpu_s"] > 0 for s in row["sections"].values())
    plans = [json.loads(line) for line in (run_dir / "plans.jsonl").read_text().splitlines()]
    assert [p["step"] for p in plans] == [0, 1, 2]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert json.loads((run_dir / "pipeline.json").read_text())["pipeline"]["global_batch"] == 12
    dp = {} if colocated else None
    config = json.loads((run_dir / "pipeline.json").read_text())["pipeline"]
    sections = {s["name"]: (1 if colocated else s["dp"]) for s in config["sections"]}
    assert dp is None or dp == {}
    trace = json.loads((run_dir / "trace.json").read_text())
    check_trace(trace, plans, sections)
    if "vlm" in pipeline:  # the encoder reads only the data: it decodes images ahead (Stage.prepare)
        check_prepared_ahead(trace, "vision")
        # `maestro plan --step N` shows the plan the run made (it showed a searched plan where
        # the run, with no core to spare or for its first step, searched none).
        from maestro_flow.runtime.planning import plan_one_step

        for made in plans:
            shown = plan_one_step(str(ROOT / pipeline), overrides, step=made["step"]).to_json_dict()
            assert "simulated" not in made and shown["simulated"]["makespan_s"] > 0
            assert (shown["variant"], shown["sections"]) == (made["variant"], made["sections"]), made["step"]


def check_prepared_ahead(trace: dict, section: str) -> None:
    """Micro-batches prepared ahead were ones the section ran, each prepared once and before its
    forward; at least one was prepared before its step began (during the previous step's waits)."""
    events = trace["traceEvents"]
    pids = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
            and e["args"]["name"].startswith(f"{section}[")}
    spans = [e for e in events if e["ph"] == "X" and e["pid"] in pids]
    prepared = [(e["pid"], e["args"]["step"], e["args"]["mb"], e["ts"] + e["dur"]) for e in spans
                if e["name"] == "prepare"]
    forwards = {(e["pid"], e["args"]["step"], e["args"]["mb"]): e["ts"] for e in spans if e["name"] == "forward"}
    assert prepared, "no micro-batch was prepared ahead"
    assert len({p[:3] for p in prepared}) == len(prepared), "a micro-batch was prepared twice"
    assert all(end <= forwards[(pid, step, mb)] + 0.01 for pid, step, mb, end in prepared)
    starts: dict[int, float] = {}  # each step's first forward
    for (_, step, _), ts in forwards.items():
        starts[step] = min(ts, starts.get(step, ts))
    assert any(end <= starts[step] for _, step, mb, end in prepared if step > 0)


def test_worker_logs_prefix_every_line(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    run_pipeline(str(ASSETS / "faulty.py"), RunOptions(
        overrides={"steps": 1, "data.path": str(demo_data)}, show_progress=False, run_dir=str(run_dir)))
    for replica in (0, 1):
        log = (run_dir / "workers" / f"student-{replica}.log").read_text().splitlines()
        assert f"[student/{replica}] faulty stage built on replica {replica}" in log
        assert all(line.startswith(f"[student/{replica}] ") for line in log)


def test_top_attaches_to_a_run_started_elsewhere_and_detaches(demo_data, tmp_path):
    import subprocess
    import sys
    import time

    from tests.integration.conftest import maestro

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "maestro_flow.cli", "run", str(ASSETS / "faulty.py"), "--quiet", "--steps", "40",
         "--run-dir", str(run_dir), "--set", f"data.path={demo_data}", "--set", "sections.student.config.sleep_s=0.1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        snapshot = None
        while time.monotonic() < deadline:
            if (run_dir / "status.json").exists():
                result = maestro("top", str(run_dir), "--once", timeout=30)
                if result.returncode == 0 and "student[1]" in result.stdout and "step" in result.stdout:
                    snapshot = result.stdout
                    # Found by CI under load: a worker whose first heartbeat had not come yet shows
                    # "?"; wait for every row to have one.
                    if ("forward" in snapshot or "waiting" in snapshot) and "?" not in snapshot:
                        break
            time.sleep(0.3)
        assert snapshot, "maestro top never showed the running workers"
        assert "teacher[0]" in snapshot and "student[0]" in snapshot
        assert re.search(r" as of$", snapshot, re.M) and re.search(r"^student\[0\] .* \d+\.\ds$", snapshot, re.M), \
            snapshot  # each row with its heartbeat's age
        result = maestro("top", str(run_dir), "--once", "--json", timeout=30)  # the snapshot itself, as JSON
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout)
        assert seen["pipeline"] and seen["steps"] == 40 and 0 <= seen["step"] <= 40
        assert {w["name"] for w in seen["workers"]} == {"teacher[0]", "student[0]", "student[1]"}
        # A top that keeps watching says so when the run ends, and exits 0 (it exited 2 with
        # "No such file or directory: .../status.json" before).
        watcher = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", "top", str(run_dir), "--interval", "0.2"],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err  # attaching did not disturb the run
        out, err = watcher.communicate(timeout=30)
        assert watcher.returncode == 0, err
        assert re.search(r"the run has ended after step 40, loss \d+\.\d{4}$", out.rstrip()), out[-300:]
    finally:
        for p in (proc, locals().get("watcher")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    assert not (run_dir / "status.json").exists()  # nothing to attach to once the run is over
    result = maestro("top", str(run_dir), "--once", timeout=30)
    assert result.returncode == 2 and "not running" in result.stderr


def test_a_full_disk_for_metrics_and_trace_does_not_stop_training(demo_data):
    # Reproduced before: a full disk under the run directory killed training with a traceback.
    from tests.integration.conftest import maestro

    result = maestro("run", "pipelines/distill.py", "--steps", "3", "--set", f"data.path={demo_data}",
                     "--metrics-out", "/dev/full", "--trace", "/dev/full", "--no-run-dir")
    assert result.returncode == 0, result.stderr
    assert "cannot write metrics to /dev/full (No space left on device); the run goes on without it" in result.stderr
    assert "cannot write the trace to /dev/full" in result.stderr
    assert "step 3/3" in result.stderr and "Traceback" not in result.stderr


def test_a_refused_record_writes_nothing_and_a_trace_makes_its_folder(demo_data, tmp_path):
    """A bad --record is refused before the run dir or the trace is written (a half-written
    trace.json and a run dir were left before); --trace into a new folder makes it, as
    --metrics-out does (a FileNotFoundError traceback before)."""
    from maestro_flow.errors import PipelineError

    with pytest.raises(PipelineError, match="--record: no section named 'nosuch'"):
        run_pipeline(str(ROOT / "pipelines" / "distill.py"), RunOptions(
            overrides={"steps": 1, "data.path": str(demo_data)}, show_progress=False, run_dir=str(tmp_path / "rd"),
            trace="", record="nosuch"))
    assert not (tmp_path / "rd").exists()
    trace = tmp_path / "new" / "deeper" / "t.json"
    run_pipeline(str(ROOT / "pipelines" / "distill.py"), RunOptions(
        overrides={"steps": 1, "data.path": str(demo_data)}, show_progress=False, run_dir=None,
        trace=str(trace), colocated=True))
    assert json.loads(trace.read_text())["traceEvents"]
