"""The reusable stages (stages/lm.py, distill.py, chain.py) against the Stage contract.

Float64 throughout, so that "the same result" can be checked to 1e-10.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from maestro_flow import MicroBatch, StageContext
from stages.chain import TokenEmbedding, TransformerLM
from stages.distill import KDStudent
from stages.lm import CausalLM, build_lm_head

CTX = StageContext(section="x", dtype="float64")
SAMPLES = [[5, 1, 2, 3, 4, 9, 7], [3, 4], [11, 6, 7, 8, 9], [10], [250, 2, 33]]
TEACHER = {"role": "teacher", "init_seed": 7, "d_model": 48, "n_heads": 4, "n_layers": 2}
STUDENT = {"init_seed": 3, "d_model": 32, "n_heads": 2, "n_layers": 1}
ATOL = 1e-10


def make(cls, config):
    stage = cls(config, CTX)
    for module in stage.modules().values():  # what the runtime does after construction
        module.to(torch.float64)
    return stage


def micro_batch(samples, ids=None, **inputs):
    ids = list(range(len(samples))) if ids is None else ids
    return MicroBatch(step=0, index=0, sample_ids=ids, modalities=[frozenset({"text"})] * len(samples),
                      columns={"tokens": [torch.tensor(s, dtype=torch.int64) for s in samples]}, inputs=inputs)


def num_predicted(samples):
    return sum(len(s) - 1 for s in samples)


class Runner:
    """Runs one kind of stage (with its producers, for the receiving stages) on lists of samples."""

    def __init__(self, kind, **kd):
        self.kind = kind
        if kind in ("teacher", "kd"):
            self.teacher = make(CausalLM, TEACHER)
        if kind == "lm":
            self.stage = make(CausalLM, {"role": "lm", **STUDENT})
        elif kind == "kd":
            self.stage = make(KDStudent, {"teacher": TEACHER, "student": STUDENT, **kd})
        elif kind == "chain":
            self.embed = make(TokenEmbedding, STUDENT)
            self.stage = make(TransformerLM, STUDENT)
        elif kind == "teacher":
            self.stage = self.teacher

    def __call__(self, samples):
        if self.kind == "kd":
            # The teacher runs per sample here, so that only the student's batching varies.
            hidden = [self.teacher.forward(micro_batch([s]))["hidden"][0] for s in samples]
            return self.stage.forward(micro_batch(samples, hidden=hidden))
        if self.kind == "chain":
            embeddings = TokenEmbedding.forward(self.embed, micro_batch(samples))["embeddings"]
            return self.stage.forward(micro_batch(samples, embeddings=embeddings))
        return self.stage.forward(micro_batch(samples))


LOSS_KINDS = ["lm", "kd", "chain"]


@pytest.mark.parametrize(("cls", "config", "names"), [
    (CausalLM, {"role": "teacher"}, ("hidden",)),
    (CausalLM, {"role": "lm"}, ("loss", "loss_denominator")),
    (CausalLM, {}, ("loss", "loss_denominator")),
    (KDStudent, {"teacher": {"init_seed": 0}}, ("loss", "loss_denominator")),
    (TokenEmbedding, {}, ("embeddings",)),
    (TransformerLM, {}, ("loss", "loss_denominator")),
])
def test_default_configs_build_and_declare_outputs(cls, config, names):
    assert cls.outputs(config) == names
    stage = make(cls, config)
    inputs = {"hidden": [torch.randn(len(s), 64, dtype=torch.float64) for s in SAMPLES],
              "embeddings": [torch.randn(len(s), 64, dtype=torch.float64) for s in SAMPLES]}
    out = stage.forward(micro_batch(SAMPLES, **inputs))
    assert set(out) == set(names)
    if "hidden" in out:
        assert [tuple(h.shape) for h in out["hidden"]] == [(len(s), 64) for s in SAMPLES]
    if "embeddings" in out:
        assert [tuple(e.shape) for e in out["embeddings"]] == [(len(s), 64) for s in SAMPLES]
    if "loss" in out:
        assert out["loss"].dim() == 0 and out["loss"].requires_grad
        assert int(out["loss_denominator"]) == num_predicted(SAMPLES)


def test_teacher_hidden_does_not_depend_on_micro_batch():
    run = Runner("teacher")
    together = run(SAMPLES)["hidden"]
    for sample, hidden in zip(SAMPLES, together, strict=True):
        alone = run([sample])["hidden"][0]
        torch.testing.assert_close(hidden, alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_loss_is_a_sum_independent_of_micro_batch(kind):
    run = Runner(kind)
    total = run(SAMPLES)
    parts = [run([s]) for s in SAMPLES]
    torch.testing.assert_close(total["loss"], sum(p["loss"] for p in parts), atol=ATOL, rtol=0)
    assert int(total["loss_denominator"]) == sum(int(p["loss_denominator"]) for p in parts)
    halves = run(SAMPLES[:2])["loss"] + run(SAMPLES[2:])["loss"]
    torch.testing.assert_close(total["loss"], halves, atol=ATOL, rtol=0)


def test_lm_loss_is_the_summed_next_token_cross_entropy():
    stage = make(CausalLM, {"role": "lm", **STUDENT})
    out = stage.forward(micro_batch(SAMPLES))
    expected = sum(
        F.cross_entropy(stage.model(torch.tensor([s]))[0, :-1], torch.tensor(s[1:], dtype=torch.int64), reduction="sum")
        for s in SAMPLES
    )
    torch.testing.assert_close(out["loss"], expected, atol=ATOL, rtol=0)
    assert out["loss_denominator"] == num_predicted(SAMPLES)


def test_init_seed_fixes_weights_whatever_the_global_rng():
    torch.manual_seed(1)
    a = CausalLM(STUDENT, CTX).state_dict()
    torch.manual_seed(2)
    b = CausalLM(STUDENT, CTX).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(1)
    c = CausalLM({**STUDENT, "init_seed": None}, CTX).state_dict()
    assert not torch.equal(a["model.head.weight"], c["model.head.weight"])


def test_kd_teacher_head_is_frozen_and_equals_the_teachers():
    teacher = make(CausalLM, TEACHER)
    student = make(KDStudent, {"teacher": TEACHER, "student": STUDENT})
    assert torch.equal(student.teacher_head.weight, teacher.model.head.weight)
    assert torch.equal(build_lm_head(TEACHER).weight.double(), teacher.model.head.weight)
    assert not student.teacher_head.weight.requires_grad
    trainable = [p for p in student.parameters() if p.requires_grad]
    assert all(p is not student.teacher_head.weight for p in trainable)
    assert len(trainable) == len(list(student.model.parameters()))

    hidden = [teacher.forward(micro_batch([s]))["hidden"][0] for s in SAMPLES]
    student.forward(micro_batch(SAMPLES, hidden=hidden))["loss"].backward()
    assert student.teacher_head.weight.grad is None
    assert all(p.grad is not None for p in trainable)


def test_a_saved_kd_student_loads_back_into_the_stage_with_strict_false():
    """Found in QA: --save-dir and export leave the frozen teacher head out, and the stage's strict
    load_state_dict refused such a file ("Missing key(s) ... weight")."""
    from maestro_flow.checkpoint.savedir import trainable_state

    config = {"teacher": TEACHER, "student": STUDENT}
    saved = trainable_state(make(KDStudent, {**config, "student": {**STUDENT, "init_seed": 11}}))
    assert not any(k.startswith("teacher_head.") for k in saved)
    student = make(KDStudent, config)
    with pytest.raises(RuntimeError, match="Missing key"):
        student.load_state_dict(saved)
    student.load_state_dict(saved, strict=False)
    assert all(torch.equal(student.state_dict()[k], v) for k, v in saved.items())


def test_lm_and_head_load_from_checkpoint(tmp_path):
    source = make(CausalLM, {**TEACHER, "init_seed": 99})
    saved_stage = tmp_path / "teacher.safetensors"  # as `maestro run --save-dir` writes it
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(saved_stage))
    plain = tmp_path / "model.safetensors"  # keys as in the model's state_dict
    save_file(source.model.state_dict(), str(plain))
    for path in (saved_stage, plain):
        config = {**TEACHER, "init_seed": None, "checkpoint": str(path)}
        assert torch.equal(build_lm_head(config).weight, source.model.head.weight)
        loaded = make(CausalLM, config)
        assert all(torch.equal(v, source.state_dict()[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ValueError, match="no such file"):
        build_lm_head({"checkpoint": str(tmp_path / "missing.safetensors")})


def test_kd_with_alpha_zero_is_the_students_cross_entropy():
    kd = Runner("kd", alpha=0.0)(SAMPLES)
    lm = Runner("lm")(SAMPLES)
    torch.testing.assert_close(kd["loss"], lm["loss"], atol=ATOL, rtol=0)
    assert kd["loss_denominator"] == lm["loss_denominator"]


def test_kd_student_equal_to_teacher_has_zero_kl():
    student_config = {k: v for k, v in TEACHER.items() if k != "role"}
    stage = make(KDStudent, {"teacher": TEACHER, "student": student_config, "alpha": 1.0})
    teacher = make(CausalLM, TEACHER)
    hidden = teacher.forward(micro_batch(SAMPLES))["hidden"]
    assert abs(stage.forward(micro_batch(SAMPLES, hidden=hidden))["loss"].item()) < 1e-12


def test_kd_loss_matches_a_written_out_reference():
    alpha, temperature = 0.3, 1.5
    run = Runner("kd", alpha=alpha, temperature=temperature)
    out = run(SAMPLES)
    student, head = run.stage.model, run.stage.teacher_head
    expected = 0.0
    for s in SAMPLES:
        ids = torch.tensor([s])
        t_logits = head(run.teacher.model.hidden(ids))[0, :-1]
        s_logits = student(ids)[0, :-1]
        p = torch.softmax(t_logits / temperature, -1)
        q = torch.softmax(s_logits / temperature, -1)
        kl = (p * (p.log() - q.log())).sum() * temperature**2
        ce = -torch.log_softmax(s_logits, -1).gather(1, torch.tensor(s[1:], dtype=torch.int64)[:, None]).sum()
        expected = expected + alpha * kl + (1 - alpha) * ce
    torch.testing.assert_close(out["loss"], expected, atol=1e-9, rtol=0)


def test_kd_config_errors_name_the_key():
    with pytest.raises(ValueError, match="vocab_size"):
        KDStudent({"teacher": {**TEACHER, "vocab_size": 300}, "student": STUDENT}, CTX)
    with pytest.raises(ValueError, match=re.escape("teacher.init_seed or teacher.checkpoint")):
        KDStudent({"teacher": {"role": "teacher"}, "student": STUDENT}, CTX)
    with pytest.raises(ValueError, match="teacher"):
        KDStudent({"student": STUDENT}, CTX)
    with pytest.raises(ValueError, match=re.escape("'student.n_layer'")):
        KDStudent({"teacher": TEACHER, "student": {"n_layer": 2}}, CTX)
    with pytest.raises(ValueError, match="alpha"):
        KDStudent({"teacher": TEACHER, "alpha": 1.5}, CTX)


def test_kd_rejects_missing_or_misshaped_hidden():
    stage = make(KDStudent, {"teacher": TEACHER, "student": STUDENT})
    with pytest.raises(ValueError, match="'hidden'"):
        stage.forward(micro_batch(SAMPLES))
    bad = [torch.zeros(len(s) + 1, 48, dtype=torch.float64) for s in SAMPLES]
    with pytest.raises(ValueError, match="sample 40"):
        stage.forward(micro_batch(SAMPLES, ids=[40, 41, 42, 43, 44], hidden=bad))


def test_config_errors():
    with pytest.raises(ValueError, match="'n_layer'"):
        CausalLM({"n_layer": 2}, CTX)
    with pytest.raises(ValueError, match="role"):
        CausalLM({"role": "student"}, CTX)
    with pytest.raises(ValueError, match="n_heads"):
        CausalLM({"d_model": 30, "n_heads": 4}, CTX)
    with pytest.raises(ValueError, match="max_seq_len"):
        make(CausalLM, {"max_seq_len": 4}).forward(micro_batch(SAMPLES))


def test_chain_equals_one_causal_lm_and_passes_gradients_back():
    single = make(CausalLM, {"role": "lm", **STUDENT})
    embed, lm = make(TokenEmbedding, STUDENT), make(TransformerLM, STUDENT)
    expected = single.forward(micro_batch(SAMPLES))
    expected["loss"].backward()

    sent = embed.forward(micro_batch(SAMPLES))["embeddings"]
    received = [e.detach().requires_grad_() for e in sent]  # what the receiving section holds
    out = lm.forward(micro_batch(SAMPLES, embeddings=received))
    torch.testing.assert_close(out["loss"], expected["loss"], atol=ATOL, rtol=0)
    assert out["loss_denominator"] == expected["loss_denominator"]

    out["loss"].backward()
    assert all(e.grad is not None for e in received)
    # A sample's embeddings matter to its own predictions only; a 1-token sample predicts nothing.
    assert all((e.grad.abs().sum() > 0) == (len(s) > 1) for e, s in zip(received, SAMPLES, strict=True))
    torch.autograd.backward(sent, [e.grad for e in received])  # the runtime's backward over the edge
    torch.testing.assert_close(embed.tok_emb.weight.grad, single.model.tok_emb.weight.grad, atol=ATOL, rtol=0)
    for name, p in lm.decoder.named_parameters():
        q = single.model.decoder.get_parameter(name)
        torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=0)


def test_transformer_lm_rejects_misshaped_embeddings():
    stage = make(TransformerLM, STUDENT)
    bad = [torch.zeros(len(s), 16, dtype=torch.float64) for s in SAMPLES]
    with pytest.raises(ValueError, match="sample 0: 'embeddings'"):
        stage.forward(micro_batch(SAMPLES, embeddings=bad))


def test_the_stage_context_holds_torch_objects():
    ctx = StageContext(section="s", device="cpu", dtype="float64")
    assert ctx.device == torch.device("cpu") and ctx.dtype is torch.float64
    module = torch.nn.Linear(2, 2).to(ctx.device, ctx.dtype)
    assert module.weight.dtype is torch.float64


def test_outputs_are_undeclared_by_default():
    from maestro_flow import Stage

    assert Stage.outputs({}) is None


@pytest.mark.parametrize("feature_layer, used_blocks", [(-1, 2), (-2, 1), (-3, 0)])
def test_an_encoder_feature_layer_leaves_later_layers_without_gradient(feature_layer, used_blocks):
    from stages.vision import VisionEncoder

    config = {"decoder": None, "init_seed": 1, "d_model": 16, "n_heads": 2, "n_layers": 2, "patch": 8,
              "feature_layer": feature_layer}
    stage = VisionEncoder(config, StageContext(section="v"))
    batch = MicroBatch(step=0, index=0, sample_ids=[0], modalities=[frozenset({"image"})], columns={},
                       inputs={"pixels": [torch.rand(3, 8, 16)]})
    stage.forward(batch)["image_embeds"][0].sum().backward()
    got = {name.split(".")[3] for name, p in stage.named_parameters() if "trunk.blocks" in name and p.grad is not None}
    assert got == {str(i) for i in range(used_blocks)}
    norm_has_grad = all(p.grad is not None for n, p in stage.named_parameters() if "trunk.norm" in n)
    assert norm_has_grad == (feature_layer == -1)
    with pytest.raises(ValueError, match="feature_layer must be an integer from -3 to -1"):
        VisionEncoder({**config, "feature_layer": -4}, StageContext(section="v"))
