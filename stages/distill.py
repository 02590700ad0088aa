"""Knowledge distillation: `KDStudent`, and the KD loss pieces `HFCausalLM` reuses.

Why the teacher's LM head lives in the student section: the teacher section sends its final
hidden states ([T, d_teacher] per sample), not its logits ([T, vocab]); with a large vocabulary
that is far less traffic (250K vocab vs 4K hidden: 62.5x). The student section rebuilds the
teacher's head — frozen, with the same weights, from the teacher's config (`init_seed` or
`checkpoint`) — and turns the received hidden states into teacher logits itself.

Owns the KD loss: alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE, summed over the
predicted tokens. Knows nothing of how the teacher ran (the runtime ran it without grad) nor of
the global normalisation (the runtime divides the sum by the global count of predicted tokens).

KDStudent config keys: `student` (the student's LMConfig keys, see lm.py), `teacher` (the teacher
section's model config: CausalLM keys, or HFCausalLM keys with `model_type`/`hf_config`),
`temperature` (default 2.0), `alpha` (default 0.5).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from maestro_flow import MicroBatch, Stage, StageContext
from maestro_flow.config import is_number
from stages.common import (
    Outputs,
    ce_sum,
    check_keys,
    concat_predicted,
    kl_sum,
    loss_outputs,
    module_device,
    next_token_targets,
    pad_tokens,
    select_predicted,
)
from stages.encoder import load_class
from stages.lm import build_causal_transformer, build_lm_head, lm_head_config
from stages.transformer import LMConfig, block_tp_plan, check_block_tp
from stages.weights import check_checkpoint_file

KD_OUTPUTS = ("loss", "loss_denominator")


@dataclass(frozen=True, kw_only=True, slots=True)
class KDConfig:
    """How the student's loss mixes distillation and cross-entropy."""

    temperature: float = 2.0
    alpha: float = 0.5

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> KDConfig:
        """The KD keys of a student's config, which must also name its teacher (`teacher`)."""
        if "teacher" not in config:
            raise ValueError("teacher must be set to the teacher section's model config (init_seed or checkpoint)")
        kd = cls(**{f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config})
        if not is_number(kd.temperature) or not 0 < kd.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number > 0, got {kd.temperature!r}")
        if not is_number(kd.alpha) or not 0.0 <= kd.alpha <= 1.0:
            raise ValueError(f"alpha must be a number in [0, 1], got {kd.alpha!r}")
        return kd


KD_KEYS = tuple(f.name for f in dataclasses.fields(KDConfig))


def is_hf_config(config: dict[str, Any]) -> bool:
    """Whether a model config describes an HFCausalLM (it names `model_type` or `hf_config`)."""
    return "model_type" in config or "hf_config" in config


def build_teacher_head(config: dict[str, Any], *, where: str = "teacher.") -> nn.Linear:
    """The teacher's LM head, frozen (requires_grad=False: the optimizer never sees it)."""
    if is_hf_config(config):
        from stages.hf import build_hf_lm_head  # transformers is imported only when used

        head = build_hf_lm_head(config, where=where)
    else:
        head = build_lm_head(config, where=where)
    return head.requires_grad_(False)


class HeadShape(NamedTuple):
    width: int  # the hidden states it reads
    width_key: str  # the config key that sets the width
    vocab: int


def teacher_head_shape(config: Any, *, where: str = "teacher.") -> HeadShape:
    """The shape of the teacher head `config` describes, checked as build_teacher_head checks it,
    without building it (for Stage.check_config and input_widths: a Hugging Face teacher's model
    is built on the meta device only, for its head's width)."""
    if not isinstance(config, dict):  # found in a read-through: the check skipped it, __init__ refused it
        raise ValueError(f"{where.rstrip('.')} must be a mapping of config keys (the teacher section's model "
                         f"config), got {config!r}")
    check_checkpoint_file(config.get("checkpoint"), f"{where}checkpoint")
    if not is_hf_config(config):
        cfg = lm_head_config(config, where=where)
        return HeadShape(cfg.d_model, f"{where}d_model", cfg.vocab_size)
    from stages.hf import hf_head_config, hidden_width  # transformers is imported only when used

    hf_config = hf_head_config(config, where=where)
    width, key = hidden_width(hf_config, where)
    return HeadShape(width, where + key, hf_config.vocab_size)


# Transformers config fields a model's weights do not depend on: dropout and runtime flags.
NOT_WEIGHTS = ("pdrop", "dropout", "use_cache", "output_", "return_dict", "torchscript", "transformers_version",
               "attn_implementation", "dtype")


