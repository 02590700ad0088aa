"""CUDA sections (distill, chain, and the VLM on precomputed pixels): NCCL tensor channels and DP
reduction (gloo staged through the host where ranks share a GPU or an edge joins a CPU section),
checked against the colocated reference: the same losses and every trainable parameter within
1e-8 (float64, 3 steps).

Skipped without CUDA (CI has no GPU). Needs at least one GPU; with one GPU all replicas share it
(tensors between them go by CUDA IPC).
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import PIXEL_VLM, write_pixel_vlm
from tests.integration.test_equivalence import section_equals_colocated

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from loaders.demo import build_text_demo

    return build_text_demo(tmp_path_factory.mktemp("demo"), num_samples=128, parquet=False)


@pytest.mark.parametrize("pipeline,names,trainable", [("pipelines/distill.py", ["teacher", "student"], ["student"]),
                                                      ("pipelines/chain.py", ["embed", "lm"], ["embed", "lm"])])
def test_cuda_section_mode_matches_colocated(demo_data, tmp_path, pipeline, names, trainable):
    """Every section on CUDA."""
    section_equals_colocated(pipeline, demo_data, tmp_path, trainable,
                             **{f"sections.{n}.device": "cuda" for n in names})


def test_cuda_vlm_matches_colocated(tmp_path):
    """The VLM (trainable encoder, dp 1, feeding an LLM at dp 2) on CUDA, images as precomputed
    pixels so that no decoder (DALI) is needed."""
    rows, _ = section_equals_colocated("pipelines/vlm.py", write_pixel_vlm(tmp_path / "px.arrow"), tmp_path,
                                       ["vision", "llm"], **PIXEL_VLM,
                                       **{"sections.vision.device": "cuda", "sections.llm.device": "cuda"})
    assert sum(r["sections"]["vision"]["samples"] for r in rows) > 0


def student_matches_colocated(demo_data, tmp_path, **sets):
    section_equals_colocated("pipelines/distill.py", demo_data, tmp_path, ["student"], **sets)


@pytest.mark.parametrize("devices", [
    {"teacher": "cpu", "student": "cuda"},  # a CPU section's edge into CUDA: staged through pinned host memory
    {"teacher": "cuda", "student": "cpu"},
], ids=["cpu-to-cuda", "cuda-to-cpu"])
def test_edges_between_cpu_and_cuda_sections(demo_data, tmp_path, devices):
    student_matches_colocated(demo_data, tmp_path, **{f"sections.{n}.device": d for n, d in devices.items()})


def test_a_tensor_parallel_student_on_cuda(demo_data, tmp_path):
    """tp=2 and FSDP on CUDA: with one GPU the ranks share it (gloo, staged), with more NCCL."""
    student_matches_colocated(demo_data, tmp_path, **{
        "sections.teacher.device": "cuda", "sections.student.device": "cuda", "sections.student.tp": 2,
        "sections.student.fsdp": True})


def test_lockstep_fsdp_sections_on_cuda(demo_data, tmp_path):
    """A frozen FSDP teacher and an FSDP student gathering per micro-batch (parallel/fsdp.py), built
    on the CPU and moved to the GPU shard by shard (runtime/worker.py)."""
    student_matches_colocated(demo_data, tmp_path, **{
        "sections.teacher.device": "cuda", "sections.student.device": "cuda", "sections.teacher.dp": 2,
        "sections.teacher.fsdp": True, "sections.student.fsdp": True})
