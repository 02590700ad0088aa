"""Section mode equals the colocated reference: every trainable parameter after 3 steps, float64.

Covers fan-out with unequal micro-batch sizes (distill: teacher dp1 mb8 -> student dp2 mb2;
chain: embed dp1 mb4 -> lm dp2 mb3 with gradients crossing the edge), fan-in (embed dp2 -> lm
dp1), and SGD as well as AdamW.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from maestro_flow.runtime.run import RunOptions, run_pipeline
from tests.integration.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def run_both(pipeline: str, data, tmp_path, **overrides):
    overrides = {"dtype": "float64", "steps": 3, "data.path": str(data), **overrides}
    out = {}
    for mode in ("section", "colocated"):
        save = tmp_path / mode
        rows = run_pipeline(str(ROOT / pipeline), RunOptions(overrides=overrides, colocated=mode == "colocated",
                                                             save_dir=str(save), show_progress=False))
        assert [r["step"] for r in rows] == [0, 1, 2]
        out[mode] = (rows, save)
    return out


def section_equals_colocated(pipeline: str, data, tmp_path, trainable: list[str], **overrides):
    """run_both, then the same losses and every `trainable` section's parameters within 1e-8;
    (the section run's metrics rows, its save dir)."""
    out = run_both(pipeline, data, tmp_path, **overrides)
    (s_rows, s_dir), (c_rows, c_dir) = out["section"], out["colocated"]
    assert_same_losses(s_rows, c_rows)
    assert_same_parameters(s_dir, c_dir, trainable)
    return s_rows, s_dir


def assert_same_parameters(a_dir, b_dir, sections):
    for section in sections:
        a = load_file(a_dir / f"{section}.safetensors")
        b = load_file(b_dir / f"{section}.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == torch.float64
            diff = (a[key] - b[key]).abs().max().item()
            assert diff <= 1e-8, f"{section}.{key}: max abs difference {diff}"


def assert_same_losses(a_rows, b_rows):
    for a, b in zip(a_rows, b_rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-10)
        assert a["samples"] == b["samples"] and a["tokens"] == b["tokens"]


def test_distill_section_mode_matches_colocated(demo_data, tmp_path):
    _, s_dir = section_equals_colocated("pipelines/distill.py", demo_data, tmp_path, ["student"])
    assert not (s_dir / "teacher.safetensors").exists()  # frozen sections are not saved


@pytest.mark.parametrize("overrides", [
    {},  # fan-out 2, micro-batches 4 -> 3, AdamW
    {"sections.embed.dp": 2, "sections.lm.dp": 1, "sections.embed.micro_batch": 2, "sections.lm.micro_batch": 5,
     "sections.embed.optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},  # fan-in 2, SGD
], ids=["fanout-adamw", "fanin-sgd"])
def test_chain_gradients_cross_the_edge(demo_data, tmp_path, overrides):
    _, s_dir = section_equals_colocated("pipelines/chain.py", demo_data, tmp_path, ["embed", "lm"], **overrides)
    # The embedding really trained: gradients crossed the edge.
    init = load_file(s_dir / "embed.safetensors")["tok_emb.weight"]
    assert init.abs().sum() > 0


def test_hugging_face_teacher_and_student(demo_data, tmp_path):
    """The transformers adapter works as teacher and as KD student across sections."""
    teacher = {"role": "teacher", "init_seed": 3, "hf_config": {"n_layer": 1, "n_embd": 32, "n_head": 2}}
    student = {"role": "kd_student", "teacher": {k: v for k, v in teacher.items() if k != "role"},
               "hf_config": {"n_layer": 1, "n_embd": 32, "n_head": 2}}
    section_equals_colocated("pipelines/distill.py", demo_data, tmp_path, ["student"], **{
        "sections.teacher.stage": "stages.hf:HFCausalLM", "sections.teacher.config": teacher,
        "sections.student.stage": "stages.hf:HFCausalLM", "sections.student.config": student})


def test_replicas_without_samples_still_join_the_step(demo_data, tmp_path):
    """3 samples over 4 LM replicas: replica 3 gets nothing every step and must not hang it."""
    s_rows, _ = section_equals_colocated("pipelines/chain.py", demo_data, tmp_path, ["embed", "lm"], global_batch=3,
                                         **{"sections.lm.dp": 4})
    assert all(r["sections"]["lm"]["samples"] == 3 for r in s_rows)


def test_parquet_data_trains_like_arrow(demo_data, tmp_path):
    from loaders.demo import build_text_demo

    parquet = build_text_demo(tmp_path / "pq", num_samples=256, parquet=True).with_suffix(".parquet")
    rows = {}
    for name, path in (("arrow", demo_data), ("parquet", parquet)):
        rows[name] = run_pipeline(str(ROOT / "pipelines/distill.py"), RunOptions(
            overrides={"steps": 2, "data.path": str(path), "dtype": "float64"}, show_progress=False))
    assert_same_losses(rows["arrow"], rows["parquet"])
