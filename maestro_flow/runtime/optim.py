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

    def all_reduce(self, grads: Sequence[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for tensors in by_dtype.values():
            flat = _flatten_dense_tensors(tensors)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            for g, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                g.copy_(reduced)
