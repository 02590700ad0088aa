"""`maestro export`: a trained section out of a checkpoint or a --save-dir, and for a Hugging Face
section a folder that transformers loads and generates with (a GPT-2 teacher distilled into a
Llama student, both through stages.hf, built from configs)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.conftest import maestro

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TEACHER = {"role": "teacher", "model_type": "gpt2", "init_seed": 3,
           "hf_config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 260, "n_positions": 256}}
STUDENT = {"role": "kd_student", "model_type": "llama", "init_seed": 4,
           "hf_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "intermediate_size": 64, "vocab_size": 260, "max_position_embeddings": 256},
           "teacher": {k: v for k, v in TEACHER.items() if k != "role"}}


@pytest.fixture(scope="module")
def trained(demo_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-trained")
    result = maestro("run", "pipelines/distill.py", "--quiet", "--no-run-dir", "--steps", "2",
                     "--set", f"data.path={demo_data}", "--save-dir", str(root / "save"),
                     "--checkpoint-dir", str(root / "ck"), "--checkpoint-every", "2",
                     "--set", "sections.teacher.stage=stages.hf:HFCausalLM",
                     "--set", f"sections.teacher.config={json.dumps(TEACHER)}",
                     "--set", "sections.student.stage=stages.hf:HFCausalLM",
                     "--set", f"sections.student.config={json.dumps(STUDENT)}", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.parametrize("source", ["ck", "save"])
def test_a_hugging_face_student_exports_loads_and_generates(trained, tmp_path, source):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    result = maestro("export", str(trained / source), "--section", "student", "-o", str(out))
    assert result.returncode == 0, result.stderr
    saved = load_file(trained / "save" / "student.safetensors")
    exported = load_file(out / "student.safetensors")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)  # the checkpoint holds the same weights
    assert not any(k.startswith("teacher_head.") for k in saved)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    state = model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key.removeprefix("model.")], value), key
    # It computes what the trained stage computes, and generates.
    from maestro_flow import StageContext
    from stages.hf import HFCausalLM

    lm = {k: v for k, v in STUDENT.items() if k != "teacher"}
    stage = HFCausalLM({**lm, "role": "lm"}, StageContext(section="student"))
    stage.load_state_dict({k: v for k, v in saved.items()})
    ids = torch.tensor([[1, 72, 101, 108, 108, 111]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, stage.model(ids).logits, atol=1e-6)
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 10)


def test_exporting_a_frozen_or_unknown_section_is_a_clear_error(trained, tmp_path):
    result = maestro("export", str(trained / "ck"), "--section", "teacher", "-o", str(tmp_path / "t"))
    assert result.returncode == 2
    assert "not a trainable section" in result.stderr and "frozen sections are not saved" in result.stderr
    result = maestro("export", str(tmp_path), "--section", "student", "-o", str(tmp_path / "t"))
    assert result.returncode == 2
    assert "neither a --save-dir with student.safetensors nor a complete checkpoint" in result.stderr
    # A typo, or a frozen section, on a --save-dir; a typo on a checkpoint (before: "neither a
    # --save-dir ... nor a checkpoint", and "frozen sections are not saved" for a typo).
    for source, section, expected in (("save", "studnet", "has no section 'studnet' (sections: teacher, student"),
                                      ("save", "teacher", "frozen sections are not saved"),
                                      ("ck", "studnet", "has no section 'studnet' (sections: teacher, student")):
        result = maestro("export", str(trained / source), "--section", section, "-o", str(tmp_path / "t"))
        assert result.returncode == 2 and expected in result.stderr, (source, section, result.stderr)
    # Found in QA: a file an earlier run left in a --save-dir was exported as the last run's: a
    # section that run froze, or one its pipeline lacks.
    import shutil

    save = tmp_path / "stale"
    shutil.copytree(trained / "save", save)
    shutil.copy(save / "student.safetensors", save / "teacher.safetensors")
    shutil.copy(save / "student.safetensors", save / "audio.safetensors")
    for section, why in (("teacher", "holds it frozen (frozen sections are not saved)"), ("audio", "has no such section")):
        result = maestro("export", str(save), "--section", section, "-o", str(tmp_path / "t"))
        assert result.returncode == 2, result.stderr
        assert (f"--section {section}: {save}/{section}.safetensors is left from an earlier run: the pipeline that "
                f"saved into {save} last (pipeline.json) {why}; it saved: student") in result.stderr, result.stderr


def test_export_names_what_it_wrote_and_why_it_cannot_read(trained, tmp_path):
    import shutil

    out = tmp_path / "out"
    for _ in range(2):  # the second time into the same folder: save_pretrained rewrites every file
        result = maestro("export", str(trained / "save"), "--section", "student", "-o", str(out))
        assert result.returncode == 0, result.stderr
        wrote = sorted(line.rsplit("/", 1)[-1] for line in result.stdout.splitlines() if line.startswith("wrote "))
        assert wrote == ["config.json", "generation_config.json", "model.safetensors", "student.safetensors"], wrote
    broken = tmp_path / "ck"
    shutil.copytree(trained / "ck", broken)
    data_file = next(broken.glob("step-*/student/*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated
    result = maestro("export", str(broken), "--section", "student", "-o", str(tmp_path / "t"))
    assert result.returncode == 2  # refused by the manifest's checksums
    assert f"files is not as saved (checksums in its manifest): student/{data_file.name}: 100 bytes" in result.stderr
    manifest = data_file.parent.parent / "manifest.json"  # one written before checksums were kept: DCP's reader
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "files"}))
    result = maestro("export", str(broken), "--section", "student", "-o", str(tmp_path / "t"))
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert f"cannot read section 'student' ({data_file.parent})" in line and "CheckpointException" not in line, line


def test_a_checkpoint_folder_that_is_also_the_run_dir_exports(trained, tmp_path):
    """--run-dir and --checkpoint-dir the same folder: its pipeline.json is the run's (the
    pipeline under "pipeline"), not a --save-dir's, and the checkpoint is exported."""
    import shutil

    both = tmp_path / "both"
    shutil.copytree(trained / "ck", both)
    (both / "pipeline.json").write_text(json.dumps({"pipeline": {"name": "distill"}, "overrides": {}}))
    result = maestro("export", str(both), "--section", "student", "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    saved = load_file(trained / "save" / "student.safetensors")
    exported = load_file(tmp_path / "out" / "student.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)


def test_a_maestro_stage_exports_its_safetensors(demo_data, tmp_path):
    result = maestro("run", "pipelines/chain.py", "--quiet", "--no-run-dir", "--steps", "1",
                     "--set", f"data.path={demo_data}", "--save-dir", str(tmp_path / "save"))
    assert result.returncode == 0, result.stderr[-2000:]
    result = maestro("export", str(tmp_path / "save"), "--section", "lm", "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["lm.safetensors"]
    a, b = load_file(tmp_path / "save" / "lm.safetensors"), load_file(tmp_path / "out" / "lm.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # A stage importable only where the run started (a module beside the pipeline file): its
    # safetensors file needs no import, so it is still written, with a note on what was not.
    saved = json.loads((tmp_path / "save" / "pipeline.json").read_text())
    for spec in saved["sections"]:
        if spec["name"] == "lm":
            spec["stage"] = "stages_beside_my_pipeline:MyLM"
    (tmp_path / "save" / "pipeline.json").write_text(json.dumps(saved))
    result = maestro("export", str(tmp_path / "save"), "--section", "lm", "-o", str(tmp_path / "elsewhere"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["lm.safetensors"]
    assert "note: sections.lm.stage: cannot import 'stages_beside_my_pipeline:MyLM'" in result.stderr
    assert "no Hugging Face folder written" in result.stderr
