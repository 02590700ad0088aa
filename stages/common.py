"""Helpers shared by the stages: right padding of per-sample tensors and the loss sums.

Owns the conventions every stage here follows: samples are padded on the right, a sample of
length L predicts its tokens 1..L-1 from positions 0..L-2 ("predicted positions"), and losses are
SUMS over predicted positions (the runtime divides by the global count, DESIGN 4). Knows nothing of
models, configs or sections.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

Outputs = dict[str, Tensor | list[Tensor] | int]


def check_keys(config: dict[str, Any], allowed: Iterable[str], where: str = "") -> None:
    """Raise a ValueError naming the first key of `config` that is not in `allowed` (a typo guard),
    or `config` itself when it is not a mapping (e.g. teacher: "teacher")."""
    if not isinstance(config, dict):
        raise ValueError(f"{where.rstrip('.') or 'config'} must be a mapping of config keys, got {config!r}")
    allowed = set(allowed)
    for key in config:
        if key not in allowed:
            raise ValueError(f"unknown config key '{where}{key}'; expected one of {sorted(allowed)}")


def module_device(module: torch.nn.Module) -> torch.device:
    """Where the runtime put `module` (it moves parameters to ctx.device after construction)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def lengths_of(seqs: Sequence[Tensor]) -> list[int]:
    return [int(s.shape[0]) for s in seqs]


def pad_right(seqs: Sequence[Tensor], value: float = 0) -> Tensor:
    """Stack per-sample tensors [L_i, ...] into [B, max L_i, ...], padding at the end of each."""
    return torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True, padding_value=value)


def pad_tokens(tokens: Sequence[Tensor], device: torch.device) -> tuple[Tensor, list[int]]:
    """Token ids [B, T] (int64, right-padded with 0) and the per-sample lengths."""
    ids = pad_right([t.to(device=device, dtype=torch.int64) for t in tokens], 0)
    return ids, lengths_of(tokens)


def padding_mask(lengths: Sequence[int], width: int, device: torch.device) -> Tensor:
    """[B, width] bool, True at real (non-pad) positions."""
    return torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def unpad(x: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    """The inverse of `pad_right`: [B, T, ...] -> one [L_i, ...] tensor per sample."""
    return [x[i, :n] for i, n in enumerate(lengths)]


def select_predicted(x: Tensor, lengths: Sequence[int]) -> Tensor:
    """Rows of padded `x` [B, T, ...] at predicted positions, sample by sample: [N, ...].

    N = sum(L_i - 1). The order matches `next_token_targets` and `concat_predicted`.
    """
    width = x.shape[1]
    predicted = [max(n - 1, 0) for n in lengths]
    return x[padding_mask(predicted, width, x.device)]


def concat_predicted(per_sample: Sequence[Tensor]) -> Tensor:
    """Like `select_predicted` for a list of per-sample tensors [L_i, ...]: [N, ...]."""
    return torch.cat([t[:-1] for t in per_sample], dim=0)


def next_token_targets(tokens: Sequence[Tensor], device: torch.device) -> Tensor:
    """The ids each predicted position must predict: [N] int64."""
    return torch.cat([t[1:] for t in tokens]).to(device=device, dtype=torch.int64)


def _loss_precision(x: Tensor) -> Tensor:
    # Softmax over a vocabulary in half precision loses too much; sums are taken in float32 at least.
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def ce_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Sum over rows of the next-token cross-entropy: logits [N, V], targets [N]."""
    return F.cross_entropy(_loss_precision(logits), targets, reduction="sum")


def kl_sum(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """Sum over rows of T^2 * KL(softmax(teacher / T) || softmax(student / T)): logits [N, V].

    The T^2 factor keeps the gradient scale independent of T (Hinton et al., 2015).
    """
    log_q = F.log_softmax(_loss_precision(student_logits) / temperature, dim=-1)
    log_p = F.log_softmax(_loss_precision(teacher_logits) / temperature, dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="sum") * (temperature * temperature)


def loss_outputs(loss: Tensor, num_predicted: int) -> Outputs:
    """A terminal stage's outputs: the loss sum and what it summed over (DESIGN 5.2)."""
    return {"loss": loss, "loss_denominator": num_predicted}