def _teacher_kind(stage: str) -> bool | None:
    """Whether the stage named `stage` ("module:Class") builds its model as a CausalLM (False) or
    an HFCausalLM (True), as that class or a subclass keeping its __init__; None for any other."""
    from stages.hf import HFCausalLM  # transformers itself is imported only when used
    from stages.lm import CausalLM

    try:
        cls = load_class(stage, "stage")
    except ValueError:  # the pipeline's checks refuse it, naming it
        return None
    for base, hf in ((CausalLM, False), (HFCausalLM, True)):
        if isinstance(cls, type) and issubclass(cls, base) and cls.__init__ is base.__init__:
            return hf
    return None


def _head_fields(config: dict[str, Any], hf: bool) -> dict[str, Any]:
    """What the teacher head built from `config` may depend on (build_teacher_head): the weights'
    source (a checkpoint, else init_seed), the sizes and, for a Hugging Face model, what it does
    to its logits (a soft cap, a scale, tied weights) and, drawn from a seed, every other
    transformers config field but dropout and runtime flags (the head is drawn after the rest of
    the model, from one RNG stream; whether such a field changes it, _decides and a build tell)."""
    checkpoint = config.get("checkpoint")
    fields: dict[str, Any] = {"checkpoint": os.path.realpath(checkpoint) if isinstance(checkpoint, str) else checkpoint}
    if checkpoint is None:  # else the weights are read from it
        fields["init_seed"] = config.get("init_seed")
    if not hf:
        cfg = LMConfig.from_dict(config, ignore=("role",))
        return {**fields, "vocab_size": cfg.vocab_size, "d_model": cfg.d_model}
    from stages.hf_model import hf_model_config

    hf_config = hf_model_config(config)[0]
    fields["model_type"] = hf_config.model_type
    fields |= {f"hf_config.{k}": v for k, v in hf_config.to_dict().items()
               if not k.startswith("_") and not any(n in k for n in NOT_WEIGHTS)
               and (checkpoint is None or _decides(f"hf_config.{k}"))}
    return fields


def _decides(key: str) -> bool:
    """Whether a difference in this _head_fields key makes another head, whatever a build shows:
    the weights' source, the model, the vocabulary, and what the head does to its logits
    (gemma2's final_logit_softcapping: found in QA, not compared with a checkpoint; by name, not
    by a "logit" in it: attn_logit_softcapping is the attention's, found in review)."""
    return key in DECIDING


DECIDING = ("checkpoint", "init_seed", "model_type", "hf_config.vocab_size", "hf_config.tie_word_embeddings",
            "hf_config.final_logit_softcapping", "hf_config.logit_scale", "hf_config.logits_scaling")
SIZES = ("size", "dim", "embd", "layer", "head", "inner", "position", "vocab")  # field names that size a model


def check_teacher_sender(config: dict[str, Any], senders: dict[str, Any]) -> None:
    """A KD student's copy of its teacher's config (`teacher`) gives the LM head of the section
    that sends it "hidden", where that section runs one of the bundled LMs. Found in a
    read-through: with `--set sections.teacher.config.init_seed=9` the run went on, its student
    drawing the head from seed 1234: a distillation target no model gives, in silence."""
    sender, teacher = senders.get("hidden"), config.get("teacher")
    hf = None if sender is None or not isinstance(teacher, dict) else _teacher_kind(sender.stage)
    if hf is None:
        return
    there = f"sections.{sender.section}.config"
    if is_hf_config(teacher) != hf:
        if hf:  # found in review: a copy of an HF section that leaves model_type to its default
            raise ValueError(f"teacher describes a CausalLM (it names neither model_type nor hf_config), but section "
                             f"{sender.section!r}, which sends hidden, runs {sender.stage}: give teacher the "
                             f"model_type and hf_config of {there} (model_type defaults to gpt2 there, not here)")
        raise ValueError(f"teacher describes a Hugging Face model (model_type, hf_config), but section "
                         f"{sender.section!r}, which sends hidden, runs {sender.stage}: set teacher to {there}")
    theirs = _head_fields(sender.config, hf)
    if theirs["checkpoint"] is None and theirs["init_seed"] is None:  # found in review: the advice went in a circle
        raise ValueError(f"section {sender.section!r}, which sends hidden, has neither init_seed nor checkpoint: its "
                         f"weights are drawn at random, and no other section can rebuild its LM head; set "
                         f"{there}.init_seed, and this config's teacher.init_seed to the same seed")
    mine = _head_fields(teacher, hf)
    # What decides the head first, then what sizes it (found in review: an epsilon was named
    # beside n_layer, which is what changed the head).
    differ = sorted((k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)),
                    key=lambda k: (not _decides(k), not any(part in k for part in SIZES), k))
    if not differ:
        return
    same = None
    if hf and not _decides(differ[0]):
        from stages.hf import same_lm_head

        same = same_lm_head(teacher, {k: v for k, v in sender.config.items() if k != "role"})
        if same:
            return
    key = differ[0]
    why = (f"the LM head rebuilt from teacher would not be the head section {sender.section!r} has, which sends "
           f"hidden" if same is not None or _decides(key) or not hf else
           "the heads of models over 50M parameters are not built to be compared, so the fields must match")
    raise ValueError(f"teacher.{key} ({mine.get(key)!r}) is not {there}.{key} ({theirs.get(key)!r}): {why}; set "
                     f"teacher to {there}")


