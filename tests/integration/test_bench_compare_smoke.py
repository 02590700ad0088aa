"""The comparison benchmarks (section mode against the monolithic baseline, the VLM against its
text-only twin, the control plane at scale, `maestro tune`'s predictions against measured
steps and at published scale, what padding costs) run at their --tiny size and return sane numbers.

Real processes (spawned workers, simulated ranks in one process); bounded by timeouts, nothing
left running. The numbers are not judged against the goals here (tools/bench/RESULTS.md holds
full-size runs): only their shape.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os

import pytest

from tools.bench import baseline_compare, coordinator_scale, padding, tune_report, vlm_gap, vlm_text_only
from tools.bench.common import REPO_ROOT

pytestmark = pytest.mark.integration


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    from loaders.demo import build_image_demo, build_text_demo

    monkeypatch.chdir(REPO_ROOT)  # the pipelines name their data relative to the repository root
    demo = os.path.join(REPO_ROOT, "data", "demo")
    if not os.path.exists(os.path.join(demo, "text.arrow")):
        build_text_demo(demo)
    if not os.path.exists(os.path.join(demo, "vlm.arrow")):
        build_image_demo(demo)
    yield
    assert mp.active_children() == [], "a benchmark left child processes running"


@pytest.mark.timeout(180)
def test_baseline_compare_tiny():
    out = baseline_compare.main(["--tiny", "--pipelines", "distill"])
    d = out["distill"]
    assert set(d["samples_per_s"]) == {"section (shipped)", "section student dp=1 student micro_batch=2",
                                       "monolithic mb 2"}
    assert all(positive(v) for v in d["samples_per_s"].values())
    assert positive(d["section_over_monolithic"]) and d["best_monolithic"] == "monolithic mb 2"


@pytest.mark.timeout(240)
def test_vlm_text_only_tiny():
    out = vlm_text_only.main(["--tiny"])
    for share in ("0.0", "0.66"):
        r = out[share]
        assert positive(r["vlm_step_s"]) and positive(r["text_step_s"]) and positive(r["ratio"])
        # Each round's own pair (one round at --tiny): its ratio, and their median.
        assert len(r["round_ratios"]) == out["config"]["rounds"] and r["paired_ratio"] == r["round_ratios"][0]
        assert r["llm_busy_s"] > 0 and r["encoder_busy_s"] >= 0
        # Every process's CPU per step: the machine's ceiling on the ratio (no step is shorter
        # than its CPU seconds over the cores).
        assert positive(r["vlm_cpu_s"]) and positive(r["text_cpu_s"]) and positive(r["cpu_ceiling"])
        assert r["vlm_step_s"] * len(out["config"]["cores"]) >= r["vlm_cpu_s"] * 0.8  # medians of other intervals
    assert out["0.0"]["encoder_busy_s"] < out["0.66"]["encoder_busy_s"]  # no image, no encoder work


@pytest.mark.timeout(240)
def test_vlm_gap_tiny():
    out = vlm_gap.main(["--tiny"])
    assert positive(out["stage"]["image"]) and positive(out["stage"]["text"])
    for mode in ("vlm", "text"):
        r = out[mode]
        assert positive(r["us_per_position"]) and 0 < r["cpu_over_wall"] <= 1.01
        assert r["padding"] >= 1 and r["micro_batches"] >= 1 and r["lost_ms"] >= -0.5 and r["wait_inputs_ms"] >= 0
    cores = out["cores"]  # (c): None on one core
    assert cores is None or (positive(cores["alone"]) and positive(cores["beside_encoder"]))


@pytest.mark.timeout(240)
def test_coordinator_scale_tiny():
    out = coordinator_scale.main(["--tiny"])
    p = out["per_step"]
    assert p["workers"] == 16 and sum(p["sections"].values()) == 16
    for key in ("thread_ms_per_step", "cpu_ms_per_step", "wall_ms_per_step"):
        assert positive(p[key]), key
    assert [r["world"] for r in out["startup"]] == [2, 2] and all(positive(r["startup_s"]) for r in out["startup"])
    assert out["groups"][0]["channels"] == 2 and positive(out["groups"][0]["per_edge_s"])


@pytest.mark.timeout(300)
def test_tune_report_tiny():
    """Profile, tune and run both demo pipelines (section mode), and the published-scale predictions."""
    out = tune_report.main(["--tiny"])
    assert [m["pipeline"] for m in out["measured"]] == ["distill.py", "vlm.py"]
    for m in out["measured"]:
        for label in ("tuned", "uniform"):
            r = m[label]
            assert positive(r["predicted_step_s"]) and positive(r["measured_step_s"])
            assert positive(r["measured_over_predicted"])
            assert sum(dp for _, dp, _ in r["layout"]) <= m["devices"]
    assert positive(out["worst_error"] + 1)
    scale = out["published_scale"]
    assert {r["gpus"] for r in scale} == {64}
    fitted = [r for r in scale if r["fits"]]
    assert fitted
    for r in fitted:
        assert positive(r["best"]["step_s"]) and r["gain_vs_uniform"] >= 1 / 1.005
        assert positive(r["monolithic_step_s"]) and r["monolithic_replicas"] >= 1 and positive(r["gain_vs_monolithic"])
        # Both sides on the same GPUs (found in QA: the monolithic side of distill used 48 of 64).
        assert r["monolithic_replicas"] * r["monolithic_width"] <= r["gpus"] and r["section_gpus"] <= r["gpus"]
        assert r["gpus"] - r["spread_replicas"] < r["spread_replicas"] * r["spread_width"] <= r["gpus"]
        assert r["spread_step_s"] <= r["monolithic_step_s"] * (1 + 1e-9) and positive(r["gain_vs_spread"])



@pytest.mark.timeout(240)
def test_padding_tiny():
    out = padding.main(["--tiny"])
    assert [r["micro_batch"] for r in out["stage"]] == list(padding.SIZES)
    assert all(positive(r["time_ratio"]) and r["padded_ratio"] >= 1.0 for r in out["stage"])
    for pipeline in ("distill.py", "vlm.py"):
        r = out[pipeline]
        assert positive(r["ratio_off_over_on"])
        for variant in ("on", "off"):
            assert positive(r[variant]["step_s"])
            for stats in r[variant]["sections"].values():
                assert stats["padding"] >= 1.0 and stats["micro_batches"] >= 1 and stats["busy_s"] > 0
