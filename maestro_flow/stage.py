"""The Stage contract (DESIGN 5.2): what user code for one section implements.

A stage is built in its worker as `Class(config, ctx)`, owns `torch.nn.Module`s, and maps a
`MicroBatch` to a dict of outputs. It knows nothing of processes, transfers, gradient reduction,
optimizers or checkpoints: the runtime does all of that around `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class StageContext:
    """Where and how a stage instance runs."""

    section: str
    replica: int = 0
    num_replicas: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    trainable: bool = True
    placeholder_ids: dict[str, int] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """One micro-batch as a stage sees it.

    `columns` maps each dataset column to one entry per sample (`tokens` entries are 1-D int64
    tensors); `inputs` maps each incoming tensor name to one tensor per sample, `None` where the
    producer did not activate on that sample.
    """

    step: int
    index: int
    sample_ids: list[int]
    modalities: list[frozenset[str]]
    columns: dict[str, list[Any]]
    inputs: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_ids)


class Stage:
    """Base class of user stages.

    Subclasses build their modules in `__init__` and implement `forward`. `outputs(config)`
    declares the names `forward` returns, so a pipeline can be checked before any worker starts
    (a terminal trainable section must declare "loss"; an edge may only carry declared names).
    """

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        self.config = dict(config)
        self.ctx = ctx

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ()

    def forward(self, batch: MicroBatch) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def stats(self) -> dict[str, float]:
        """Counters of this stage's own (e.g. corrupt images skipped), reported in the metrics
        under sections.NAME.stage, summed over replicas. Cumulative over the run."""
        return {}

    def modules(self) -> dict[str, torch.nn.Module]:
        """The stage's modules by attribute name (in definition order)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.nn.Module)}

    def parameters(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        params = []
        for module in self.modules().values():
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        out, seen = [], set()
        for attr, module in self.modules().items():
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{attr}.{name}", p))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{attr}.{k}": v for attr, m in self.modules().items() for k, v in m.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for attr, module in self.modules().items():
            prefix = attr + "."
            module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def train(self, mode: bool = True) -> None:
        for module in self.modules().values():
            module.train(mode)