def teacher_input_widths(config: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """A KD student reads "hidden" as wide as its copy of the teacher's head (`teacher`) reads."""
    shape = teacher_head_shape(config.get("teacher"))
    return {"hidden": (shape.width, shape.width_key)}


def same_vocab(teacher_vocab: int, student_vocab: int, student_key: str) -> None:
    if teacher_vocab != student_vocab:
        raise ValueError(
            f"teacher.vocab_size ({teacher_vocab}) must equal {student_key} ({student_vocab}): "
            "distillation compares distributions over one vocabulary"
        )


def teacher_logits(teacher_head: nn.Linear, batch: MicroBatch) -> Tensor:
    """The teacher's logits at the predicted positions [N, V], from the received "hidden".

    Computed without grad: the teacher's distribution is a fixed target.
    """
    hidden = batch.inputs.get("hidden")
    if hidden is None:
        raise ValueError("KD student needs the input tensor 'hidden' (an edge from the teacher section)")
    tokens = batch.columns["tokens"]
    for sample_id, h, t in zip(batch.sample_ids, hidden, tokens, strict=True):
        if h is None or h.dim() != 2 or h.shape[0] != t.shape[0]:
            got = None if h is None else tuple(h.shape)
            raise ValueError(f"sample {sample_id}: teacher 'hidden' must be [{t.shape[0]}, d_teacher], got {got}")
    weight = teacher_head.weight
    with torch.no_grad():
        return teacher_head(concat_predicted(hidden).to(device=weight.device, dtype=weight.dtype))


def distillation_outputs(student_logits: Tensor, batch: MicroBatch, teacher_head: nn.Linear,
                         kd: KDConfig) -> Outputs:
    """The KD loss sum over predicted tokens, from the student's logits there [N, V]."""
    targets = next_token_targets(batch.columns["tokens"], student_logits.device)
    # Terms with a zero weight are skipped, so alpha=0 is exactly CE (and needs no teacher input).
    loss = student_logits.new_zeros(())
    if kd.alpha < 1.0:
        loss = loss + (1.0 - kd.alpha) * ce_sum(student_logits, targets)
    if kd.alpha > 0.0:
        loss = loss + kd.alpha * kl_sum(student_logits, teacher_logits(teacher_head, batch), kd.temperature)
    return loss_outputs(loss, targets.numel())


class KDStudent(Stage):
    """A student CausalTransformer trained on the teacher's hidden states (input "hidden")."""

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        check_keys(config, ("student", "teacher", *KD_KEYS))
        self.kd = KDConfig.from_dict(config)
        self.student_config = LMConfig.from_dict(config.get("student", {}), where="student.")
        self.model = build_causal_transformer(self.student_config)
        self.teacher_head = build_teacher_head(config["teacher"])
        same_vocab(self.teacher_head.out_features, self.student_config.vocab_size, "student.vocab_size")

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """What __init__ checks before it builds anything, the teacher's head config included."""
        check_keys(config, ("student", "teacher", *KD_KEYS))
        KDConfig.from_dict(config)
        student = LMConfig.from_dict(config.get("student", {}), where="student.")
        check_checkpoint_file(student.checkpoint, "student.checkpoint")
        same_vocab(teacher_head_shape(config["teacher"]).vocab, student.vocab_size, "student.vocab_size")

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return KD_OUTPUTS

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("hidden",)

    @classmethod
    def input_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        return teacher_input_widths(config)

    @classmethod
    def check_senders(cls, config: dict[str, Any], senders: dict[str, Any]) -> None:
        check_teacher_sender(config, senders)

    @classmethod
    def token_limits(cls, config: dict[str, Any]) -> dict[str, int]:
        return LMConfig.token_limits(config.get("student", {}))

    @classmethod
    def tp_plan(cls, config: dict[str, Any]) -> dict[str, str]:
        return block_tp_plan("model.decoder.blocks")  # the teacher's head stays whole (it is frozen)

    @classmethod
    def check_tp(cls, config: dict[str, Any], tp: int) -> None:
        cfg = LMConfig.from_dict(config.get("student", {}), where="student.")
        check_block_tp(cfg.n_heads, cfg.ff_dim, tp, where="student.")

    def forward(self, batch: MicroBatch) -> Outputs:
        ids, lengths = pad_tokens(batch.columns["tokens"], module_device(self.model))
        logits = self.model.head(select_predicted(self.model.hidden(ids), lengths))
        return distillation_outputs(logits, batch, self.teacher_head, self.kd)
