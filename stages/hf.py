"""`HFCausalLM`: the causal-LM roles around a Hugging Face `transformers` model.

Owns building the model from a config alone (no download: `AutoConfig.for_model` then
`AutoModelForCausalLM.from_config`), seeded or from a safetensors checkpoint, and `build_hf_lm_head`,
which rebuilds such a model's LM head for a KD student in another section. The KD loss is the one
in distill.py; padding and loss sums are in common.py. Knows nothing of grad modes or normalisation.

Config keys: `model_type` (default "gpt2"), `hf_config` (kwargs of the transformers config; for
gpt2 small dropout-free defaults apply), `init_seed`, `checkpoint` (keys as in the model's
state_dict), `role`: "teacher" (outputs "hidden": per-sample final hidden states, after gpt2's
ln_f), "lm" (outputs "loss" sum of next-token CE and "loss_denominator"), or "kd_student" (input
"hidden"; keys `teacher`, `temperature`, `alpha` as in KDStudent).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from maestro_flow import MicroBatch, Stage, StageContext
from stages.common import (
    Outputs,
    ce_sum,
    check_keys,
    loss_outputs,
    module_device,
    next_token_targets,
    pad_tokens,
    padding_mask,
    select_predicted,
    unpad,
)
from stages.distill import KD_KEYS, KDConfig, build_teacher_head, check_same_vocab, distillation_outputs
from stages.lm import stage_role
from stages.weights import read_checkpoint

LOSS = ("loss", "loss_denominator")
ROLES = {"teacher": ("hidden",), "lm": LOSS, "kd_student": LOSS}
MODEL_KEYS = ("model_type", "hf_config", "init_seed", "checkpoint")
# Small, dropout-free gpt2 (gpt2's own defaults are 124M parameters with dropout 0.1, and its
# bos/eos ids 50256 would lie outside a small vocabulary).
GPT2_DEFAULTS: dict[str, Any] = {
    "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 260, "n_positions": 256,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None,
}


def build_hf_model(config: dict[str, Any], *, where: str = "") -> nn.Module:
    """The transformers causal LM a config describes, with its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config.get("model_type", "gpt2")
    kwargs = {**(GPT2_DEFAULTS if model_type == "gpt2" else {}), **config.get("hf_config", {})}
    try:
        hf_config = AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}model_type/{where}hf_config: {exc}") from exc
    # Eager attention: exact in float64 and the same kernel on every device.
    seed = config.get("init_seed")
    if seed is None:
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    else:
        # transformers initialises from the global RNG: fork it so the seed fixes the weights
        # without disturbing the runtime's RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    if config.get("checkpoint") is not None:
        load_hf_checkpoint(model, config["checkpoint"])
    return model


def load_hf_checkpoint(model: nn.Module, path: str) -> None:
    """Load a safetensors file into `model`; tied weights (gpt2's lm_head = wte) may be stored once."""
    expected = model.state_dict()
    groups: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        groups.setdefault(tensor.data_ptr(), []).append(key)
    tied = {k for keys in groups.values() if len(keys) > 1 for k in keys}
    state = read_checkpoint(path, expected.keys(), optional=tied)
    for keys in groups.values():
        if not any(k in state for k in keys):
            raise ValueError(f"checkpoint {path!r} lacks {keys[0]!r}")
    # Copy (not assign) so that ties survive; take the checkpoint's precision first.
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=False)


def build_hf_lm_head(config: dict[str, Any], *, where: str = "") -> nn.Linear:
    """Exactly the LM head an HFCausalLM with this config has, as a standalone nn.Linear.

    Builds the whole model to get it (transformers initialises from one RNG stream), which is
    fine for the sizes used here; a very large teacher should be given as a checkpoint.
    """
    if config.get("init_seed") is None and config.get("checkpoint") is None:
        raise ValueError(
            f"{where}init_seed or {where}checkpoint must be set so that the LM head can be rebuilt "
            "in another section with the same weights"
        )
    out = build_hf_model(config, where=where).get_output_embeddings()
    head = nn.Linear(out.in_features, out.out_features, bias=out.bias is not None).to(out.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(out.weight)
        if out.bias is not None:
            head.bias.copy_(out.bias)
    return head


class HFCausalLM(Stage):
    """A transformers causal LM as a teacher, a trainable LM or a KD student (config `role`)."""

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.role = stage_role(config, ROLES)
        kd_keys = ("teacher", *KD_KEYS) if self.role == "kd_student" else ()
        check_keys(config, ("role", *MODEL_KEYS, *kd_keys))
        self.model = build_hf_model(config)
        if self.role == "kd_student":
            if "teacher" not in config:
                raise ValueError("teacher must be set to the teacher section's model config (init_seed or checkpoint)")
            self.kd = KDConfig.from_dict(config)
            self.teacher_head = build_teacher_head(config["teacher"])
            vocab = self.model.get_output_embeddings().out_features
            check_same_vocab(self.teacher_head, vocab, "hf_config.vocab_size")

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ROLES[stage_role(config, ROLES)]

    def forward(self, batch: MicroBatch) -> Outputs:
        tokens = batch.columns["tokens"]
        device = module_device(self.model)
        ids, lengths = pad_tokens(tokens, device)
        mask = padding_mask(lengths, ids.shape[1], device).long()
        if self.role == "teacher":
            # The base model's last hidden state is what the LM head reads (gpt2: after ln_f);
            # running it alone avoids computing vocab-sized logits nobody uses.
            hidden = self.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            return {"hidden": unpad(hidden, lengths)}
        # The full model (not base model + head) so that model-specific logit processing applies.
        logits = select_predicted(self.model(input_ids=ids, attention_mask=mask).logits, lengths)
        if self.role == "kd_student":
            return distillation_outputs(logits, batch, self.teacher_head, self.kd)
        targets = next_token_targets(tokens, device)
        return loss_outputs(ce_sum(logits, targets), targets.numel())
