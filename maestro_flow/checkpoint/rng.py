"""Every RNG a worker's stage code may draw from, saved and restored at a step boundary.

Runs in a worker's compute thread. torch's CPU generator, the CUDA generator of the worker's
device, Python's `random` and NumPy's global generator: with them a resumed run draws the same
dropout masks (and whatever else the stages randomise) as the uninterrupted one. Written with
`torch.save` and read back with `weights_only=True` (tensors and plain Python values only),
with `extra` entries of the same kinds beside them (a lockstep replica's stand-in batch).
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def states(device: torch.device) -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                           "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def restore(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(path: str, device: torch.device, extra: dict[str, Any] | None = None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save({**states(device), **(extra or {})}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def reseed(seed: int) -> None:
    """Seed every RNG above (torch's on the CPU and every CUDA device, Python's, NumPy's)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def load(path: str, device: torch.device) -> dict[str, Any]:
    """Restore the RNG states saved at `path`; returns everything saved there (`extra` too)."""
    state = torch.load(path, weights_only=True)
    restore(state, device)
    return state
