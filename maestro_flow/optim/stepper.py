"""The end of a trainable section's step: reduce, divide, measure, clip, step, schedule.

Runs in the compute thread of a worker (or of the colocated process, or `maestro profile`). The
executor calls, in order: `reduce` (the DP all-reduce, see reduce.py; parameters that got no
gradient anywhere keep `grad = None`), `divide` (by the global loss denominator), `sq_norm` (this
replica's share of the squared global gradient norm), then `step(coef)` once the coordinator has
combined every section's share into the clip coefficient (clip.py; 1.0 without clipping). The global norm
is that of every trainable parameter of the whole pipeline, as `torch.nn.utils.clip_grad_norm_`
over the monolithic model computes it: replicated sections count their gradients once (replica
0), parameters without a gradient not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from maestro_flow.optim.build import build_optimizer, build_scheduler
from maestro_flow.optim.reduce import align, local


class SectionOptimizer:
    def __init__(self, spec: dict[str, Any], params: Sequence[torch.nn.Parameter], *, total_steps: int,
                 reducer: Any = None, owns_norm: bool | Sequence[bool] = True,
                 groups: Sequence[tuple[dict[str, Any], Sequence[torch.nn.Parameter]]] | None = None) -> None:
        """`reducer`: a GradientReducer (replicated section) or parallel.fsdp.FSDPSection;
        `owns_norm`: whether this rank counts each parameter in the global norm (one bool for all,
        or one per parameter: sharded and replicated parameters are counted once); `groups`:
        several (spec, parameters) optimizers stepping together (Stage.optimizer_groups; they
        replace `spec` and `params`). `optimizer` and `scheduler` are the first group's."""
        parts = [(spec, list(params))] if groups is None else [(s, list(ps)) for s, ps in groups if ps]
        self.params = [p for _, ps in parts for p in ps]
        self.optimizers = [build_optimizer(s, ps) for s, ps in parts]
        self.schedulers = [build_scheduler(s, opt, total_steps) for (s, _), opt in zip(parts, self.optimizers,
                                                                                     strict=True)]
        self.optimizer, self.scheduler = self.optimizers[0], self.schedulers[0]
        self.reducer = reducer
        self.owners = [owns_norm] * len(self.params) if isinstance(owns_norm, bool) else list(owns_norm)

    @property
    def lr(self) -> float:
        """The learning rate the next `step` uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def lr_groups(self) -> list[float] | None:
        """Each optimizer's `lr`, with several (found in QA: only the first group's was shown)."""
        return [float(o.param_groups[0]["lr"]) for o in self.optimizers] if len(self.optimizers) > 1 else None

    def reduce(self, extra: Sequence[float] = ()) -> list[float]:
        """Sum gradients (and `extra`) over the DP group; without one, just return `extra`. A
        tensor-parallel gradient first takes its parameter's placements (reduce.align)."""
        align(self.params)
        if self.reducer is None:
            return list(extra)
        return self.reducer.reduce(self.params, extra)

    def divide(self, denominator: float) -> None:
        if denominator > 0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(denominator)

    def sq_norm(self) -> float:
        """Sum of squared gradient entries this replica contributes to the global norm."""
        norms = [torch.linalg.vector_norm(local(p.grad), 2, dtype=torch.float64)
                 for p, owner in zip(self.params, self.owners, strict=True) if owner and p.grad is not None]
        return float(torch.stack(norms).square().sum()) if norms else 0.0  # one device sync, not one per parameter

    def resume(self, steps_done: Sequence[int | None]) -> None:
        """After the optimizers' state was loaded from a checkpoint: their hyperparameters and lr
        schedules are the pipeline's as given now (so raising `steps` stretches the decay), at
        `steps_done[i]` steps for optimizer i (None: the checkpoint had no schedule for it; the
        step count then comes from the optimizer's own state)."""
        for optimizer, scheduler, done in zip(self.optimizers, self.schedulers, steps_done, strict=True):
            _resume(optimizer, scheduler, done)

    def step(self, coef: float = 1.0) -> None:
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()


def _resume(optimizer: torch.optim.Optimizer, scheduler: Any, steps_done: int | None) -> None:
    current = optimizer.defaults
    for group in optimizer.param_groups:
        for key, value in current.items():
            if key != "lr" and key in group:
                group[key] = value
        group["initial_lr"] = current["lr"]
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = current["lr"]
        return
    if steps_done is None:
        steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
        steps_done = max(steps, default=0)
    scheduler.base_lrs = [current["lr"]] * len(optimizer.param_groups)
    scheduler.last_epoch = steps_done
    lrs = [base * fn(steps_done) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
