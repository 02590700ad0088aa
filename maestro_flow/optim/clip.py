"""The global gradient clipping rule. Pure (standard library only): the coordinator (which sums
every section's share of the squared norm) and the workers share it.

As `torch.nn.utils.clip_grad_norm_` does over the monolithic model: every gradient is multiplied
by min(1, max_norm / (norm + 1e-6)), where `norm` is the 2-norm of all trainable parameters'
gradients (parameters without a gradient do not count).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

CLIP_EPS = 1e-6


def global_norm(squared_shares: Iterable[float]) -> float:
    return math.sqrt(sum(squared_shares))


def clip_coefficient(max_norm: float | None, norm: float) -> float:
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))
