"""Record and replay on CUDA (distill, every section on CUDA): what `maestro run --record` records
on the GPU replays there to the run's own outputs (`maestro stage --replay --compare`): the
student at dp 2 with dropout (the CUDA RNG state recorded before each forward is restored), the
frozen teacher, and a tp=2 FSDP student, which records no weights and replays with its exported
checkpoint as --weights (with one GPU its groups are gloo).

Skipped without CUDA (CI has no GPU).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import DEVICES
from tests.integration.conftest import maestro

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



def replays(section: str, run_dir, sets: list[str], *more: str) -> str:
    result = maestro("stage", "pipelines/distill.py", section, "--replay", str(run_dir), "--compare", *more, *sets,
                     timeout=200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "MISMATCH" not in result.stdout and "all outputs match the recording" in result.stdout, result.stdout
    return result.stdout


@pytest.mark.parametrize("section", ["student", "teacher"])
def test_a_cuda_sections_recording_replays_on_cuda(demo_data, tmp_path, section):
    sets = ["--set", f"data.path={demo_data}", "--set", "sections.student.config.student.dropout=0.1", *DEVICES]
    run = maestro("run", "pipelines/distill.py", "--quiet", "--steps", "2", "--record", section,
                  "--record-steps", "1", "--run-dir", str(tmp_path), *sets, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = replays(section, tmp_path, sets, "--repeat", "2")
    if section == "student":
        assert "random state: as recorded before each forward" in out


def test_a_sharded_cuda_sections_recording_replays_with_its_checkpoint(demo_data, tmp_path):
    sets = ["--set", f"data.path={demo_data}", "--set", "dtype=float64", "--set", "sections.student.tp=2",
            "--set", "sections.student.fsdp=true", *DEVICES]
    run = maestro("run", "pipelines/distill.py", "--steps", "2", "--quiet", "--record", "student",
                  "--record-steps", "1", "--run-dir", str(tmp_path / "run"), "--checkpoint-dir",
                  str(tmp_path / "ck"), "--checkpoint-every", "1", *sets, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    [step1] = [p for p in (tmp_path / "ck").iterdir() if p.name.endswith("1")]
    export = maestro("export", str(step1), "--section", "student", "-o", str(tmp_path / "ex"))
    assert export.returncode == 0, export.stderr
    replays("student", tmp_path / "run", sets, "--weights", str(tmp_path / "ex" / "student.safetensors"))
