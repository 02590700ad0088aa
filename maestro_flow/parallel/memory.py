"""What a rank holds of its section's training state, in bytes, as it holds it.

Counts each rank's own storage: the local shard of a DTensor (FSDP or tensor parallelism), the
whole tensor otherwise. A worker measures twice a step (runtime/executor.py):

    step   after the last backward, before gradients are reduced: parameters as the step used
           them (an FSDP section's gathered in full) and the gradients accumulated for them
    rest   after the reduction and the optimizer step: parameters and gradients as kept between
           steps (an FSDP section's sharded over dp), and the optimizer state

The optimizer state counts in both. A frozen section has parameters only. The figures are
exact byte counts of tensors, not allocator or RSS readings; the peak of the process (RSS on
CPU, `torch.cuda.max_memory_allocated` on CUDA) is reported beside them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

MiB = float(1 << 20)


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def held(module_params: Iterable[torch.nn.Parameter]) -> tuple[int, int]:
    """(parameter bytes, gradient bytes) of the parameters a stage's modules hold right now."""
    params = list(module_params)
    return local_bytes(params), local_bytes(p.grad for p in params)


def optimizer_bytes(optimizer: Any | None) -> int:
    if optimizer is None:
        return 0
    return local_bytes(v for per_param in optimizer.state.values() for v in per_param.values()
                       if isinstance(v, torch.Tensor))


def peak_mb(device: torch.device) -> float | None:
    """The device's allocation peak so far (CUDA), None on CPU (the RSS peak is reported apart)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MiB
    return None
