"""Optimizers and the data-parallel gradient reduction of a trainable section.

Runs in the compute thread of a worker (or of the colocated process). The reduction is one sum
all-reduce per step over the section's DP group, on a flat buffer per dtype, joined by every
replica (one with no samples contributes zeros), so it never hangs on an empty replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def build_optimizer(spec: dict[str, Any], params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    opts = {k: v for k, v in spec.items() if k != "name"}
    if "betas" in opts:
        opts["betas"] = tuple(opts["betas"])
    name = spec.get("name", "adamw")
    if name == "adamw":
        return torch.optim.AdamW(params, foreach=False, **opts)
    if name == "sgd":
        return torch.optim.SGD(params, foreach=False, **opts)
    raise ValueError(f"optimizer.name must be adamw or sgd, got {name!r}")


class GradientReducer:
    """Sum all-reduce of gradients over one section's DP process group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def all_reduce(self, grads: Sequence[torch.Tensor], extra: Sequence[float] = ()) -> list[float]:
        """Sum `grads` in place over the group; also sum the numbers `extra` (returned).

        The extras (a loss section's loss sum and denominator) ride in a float64 buffer, in the
        gradients' own collective when they are float64, else in one small collective of their
        own; either way every replica takes the same path (it depends on dtypes only)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        extras = torch.tensor(list(extra), dtype=torch.float64, device=grads[0].device if grads else "cpu")
        if len(extras) and torch.float64 not in by_dtype:
            dist.all_reduce(extras, op=dist.ReduceOp.SUM, group=self.group)
        for dtype, tensors in by_dtype.items():
            parts = tensors + ([extras] if dtype == torch.float64 and len(extras) else [])
            flat = _flatten_dense_tensors(parts)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            for g, reduced in zip(parts, _unflatten_dense_tensors(flat, parts), strict=True):
                g.copy_(reduced)
        return extras.tolist()
