"""Checkpoints of CUDA sections (distill, every section on CUDA, float64): a run resumed from its
step-2 checkpoint ends bitwise where the uninterrupted run ends, and `maestro export` of the
last checkpoint equals `--save-dir`. For a replicated student at dp 2 with dropout (its CUDA RNG
state matters) and for a tp=2 FSDP student (sharded state through DCP; with one GPU its groups
are gloo, as when saving with --save-dir).

Skipped without CUDA (CI has no GPU).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.gpu.conftest import DEVICES
from tests.integration.conftest import maestro

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



def equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key}: max abs difference {(a[key] - b[key]).abs().max().item()}"


@pytest.mark.parametrize("layout", [(), ("--set", "sections.student.tp=2", "--set", "sections.student.fsdp=true")],
                         ids=["dp2-dropout", "tp2-fsdp"])
def test_a_cuda_run_resumes_bitwise_and_exports_its_save_dir(demo_data, tmp_path, layout):
    def run(*more: str) -> None:
        result = maestro("run", "pipelines/distill.py", "--quiet", "--no-run-dir", "--steps", "4",
                         "--set", f"data.path={demo_data}", "--set", "dtype=float64", "--set", "adapt_costs=false",
                         "--set", "sections.student.config.student.dropout=0.1", *DEVICES, *layout, *more,
                         timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]

    run("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", "--save-dir", str(tmp_path / "straight"))
    run("--resume", str(tmp_path / "ck" / "step-00000002"), "--save-dir", str(tmp_path / "resumed"))
    straight = load_file(tmp_path / "straight" / "student.safetensors")
    equal(load_file(tmp_path / "resumed" / "student.safetensors"), straight)
    result = maestro("export", str(tmp_path / "ck"), "--section", "student", "-o", str(tmp_path / "exported"))
    assert result.returncode == 0, result.stderr
    equal(load_file(tmp_path / "exported" / "student.safetensors"), straight)
