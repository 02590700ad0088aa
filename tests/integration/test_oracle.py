"""Section mode, colocated mode and the monolithic baseline against a plain single-process PyTorch
loop (tests/integration/oracle.py).

float64, AdamW with weight decay, a warmup + decay lr schedule per section and global gradient
clipping active on every step. The distillation case crosses a fan-out; the VLM cases use a
trainable vision encoder that outputs its second-to-last block (LLaVA's feature layer -2, so
its last block and final norm never get a gradient) and a first global batch with no image at
all: parameters without a gradient must be left exactly as `torch.optim` leaves them.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.run import RunOptions, run_pipeline
from tests.integration import oracle
from tests.integration.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOL = 1e-10


MODES = ("section", "colocated", "monolithic")


def run_modes(pipeline: str, overrides: dict, tmp_path, modes=MODES) -> dict:
    """Each mode's metrics rows and --save-dir; "monolithic" is the Megatron-style baseline on 3
    data-parallel ranks (an uneven share of the global batch for some of them)."""
    out = {}
    for mode in modes:
        save = tmp_path / mode
        baseline = {"baseline": "monolithic", "devices": 3} if mode == "monolithic" else {}
        rows = run_pipeline(str(ROOT / pipeline), RunOptions(overrides=overrides, colocated=mode == "colocated",
                                                             save_dir=str(save), show_progress=False, **baseline))
        out[mode] = (rows, save)
    return out


def assert_matches_oracle(result: oracle.Result, save_dir, sections) -> None:
    for section in sections:
        saved = load_file(save_dir / f"{section}.safetensors")
        expected = result.states[section]
        assert saved, section
        for key, value in saved.items():
            diff = (value - expected[key]).abs().max().item()
            assert diff <= TOL, f"{section}.{key}: max abs difference {diff} from the plain PyTorch loop"


def assert_metrics_match(rows, result: oracle.Result, sections) -> None:
    """Loss, pre-clip norm and each section's lr (the monolithic baseline reports its one
    section, "model", whose lr is its first section's)."""
    for step, row in enumerate(rows):
        assert row["loss"] == pytest.approx(result.losses[step], rel=1e-12)
        assert row["grad_norm"] == pytest.approx(result.grad_norms[step], rel=1e-9)
        for s in sections:
            reported = row["sections"]["model"] if "model" in row["sections"] else row["sections"][s]
            if s == sections[0] or "model" not in row["sections"]:
                assert reported["lr"] == pytest.approx(result.lrs[s][step], rel=1e-12)


DISTILL = {
    "dtype": "float64", "steps": 4, "global_batch": 8, "data.shuffle": False, "grad_clip": 0.05,
    "sections.student.config.student.init_seed": 5,
    "sections.student.optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 2,
                                   "decay": "cosine", "min_lr": 3e-4},
}


def test_distillation_equals_a_plain_pytorch_loop(demo_data, tmp_path):
    overrides = {**DISTILL, "data.path": str(demo_data)}
    pipeline, _ = load_pipeline(str(ROOT / "pipelines/distill.py"), overrides)
    expected = oracle.train(pipeline, pipeline.steps)
    assert all(n > DISTILL["grad_clip"] for n in expected.grad_norms), "clipping must be active on every step"
    for _mode, (rows, save) in run_modes("pipelines/distill.py", overrides, tmp_path).items():
        assert_matches_oracle(expected, save, ["student"])
        assert_metrics_match(rows, expected, ["student"])
        saved = load_file(save / "student.safetensors")
        assert not any(k.startswith("teacher_head.") for k in saved), "frozen parameters are not saved"
        assert json.loads((save / "pipeline.json").read_text())["name"] == "distill"


@pytest.fixture(scope="module")
def vlm_text_first(tmp_path_factory):
    """vlm demo rows with the first 12 (one global batch) text-only, then the rest in order."""
    from loaders.demo import image_demo_table, write_arrow

    table = image_demo_table(num_samples=48, image_share=0.5, seed=3)
    has_image = [("image" in m) for m in table.column("modalities").to_pylist()]
    text_rows = [i for i, h in enumerate(has_image) if not h]
    first = text_rows[:12]
    order = first + [i for i in range(len(has_image)) if i not in first]
    return write_arrow(table.take(pa.array(order)), tmp_path_factory.mktemp("vlm-text-first") / "vlm.arrow")


def vlm_overrides(data, **more) -> dict:
    return {
        "dtype": "float64", "steps": 3, "global_batch": 12, "data.path": str(data), "data.shuffle": False,
        "grad_clip": 0.2,
        "sections.vision.config.feature_layer": -2,
        "sections.vision.optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "warmup_steps": 1,
                                      "decay": "linear", "min_lr": 1e-4},
        "sections.llm.optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "decay": "cosine"},
        **more,
    }


@pytest.mark.parametrize("layout", [
    {"sections.vision.micro_batch": 3, "sections.llm.micro_batch": 2},  # vision dp1 -> llm dp2
    {"sections.vision.dp": 2, "sections.vision.micro_batch": 2, "sections.llm.micro_batch": 4},  # 2 -> 2
], ids=["vision1-llm2", "vision2-llm2"])
def test_vlm_equals_a_plain_pytorch_loop_with_unused_layers_and_an_imageless_step(vlm_text_first, tmp_path, layout):
    overrides = vlm_overrides(vlm_text_first, **layout)
    pipeline, _ = load_pipeline(str(ROOT / "pipelines/vlm.py"), overrides)
    expected = oracle.train(pipeline, pipeline.steps)
    initial = expected.initial["vision"]
    unused = [k for k in initial if k.startswith(("encoder.trunk.blocks.1.", "encoder.trunk.norm."))]
    assert unused
    for key in unused:  # the oracle's own semantics: never stepped, so never decayed
        assert torch.equal(expected.states["vision"][key], initial[key])
    for mode, (rows, save) in run_modes("pipelines/vlm.py", overrides, tmp_path).items():
        if mode != "monolithic":
            assert rows[0]["sections"]["vision"]["samples"] == 0  # step 0: not one image in the global batch
        assert_matches_oracle(expected, save, ["vision", "llm"])
        assert_metrics_match(rows, expected, ["vision", "llm"])
        saved = load_file(save / "vision.safetensors")
        for key in unused:
            assert torch.equal(saved[key], initial[key]), f"{key} has no gradient yet moved"


