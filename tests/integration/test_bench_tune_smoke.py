"""tools/bench/tune_report.py at its --tiny size: profile, tune and run both demo pipelines
(section mode, real worker processes), and the published-scale predictions.

The numbers are not judged against goals here (a noisy machine would make that flaky); only
that they are there and sane, and that nothing is left running.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os

import pytest

from tools.bench import tune_report
from tools.bench.common import REPO_ROOT

pytestmark = pytest.mark.integration

DEMO_DIR = os.path.join(REPO_ROOT, "data", "demo")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    from loaders.demo import build_image_demo, build_text_demo

    monkeypatch.chdir(REPO_ROOT)  # the pipelines name their data relative to the repository root
    if not os.path.exists(os.path.join(DEMO_DIR, "text.arrow")):
        build_text_demo(DEMO_DIR)
    if not os.path.exists(os.path.join(DEMO_DIR, "vlm.arrow")):
        build_image_demo(DEMO_DIR)
    yield
    assert mp.active_children() == [], "the benchmark left child processes running"


@pytest.mark.timeout(300)
def test_tune_report_tiny():
    out = tune_report.main(["--tiny"])
    assert [m["pipeline"] for m in out["measured"]] == ["distill.py", "vlm.py"]
    for m in out["measured"]:
        for label in ("tuned", "uniform"):
            r = m[label]
            assert positive(r["predicted_step_s"]) and positive(r["measured_step_s"])
            assert positive(r["measured_over_predicted"])
            assert sum(dp for _, dp, _ in r["layout"]) <= m["devices"]
    scale = out["published_scale"]
    assert {r["gpus"] for r in scale} == {64}
    fitted = [r for r in scale if r["fits"]]
    assert fitted
    for r in fitted:
        assert positive(r["best"]["step_s"]) and r["gain_vs_uniform"] >= 1 / 1.005
        assert positive(r["monolithic_step_s"]) and r["monolithic_replicas"] >= 1 and positive(r["gain_vs_monolithic"])
