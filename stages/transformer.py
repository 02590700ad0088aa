"""The GPT-style causal transformer used by the stages: its config and its torch modules.

Owns the architecture (token embedding, learned positions, pre-norm blocks of causal
self-attention and MLP, final LayerNorm, LM head) and the config record that sizes it. Knows
nothing of stages, micro-batches, initialisation or checkpoints (see `weights.py`).

Padding is on the right and attention is causal, so a real position never sees a pad position:
a sample's results do not depend on the other samples of its micro-batch. The encoders reuse
`Block` with bidirectional attention and a key-padding mask for the same guarantee.

Tensor parallelism (`block_tp_plan`): the fused `qkv` projection's outputs are head-major — per
head its q, k and v rows — so sharding it by output rows ("colwise") gives each rank whole heads,
and attention runs on the heads it holds; `proj` takes the heads' outputs sharded ("rowwise") and
all-reduces. The MLP shards its hidden units the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maestro_flow.config import is_number
from stages.common import check_keys


@dataclass(frozen=True, kw_only=True, slots=True)
class LMConfig:
    """Sizes of a causal LM plus where its weights come from.

    `init_seed`: draw every weight from a generator seeded by it (same weights in any process);
    `checkpoint`: a .safetensors file with the weights (keys as in the model's state_dict).
    """

    vocab_size: int = 260
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    max_seq_len: int = 256
    dropout: float = 0.0
    init_seed: int | None = None
    checkpoint: str | None = None

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @classmethod
    def token_limits(cls, config: dict[str, Any]) -> dict[str, int]:
        """Ids the embedding has, positions the model has (Stage.token_limits); other keys of
        `config` are not looked at (the stage checks them when it is built)."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        return {"vocab_size": int(config.get("vocab_size", defaults["vocab_size"])),
                "max_tokens": int(config.get("max_seq_len", defaults["max_seq_len"]))}

    @classmethod
    def from_dict(cls, config: dict[str, Any], *, where: str = "", ignore: tuple[str, ...] = ()) -> LMConfig:
        """Build from a stage config; `where` prefixes key names in errors (e.g. "student.")."""
        names = {f.name for f in dataclasses.fields(cls)}
        check_keys(config, names | set(ignore), where)
        lm = cls(**{k: v for k, v in config.items() if k in names})
        lm.validate(where)
        return lm

    def validate(self, where: str = "") -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}{key} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"{where}d_model ({self.d_model}) must be divisible by {where}n_heads ({self.n_heads})")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or isinstance(self.d_ff, bool) or self.d_ff < 1):
            raise ValueError(f"{where}d_ff must be an integer >= 1 or None, got {self.d_ff!r}")
        if not is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{where}dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.init_seed is not None and (not isinstance(self.init_seed, int) or isinstance(self.init_seed, bool)):
            raise ValueError(f"{where}init_seed must be an integer or None, got {self.init_seed!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention; causal by default, bidirectional with `causal=False` (encoders).

    `key_padding_mask` [B, T] (True at real positions) hides pad keys: needed where attention is
    bidirectional, since a real query would otherwise see the pads that follow it.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float, *, causal: bool = True) -> None:
        super().__init__()
        self.n_heads, self.dropout, self.causal = n_heads, dropout, causal
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)  # head-major outputs: [head][q, k, v][head_dim]
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # all of them, or this rank's share under tensor parallelism
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        mask = None
        if key_padding_mask is not None:
            mask = key_padding_mask[:, None, None, :]
            if self.causal:
                mask = mask & torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim)))


def block_tp_plan(prefix: str) -> dict[str, str]:
    """The tensor-parallel plan of the `Block`s in the ModuleList named `prefix` (as in state_dict)."""
    return {f"{prefix}.*.attn.qkv": "colwise", f"{prefix}.*.attn.proj": "rowwise",
            f"{prefix}.*.mlp.fc_in": "colwise", f"{prefix}.*.mlp.fc_out": "rowwise"}


def check_block_tp(n_heads: int, d_ff: int, tp: int, where: str = "") -> None:
    """Whole heads and hidden units per rank; `where` prefixes the config keys in the message."""
    if n_heads % tp:
        raise ValueError(f"{where}n_heads ({n_heads}) is not divisible by tp={tp}: each rank takes whole heads")
    if d_ff % tp:
        raise ValueError(f"{where}d_ff ({d_ff}) is not divisible by tp={tp}")


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, d_ff)
        self.fc_out = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x)).

    Causal by default (the decoder's); `causal=False` gives the bidirectional block of the
    vision/audio encoders, which then take a `key_padding_mask` (see CausalSelfAttention).
    """

    def __init__(self, cfg: LMConfig, *, causal: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.dropout, causal=causal)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.ff_dim, cfg.dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), key_padding_mask)
        return x + self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    """Everything between token embeddings and the LM head: positions, blocks, final norm."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Token embeddings [B, T, D] (right-padded) -> final hidden states [B, T, D]."""
        t = x.shape[1]
        if t > self.pos_emb.num_embeddings:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.pos_emb.num_embeddings}")
        x = self.drop(x + self.pos_emb(torch.arange(t, device=x.device)))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class CausalTransformer(nn.Module):
    """Token embedding + Decoder + LM head (untied, no bias)."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.decoder = Decoder(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def hidden(self, ids: Tensor) -> Tensor:
        """Token ids [B, T] -> final hidden states [B, T, D] (after the final norm)."""
        return self.decoder(self.tok_emb(ids))

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.hidden(ids))
