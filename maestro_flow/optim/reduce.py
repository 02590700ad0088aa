"""The data-parallel gradient reduction of a trainable section.

Runs in the compute thread of a worker. One sum all-reduce per step and gradient dtype over the
section's DP group, on a flat buffer, joined by every replica (one with no samples contributes zeros), so
it never hangs on an empty replica. Alongside the gradients it sums, per parameter, whether the
replica produced a gradient at all: a parameter no replica produced one for is left with
`grad = None` on every replica, so the optimizer skips it exactly as `torch.optim` skips a
parameter that got no gradient in a plain loop (no weight decay, no moment or step update).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (no communication), else itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def align(params: Sequence[torch.nn.Parameter]) -> None:
    """Give each DTensor parameter's gradient the parameter's own placements (a local slice of a
    replicated one; a partial sum reduce-scattered, or all-reduced for a replicated parameter).
    torch hands a row-sharded embedding's gradient back whole on every tp rank; reduced, counted
    in the norm and stepped as it was, it was counted once per tp rank in the global norm (found
    in QA: clipping scaled by the wrong factor)."""
    from torch.distributed.tensor import DTensor

    for p in params:
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


class GradientReducer:
    """Sum all-reduce of gradients over one section's DP process group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def reduce(self, params: Sequence[torch.nn.Parameter], extra: Sequence[float] = ()) -> list[float]:
        """Sum the gradients of `params` over the group in place, and the numbers `extra` (returned).

        Every replica zero-fills missing gradients and reduces every parameter (the collectives
        depend on the parameters' dtypes only, the same on every replica). The presence flags ride
        in the first gradient buffer (counts up to the group size; only "> 0" matters); `extra`
        (a loss section's loss sum and denominator) needs float64: it rides in the float64
        gradients' buffer, else in one small collective of its own. Afterwards a parameter whose
        flags sum to 0 gets its gradient back to None."""
        device = params[0].device
        flags = [0.0 if p.grad is None else 1.0 for p in params]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:  # a tensor-parallel shard is reduced over the replicas holding the same shard
            by_dtype.setdefault(p.grad.dtype, []).append(local(p.grad))
        extras = torch.tensor(list(extra), dtype=torch.float64, device=device)
        if len(extras) and torch.float64 not in by_dtype:
            dist.all_reduce(extras, op=dist.ReduceOp.SUM, group=self.group)
        counts: torch.Tensor | None = None
        for i, (dtype, tensors) in enumerate(by_dtype.items()):
            present = torch.tensor(flags, dtype=dtype, device=device) if i == 0 else None
            parts = tensors + ([present] if present is not None else []) + \
                ([extras] if dtype == torch.float64 and len(extras) else [])
            flat = _flatten_dense_tensors(parts)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            for g, reduced in zip(parts, _unflatten_dense_tensors(flat, parts), strict=True):
                g.copy_(reduced)
            if present is not None:
                counts = present
        for p, count in zip(params, counts.tolist(), strict=True):
            if count == 0.0:
                p.grad = None
        return extras.tolist()
