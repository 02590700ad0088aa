"""The compute precision of a stage's forward: bf16 autocast under `Pipeline.mixed_precision`.

Used wherever stage code runs — the executor (workers and colocated mode), `maestro stage`
(replay) and `maestro profile` — so that all of them measure and compute what a run does.
"""

from __future__ import annotations

import torch

AUTOCAST = {"bf16": torch.bfloat16}


def autocast_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The dtype a forward computes in and floating tensors cross sections in (None: as stored)."""
    return AUTOCAST.get(mixed_precision) if mixed_precision else None


def compute(mixed_precision: str | None, device: torch.device) -> torch.autocast:
    """The autocast context of a stage's forward (disabled without mixed precision)."""
    dtype = autocast_dtype(mixed_precision)
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
