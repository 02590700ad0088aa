"""A causal LM cut into two trainable sections, so that gradients cross an edge.

`TokenEmbedding` (section 1) maps tokens to per-sample embeddings and sends them; `TransformerLM`
(section 2) runs the Decoder and LM head of transformer.py on the received embeddings and returns
the next-token CE sum. The runtime carries the gradient of "embeddings" back to section 1.

Both take the LMConfig keys (one model config can be shared by the two sections). Parameters are
named as in `CausalLM` ("tok_emb.", "decoder.", "head."), so with the same `init_seed` or
`checkpoint` the pair computes exactly what one CausalLM computes. Knows nothing of transfers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from maestro_flow import MicroBatch, Stage, StageContext
from stages.common import (
    Outputs,
    ce_sum,
    lengths_of,
    loss_outputs,
    module_device,
    next_token_targets,
    pad_right,
    select_predicted,
)
from stages.transformer import Decoder, LMConfig, block_tp_plan, check_block_tp
from stages.weights import check_checkpoint_file, init_weights, load_weights


def _weighted(module: nn.Module, cfg: LMConfig, prefix: str) -> nn.Module:
    init_weights(module, seed=cfg.init_seed, n_layers=cfg.n_layers, prefix=prefix)
    if cfg.checkpoint is not None:
        load_weights(module, cfg.checkpoint, prefix=prefix)
    return module


class TokenEmbedding(Stage):
    """Outputs "embeddings": one [T_i, d_model] tensor per sample (trainable)."""

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.model_config = LMConfig.from_dict(config)
        cfg = self.model_config
        self.tok_emb = _weighted(nn.Embedding(cfg.vocab_size, cfg.d_model), cfg, "tok_emb.")

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        check_checkpoint_file(LMConfig.from_dict(config).checkpoint, "checkpoint")

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("embeddings",)

    @classmethod
    def output_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        return {"embeddings": (LMConfig.from_dict(config).d_model, "d_model")}

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ()

    def forward(self, batch: MicroBatch) -> Outputs:
        tokens = batch.columns["tokens"]
        ids = torch.cat(list(tokens)).to(device=module_device(self.tok_emb), dtype=torch.int64)
        return {"embeddings": list(self.tok_emb(ids).split(lengths_of(tokens)))}


class TransformerLM(Stage):
    """Receives "embeddings"; outputs the next-token CE "loss" sum and "loss_denominator"."""

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.model_config = LMConfig.from_dict(config)
        cfg = self.model_config
        self.decoder = _weighted(Decoder(cfg), cfg, "decoder.")
        self.head = _weighted(nn.Linear(cfg.d_model, cfg.vocab_size, bias=False), cfg, "head.")

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        check_checkpoint_file(LMConfig.from_dict(config).checkpoint, "checkpoint")

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("loss", "loss_denominator")

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("embeddings",)

    @classmethod
    def input_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        return {"embeddings": (LMConfig.from_dict(config).d_model, "d_model")}

    @classmethod
    def tp_plan(cls, config: dict[str, Any]) -> dict[str, str]:
        return block_tp_plan("decoder.blocks")

    @classmethod
    def check_tp(cls, config: dict[str, Any], tp: int) -> None:
        cfg = LMConfig.from_dict(config)
        check_block_tp(cfg.n_heads, cfg.ff_dim, tp)

    def forward(self, batch: MicroBatch) -> Outputs:
        tokens = batch.columns["tokens"]
        embeddings = batch.inputs.get("embeddings")
        if embeddings is None:
            raise ValueError("TransformerLM needs the input tensor 'embeddings' (an edge from TokenEmbedding)")
        d_model = self.model_config.d_model
        for sample_id, e, t in zip(batch.sample_ids, embeddings, tokens, strict=True):
            if e is None or tuple(e.shape) != (t.shape[0], d_model):
                got = None if e is None else tuple(e.shape)
                raise ValueError(f"sample {sample_id}: 'embeddings' must be [{t.shape[0]}, {d_model}], got {got}")
        device = module_device(self.head)
        lengths = lengths_of(tokens)
        hidden = self.decoder(pad_right([e.to(device) for e in embeddings], 0.0))
        logits = self.head(select_predicted(hidden, lengths))
        targets = next_token_targets(tokens, device)
        return loss_outputs(ce_sum(logits, targets), targets.numel())
