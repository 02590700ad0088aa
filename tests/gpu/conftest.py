"""Shared by the GPU tests: distill's two sections on CUDA, and a small text demo dataset."""

from __future__ import annotations

import pytest

DEVICES = ("--set", "sections.teacher.device=cuda", "--set", "sections.student.device=cuda")


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    """64 demo samples (tests/gpu/test_cuda_sections.py makes its own 128)."""
    from loaders.demo import build_text_demo

    return build_text_demo(tmp_path_factory.mktemp("demo"), num_samples=64, parquet=False)
