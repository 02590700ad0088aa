"""Pieces shared by the vision and audio encoders (stages/vision.py, stages/audio.py).

Owns `EncoderConfig` (the trunk's sizes, the optional projector width, the init seed),
`EncoderTrunk` (bidirectional pre-norm `Block`s of transformer.py over right-padded per-sample
sequences, with a key-padding mask, then a final LayerNorm), `ProjectorMLP` (Linear-GELU-Linear to
the LLM width, as in LLaVA-1.5), and two small helpers (seeded construction, "module:Class"
import). Knows nothing of pixels, waveforms, micro-batches or sections.

Why a key-padding mask and no batch norm: a sample's embeddings must not depend on which other
samples share its micro-batch (the planner regroups samples freely), so pads are hidden from
every real query and every normalisation is per position.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stages.common import check_keys, lengths_of, pad_right, padding_mask, unpad
from stages.transformer import Block, LMConfig
from stages.weights import init_weights

M = TypeVar("M", bound=nn.Module)
C = TypeVar("C", bound="EncoderConfig")


def check_int(value: Any, key: str, *, minimum: int = 1, where: str = "", optional: bool = False) -> None:
    """Raise a ValueError naming `key` unless `value` is an int >= minimum (or None if optional)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        tail = " or None" if optional else ""
        raise ValueError(f"{where}{key} must be an integer >= {minimum}{tail}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class EncoderConfig:
    """Sizes of an encoder trunk. `project_to`: width of the projector MLP after the final norm
    (None: no projector, the output width is d_model); `init_seed`: as in LMConfig.

    `feature_layer`: which hidden state the encoder outputs, counted from the end as LLaVA's
    `vision_feature_layer`: -1 (default) the last block's output after the final LayerNorm; -2
    the output of the second-to-last block (no final norm: the last block and the norm get no
    gradient, as in LLaVA-1.5 with a CLIP tower), ... -(n_layers + 1) the input embeddings.
    Blocks after the chosen one are not run."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    project_to: int | None = None
    init_seed: int | None = None
    feature_layer: int = -1

    @classmethod
    def from_dict(cls: type[C], config: dict[str, Any], *, where: str = "") -> C:
        check_keys(config, {f.name for f in dataclasses.fields(cls)}, where)
        cfg = cls(**config)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "") -> None:
        self.block_config().validate(where)  # d_model, n_layers, n_heads, d_ff, init_seed
        check_int(self.project_to, "project_to", where=where, optional=True)
        if (not isinstance(self.feature_layer, int) or isinstance(self.feature_layer, bool)
                or not -(self.n_layers + 1) <= self.feature_layer <= -1):
            raise ValueError(f"{where}feature_layer must be an integer from -{self.n_layers + 1} to -1 "
                             f"(n_layers={self.n_layers}), got {self.feature_layer!r}")

    def block_config(self) -> LMConfig:
        """The LMConfig that sizes each `Block` (vocabulary and positions are unused there)."""
        return LMConfig(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, d_ff=self.d_ff,
                        init_seed=self.init_seed)

    @property
    def d_out(self) -> int:
        return self.project_to if self.project_to is not None else self.d_model

    def out_width(self) -> tuple[int, str]:
        """d_out with the config key that sets it (Stage.output_widths)."""
        return (self.d_out, "project_to" if self.project_to is not None else "d_model")


class EncoderTrunk(nn.Module):
    """Bidirectional transformer blocks + final LayerNorm over variable-length sequences; the
    output is the hidden state `feature_layer` selects (see EncoderConfig)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        block_cfg = cfg.block_config()
        self.blocks = nn.ModuleList(Block(block_cfg, causal=False) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.feature_layer = cfg.feature_layer

    def forward(self, seqs: Sequence[Tensor]) -> list[Tensor]:
        """Per-sample [L_i, d_model] (L_i >= 1) -> per-sample [L_i, d_model]."""
        lengths = lengths_of(seqs)
        x = pad_right(seqs, 0.0)
        mask = padding_mask(lengths, x.shape[1], x.device)
        run = len(self.blocks) + 1 + self.feature_layer  # blocks whose output is used
        for block in self.blocks[:run]:
            x = block(x, mask)
        return unpad(self.norm(x) if self.feature_layer == -1 else x, lengths)


class ProjectorMLP(nn.Module):
    """Linear(d_in, d_hidden) -> GELU -> Linear(d_hidden, d_out), applied row by row."""

    def __init__(self, d_in: int, d_out: int, d_hidden: int | None = None) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_in, d_hidden if d_hidden is not None else d_out)
        self.fc_out = nn.Linear(self.fc_in.out_features, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))

    def per_sample(self, seqs: Sequence[Tensor]) -> list[Tensor]:
        """Project each [L_i, d_in] tensor; one matmul over all rows (rows are independent)."""
        if not seqs:
            return []
        return list(self(torch.cat(list(seqs))).split(lengths_of(seqs)))


def seeded(module: M, *, seed: int | None, n_layers: int, prefix: str) -> M:
    """`module` with GPT-2 style weights (weights.init_weights); parameters are named
    `prefix + name`, so the same seed gives the same weights wherever the module is built."""
    init_weights(module, seed=seed, n_layers=n_layers, prefix=prefix)
    return module


def param_like(module: nn.Module) -> Tensor:
    """A parameter of `module`: inputs are moved to its device and dtype (the runtime's choice)."""
    return next(module.parameters())


def load_class(path: str, key: str) -> Any:
    """Import "module:Attr" named by config key `key`; a failure names the key and the path."""
    module_name, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} must be a 'module:Class' path, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"{key}: cannot import {path!r}: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{key}: module {module_name!r} has no attribute {attr!r} (from {path!r})") from None


def scatter(values: Sequence[Tensor], where: Sequence[int], size: int) -> list[Tensor | None]:
    """A list of `size` entries with values[k] at index where[k] and None elsewhere."""
    out: list[Tensor | None] = [None] * size
    for i, v in zip(where, values, strict=True):
        out[i] = v
    return out


def optional_projector(cfg: EncoderConfig) -> ProjectorMLP | None:
    """The projector to the LLM width when `project_to` is set (weights named "projector.*")."""
    if cfg.project_to is None:
        return None
    return seeded(ProjectorMLP(cfg.d_model, cfg.project_to), seed=cfg.init_seed, n_layers=cfg.n_layers,
                  prefix="projector.")
