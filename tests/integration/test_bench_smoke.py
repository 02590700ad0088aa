"""Every benchmark in tools/bench/ runs at its --tiny size and returns sane numbers.

Real processes on loopback (spawned ranks, and the distill pipeline in section mode), so these
are integration tests; each is bounded by a timeout and checks that no child process is left.
The numbers are not judged against the goals here (a noisy CI machine would make that flaky);
tools/bench/RESULTS.md records full-size runs.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os

import pytest

from tools.bench import control_overhead, p2p_bandwidth, teacher_memory
from tools.bench.common import REPO_ROOT

pytestmark = pytest.mark.integration

DEMO_DATA = os.path.join(REPO_ROOT, "data", "demo", "text.arrow")
needs_demo_data = pytest.mark.skipif(not os.path.exists(DEMO_DATA),
                                     reason="demo data missing: run `maestro data demo` first")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(autouse=True)
def no_leftover_children(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the pipelines name their data relative to the repository root
    yield
    assert mp.active_children() == [], "a benchmark left child processes running"


@pytest.mark.timeout(60)
def test_p2p_bandwidth_tiny():
    out = p2p_bandwidth.main(["--tiny"])
    cases = out["cases"]
    assert [(c["kind"], c["msg_bytes"]) for c in cases] == [("one", 64 * 1024), ("one", 1 << 20),
                                                            ("many", 64 * 16 * 1024)]
    for c in cases:
        for key in ("raw_gibps", "raw_fresh_gibps", "runtime_gibps", "ratio", "ratio_q1", "ratio_q3"):
            assert positive(c[key]), (key, c)
        assert c["ratio_q1"] <= c["ratio"] <= c["ratio_q3"]
        assert c["reps"] == out["config"]["reps"]
    assert positive(out["min_ratio_from_1mib"])


@needs_demo_data
@pytest.mark.timeout(90)
def test_control_overhead_tiny():
    out = control_overhead.main(["--tiny"])
    for name in ("tensors", "plan", "done"):
        m = out["micro"][name]
        assert m["bytes"] > 0
        for key in ("push_pull_us", "round_trip_us", "one_way_us"):
            assert positive(m[key]), (name, key, m)
    pipe = out["pipeline"]
    assert pipe["steps"] == 3
    assert positive(pipe["median_step_time_s"])
    # distill at global batch 16: teacher 2 micro-batches of 8, student 2 replicas x 4 of 2.
    assert pipe["micro_batches_per_step"] == pipe["micro_batches_per_step_measured"] == 10
    counts = pipe["messages_per_step"]
    assert counts["plan"] == counts["done"] == 3 and counts["loss"] == counts["finalize"] == 2
    assert counts["tensors"] >= 2  # every teacher micro-batch feeds at least one student replica
    for key in ("messages_per_micro_batch", "overhead_per_micro_batch_us", "overhead_per_step_us",
                "overhead_fraction_of_step"):
        assert positive(pipe[key]), key
    assert set(out["goals"]) == {"per_micro_batch_under_1ms", "under_2pct_of_step"}


@needs_demo_data
@pytest.mark.timeout(90)
def test_teacher_memory_tiny():
    out = teacher_memory.main(["--tiny"])
    assert [(r["global_batch"], r["steps"]) for r in out["runs"]] == [(8, 4), (16, 2)]  # 32 samples each
    for run in out["runs"]:
        for section in ("teacher", "student"):
            assert positive(run[section]["max_rss_mb"])
            assert run[section]["growth_second_half_mb"] >= 0
    assert [r["teacher"]["micro_batches_per_step"] for r in out["runs"]] == [1, 2]
    assert positive(out["teacher_ratio"]) and positive(out["ratios"]["student"])
    assert isinstance(out["goal_met"], bool)
