"""CUDA sections: NCCL tensor channels and DP reduction, checked against the colocated reference.

Skipped without CUDA (CI has no GPU). Needs at least one GPU; with one GPU all replicas share it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from maestro_flow.runtime.run import RunOptions, run_pipeline
from tests.integration.conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from loaders.demo import build_text_demo

    return build_text_demo(tmp_path_factory.mktemp("demo"), num_samples=128, parquet=False)


@pytest.mark.parametrize("pipeline,sections", [("pipelines/distill.py", ["student"]),
                                               ("pipelines/chain.py", ["embed", "lm"])])
def test_cuda_section_mode_matches_colocated(demo_data, tmp_path, pipeline, sections):
    names = [s for s in ("teacher", "student", "embed", "lm") if s in sections or pipeline.endswith("distill.py")]
    overrides = {"dtype": "float64", "steps": 3, "data.path": str(demo_data),
                 **{f"sections.{n}.device": "cuda" for n in names}}
    for mode in ("section", "colocated"):
        run_pipeline(str(ROOT / pipeline), RunOptions(overrides=overrides, colocated=mode == "colocated",
                                                      save_dir=str(tmp_path / mode), show_progress=False))
    for s in sections:
        a, b = load_file(tmp_path / "section" / f"{s}.safetensors"), load_file(tmp_path / "colocated" / f"{s}.safetensors")
        for k in a:
            assert (a[k] - b[k]).abs().max().item() <= 1e-8, f"{s}.{k}"