def test_two_students_of_one_teacher_equal_a_plain_loop_each_a_mean_of_its_own(demo_data, tmp_path):
    """Two loss sections: each student's gradients are its own loss's mean over the global batch
    (the runtime's rule, and now the oracle's: before, the oracle divided the sum of both losses
    by the sum of both denominators, which no test had tried)."""
    from pipelines.distill import STUDENT, TEACHER

    student = {"student": {**STUDENT, "init_seed": 5}, "teacher": TEACHER, "temperature": 2.0, "alpha": 0.5}
    twin = {**student, "student": {**STUDENT, "d_model": 32, "init_seed": 6}}
    optimizer = {"name": "sgd", "lr": 0.05, "momentum": 0.9}  # AdamW would hide a gradient scale
    (tmp_path / "two_students.py").write_text(
        "from maestro_flow import ArrowData, Edge, Pipeline, Section\n\n"
        "def pipeline(**overrides):\n"
        "    return Pipeline(name='two_students', data=ArrowData(path='data/demo/text.arrow'), global_batch=8,\n"
        "        steps=3, seed=0, sections=[\n"
        f"        Section(name='teacher', stage='stages.lm:CausalLM', config={TEACHER!r}, trainable=False,\n"
        "                micro_batch=4),\n"
        f"        Section(name='student', stage='stages.distill:KDStudent', config={student!r}, dp=2,\n"
        f"                micro_batch=2, optimizer={optimizer!r}),\n"
        f"        Section(name='twin', stage='stages.distill:KDStudent', config={twin!r}, micro_batch=3,\n"
        f"                optimizer={optimizer!r})],\n"
        "        edges=[Edge(src='teacher', dst='student', tensors=('hidden',)),\n"
        "               Edge(src='teacher', dst='twin', tensors=('hidden',))]).override(**overrides)\n")
    overrides = {"dtype": "float64", "data.shuffle": False, "data.path": str(demo_data)}
    pipeline, _ = load_pipeline(str(tmp_path / "two_students.py"), overrides)
    expected = oracle.train(pipeline, pipeline.steps)
    for mode in ("section", "colocated"):
        save = tmp_path / mode
        rows = run_pipeline(str(tmp_path / "two_students.py"), RunOptions(
            overrides=overrides, colocated=mode == "colocated", save_dir=str(save), show_progress=False))
        assert_matches_oracle(expected, save, ["student", "twin"])
        for step, row in enumerate(rows):
            assert row["loss"] == pytest.approx(expected.losses[step], rel=1e-12)


def test_a_float_sent_beside_a_trained_output_needs_no_gradient(demo_data, tmp_path):
    """A producer may send a float that needs no gradient (a weight read from the data) on an
    edge its consumer trains through: the gradient flows back through the trained output only,
    and every mode equals the plain loop (before, the producer's backward failed: "element 1 of
    tensors does not require grad")."""
    from tests.integration.conftest import ASSETS

    overrides = {"dtype": "float64", "steps": 2, "data.path": str(demo_data), "data.shuffle": False}
    pipeline, _ = load_pipeline(str(ASSETS / "weighted.py"), overrides)
    expected = oracle.train(pipeline, pipeline.steps)
    for _mode, (rows, save) in run_modes(str(ASSETS / "weighted.py"), overrides, tmp_path,
                                          modes=("section", "colocated")).items():
        assert_matches_oracle(expected, save, ["embed", "head"])
        assert_metrics_match(rows, expected, ["embed", "head"])


def test_image_and_audio_encoders_feeding_one_llm_equal_a_plain_loop(tmp_path):
    """Both encoders trainable, each running only for its modality's samples (a sample with both
    waits for both): section mode and the monolithic baseline equal the plain loop, clipping over
    the three sections' gradients together."""
    from loaders.demo import build_multimodal_demo

    data = build_multimodal_demo(tmp_path / "mm", num_samples=32)
    overrides = {"dtype": "float64", "steps": 3, "global_batch": 8, "data.path": str(data), "data.shuffle": False,
                 "grad_clip": 0.2, "sections.vision.trainable": True, "sections.audio.trainable": True,
                 "sections.vision.optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                 "sections.audio.optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "warmup_steps": 1}}
    pipeline, _ = load_pipeline(str(ROOT / "pipelines/multimodal.py"), overrides)
    expected = oracle.train(pipeline, pipeline.steps)
    modalities = pa.ipc.open_file(pa.memory_map(str(data))).read_all().slice(0, 24)
    assert modalities.column("audio").null_count < 24 and modalities.column("image").null_count < 24
    for _mode, (rows, save) in run_modes("pipelines/multimodal.py", overrides, tmp_path,
                                          modes=("section", "monolithic")).items():
        assert_matches_oracle(expected, save, ["vision", "audio", "llm"])
        assert_metrics_match(rows, expected, ["vision", "audio", "llm"])
