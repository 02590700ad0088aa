"""`CausalLM`: a GPT-style causal LM stage, as a teacher or as a trainable LM.

Owns the mapping from a stage config to a `CausalTransformer` with its weights (seeded or from a
checkpoint), and `build_lm_head`, which rebuilds just the LM head of such a model elsewhere (the KD
student applies the teacher's head in its own section). Knows nothing of grad modes, optimizers or
loss normalisation: the runtime sets the grad mode and divides the loss sum by the global count.

Config keys: `role` ("teacher" or "lm", default "lm") and the `LMConfig` keys (vocab_size,
d_model, n_layers, n_heads, d_ff, max_seq_len, dropout, init_seed, checkpoint).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from maestro_flow import MicroBatch, Stage, StageContext
from stages.common import (
    Outputs,
    ce_sum,
    loss_outputs,
    module_device,
    next_token_targets,
    pad_tokens,
    select_predicted,
    unpad,
)
from stages.transformer import CausalTransformer, LMConfig, block_tp_plan, check_block_tp
from stages.weights import check_checkpoint_file, init_weights, load_weights

ROLES = {"teacher": ("hidden",), "lm": ("loss", "loss_denominator")}
HEAD_PREFIX = "head."


def stage_role(config: dict[str, Any], roles: dict[str, tuple[str, ...]]) -> str:
    role = config.get("role", "lm")
    if role not in roles:
        raise ValueError(f"role must be one of {sorted(roles)}, got {role!r}")
    return role


def build_causal_transformer(cfg: LMConfig) -> CausalTransformer:
    """A CausalTransformer with its weights: from the checkpoint if set, else initialised."""
    model = CausalTransformer(cfg)
    init_weights(model, seed=cfg.init_seed, n_layers=cfg.n_layers)
    if cfg.checkpoint is not None:
        load_weights(model, cfg.checkpoint)
    return model


def lm_head_config(config: dict[str, Any], *, where: str = "") -> LMConfig:
    """The config of a `CausalLM` whose LM head another section rebuilds: it must fix the
    weights (`init_seed` or `checkpoint`)."""
    cfg = LMConfig.from_dict(config, where=where, ignore=("role",))
    if cfg.init_seed is None and cfg.checkpoint is None:
        raise ValueError(
            f"{where}init_seed or {where}checkpoint must be set so that the LM head can be rebuilt "
            "in another section with the same weights"
        )
    return cfg


def build_lm_head(config: dict[str, Any], *, where: str = "") -> nn.Linear:
    """Exactly the LM head a `CausalLM` with this config has, built without the rest of the model.

    The config must fix the weights (`init_seed` or `checkpoint`): otherwise the head would
    depend on the RNG state of whichever process builds it.
    """
    cfg = lm_head_config(config, where=where)
    head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    init_weights(head, seed=cfg.init_seed, n_layers=cfg.n_layers, prefix=HEAD_PREFIX)
    if cfg.checkpoint is not None:
        load_weights(head, cfg.checkpoint, prefix=HEAD_PREFIX)
    return head


class CausalLM(Stage):
    """role "teacher": outputs "hidden", per-sample final hidden states [T_i, d_model];
    role "lm": outputs "loss" (sum of next-token CE over predicted tokens) and "loss_denominator".
    """

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.role = stage_role(config, ROLES)
        self.model_config = LMConfig.from_dict(config, ignore=("role",))
        self.model = build_causal_transformer(self.model_config)

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        stage_role(config, ROLES)
        check_checkpoint_file(LMConfig.from_dict(config, ignore=("role",)).checkpoint, "checkpoint")

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ROLES[stage_role(config, ROLES)]

    @classmethod
    def output_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        return {"hidden": (LMConfig.from_dict(config, ignore=("role",)).d_model, "d_model")}

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ()

    @classmethod
    def token_limits(cls, config: dict[str, Any]) -> dict[str, int]:
        return LMConfig.token_limits(config)

    @classmethod
    def tp_plan(cls, config: dict[str, Any]) -> dict[str, str]:
        return block_tp_plan("model.decoder.blocks")

    @classmethod
    def check_tp(cls, config: dict[str, Any], tp: int) -> None:
        cfg = LMConfig.from_dict(config, ignore=("role",))
        check_block_tp(cfg.n_heads, cfg.ff_dim, tp)

    def forward(self, batch: MicroBatch) -> Outputs:
        tokens = batch.columns["tokens"]
        device = module_device(self.model)
        ids, lengths = pad_tokens(tokens, device)
        hidden = self.model.hidden(ids)
        if self.role == "teacher":
            return {"hidden": unpad(hidden, lengths)}
        # The head runs on predicted positions only: no vocab-sized logits for pads or last tokens.
        logits = self.model.head(select_predicted(hidden, lengths))
        targets = next_token_targets(tokens, device)
        return loss_outputs(ce_sum(logits, targets), targets.numel())
