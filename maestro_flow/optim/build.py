"""A section's optimizer and learning-rate schedule, from its `optimizer` configuration.

Runs wherever a trainable section is built (a worker, the colocated process, `maestro stage`).
The spec is `{"name": "adamw" | "sgd", "lr": ..., <the torch optimizer's keyword arguments>,
"warmup_steps": W, "decay": "cosine" | "linear" | "constant", "min_lr": M}`; the last three shape
the learning rate (config.SCHEDULE_KEYS) and are not passed to the optimizer.

The schedule is a `torch.optim.lr_scheduler.LambdaLR` stepped once after every optimizer step, so
step s (0-based) trains with lr * factor(s):
  - warmup, s < W:  factor = (s + 1) / W        (step W - 1 reaches the full lr)
  - then, with p = (s - W) / (T - 1 - W) from 0 at step W to 1 at the last step T - 1:
      cosine    lr_s = min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
      linear    lr_s = lr - (lr - min_lr) * p
      constant  lr_s = lr
T is the pipeline's `steps` (the total, also when resuming: a resumed run follows the schedule
of the pipeline as given then, see SectionOptimizer.resume).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch

from maestro_flow.config import SCHEDULE_KEYS
from maestro_flow.errors import PipelineError, first_line

OPTIMIZER_CLASSES = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
# Keyword arguments the runtime sets itself: `foreach=False` keeps the per-parameter update (a
# parameter's result does not depend on which others share its step), which is what makes
# section mode, colocated mode and a plain loop agree to the last bits.
RESERVED = ("params", "foreach")


def optimizer_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    opts = {k: v for k, v in spec.items() if k != "name" and k not in SCHEDULE_KEYS}
    if "betas" in opts:
        opts["betas"] = tuple(opts["betas"])
    return opts


def check_optimizer_spec(spec: dict[str, Any], where: str, device: str = "cpu") -> None:
    """Refuse keys the named torch optimizer does not take, and values it refuses, before any
    worker starts. `device`: the section's ("cpu" or "cuda")."""
    cls = OPTIMIZER_CLASSES.get(spec.get("name", "adamw"))
    if cls is None:
        return  # config.Section.validate names the bad optimizer
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", *RESERVED}
    for key in spec:  # first: a key the optimizer does not take needs no other fix (review: SGD's betas)
        if key != "name" and key not in SCHEDULE_KEYS and key not in accepted:
            raise PipelineError(f"{where}.optimizer.{key}: not an argument of {cls.__module__}.{cls.__name__} "
                                f"(accepted: {', '.join(sorted(accepted | set(SCHEDULE_KEYS)))})")
    try:
        kwargs = optimizer_kwargs(spec)
    except TypeError:  # found in review: betas=0.9 (not a list) was a traceback
        kwargs = None
    # Found in QA: betas [0.9] gave a traceback; three passed, and failed in every worker at step 1.
    if kwargs is None or "betas" in kwargs and len(kwargs["betas"]) != 2:
        raise PipelineError(f"{where}.optimizer.betas must be a list of two numbers, got {spec.get('betas')!r}")
    # Found in QA: both passed, then failed in every worker at the first step.
    if kwargs.get("differentiable"):
        raise PipelineError(f"{where}.optimizer.differentiable: the runtime steps the optimizer outside autograd, "
                            "where torch refuses it (an in-place update of a leaf that requires grad): leave it out")
    on_cpu = device == "cpu" or device == "auto" and not torch.cuda.is_available()  # (auto: review)
    if kwargs.get("capturable") and on_cpu:
        raise PipelineError(f"{where}.optimizer.capturable is for CUDA graphs: it needs the section on a CUDA device "
                            f"(its device is {device}); leave it out")
    # Values the optimizer refuses (betas=[2, 3], a negative weight_decay, eps of the wrong type):
    # built and stepped once on a stand-in parameter (on the CPU: not with capturable), so that
    # they are refused here, not in every worker's setup or first step.
    try:
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = cls([param], foreach=False, **kwargs)
        if not kwargs.get("capturable"):
            param.grad = torch.ones(1)
            optimizer.step()
    except (ValueError, TypeError, IndexError, RuntimeError, AssertionError) as exc:
        raise PipelineError(f"{where}.optimizer: {cls.__module__}.{cls.__name__} refuses it: {first_line(exc)}") from None


def schedule_warnings(spec: dict[str, Any], where: str, steps: int) -> list[str]:
    """What a valid schedule does that is almost surely not meant (found in QA: both in silence)."""
    out = []
    warmup, decay = spec.get("warmup_steps", 0), spec.get("decay", "constant")
    if spec.get("min_lr") and decay == "constant":
        out.append(f"{where}.optimizer.min_lr={spec['min_lr']} is not used: the lr only decays towards it with "
                   f"{where}.optimizer.decay='cosine' or 'linear' (the default, 'constant', keeps lr)")
    if warmup > steps:
        out.append(f"{where}.optimizer.warmup_steps={warmup} is more than the pipeline's {steps} steps: the lr "
                   f"never reaches {spec.get('lr')} (it would after {warmup} steps)")
    return out


def pipeline_schedule_warnings(pipeline: Any) -> list[str]:
    """schedule_warnings of every trainable section of `pipeline` (a config.Pipeline)."""
    return [w for s in pipeline.sections if s.trainable
            for w in schedule_warnings(s.optimizer, f"sections.{s.name}", pipeline.steps)]


def build_optimizer(spec: dict[str, Any], params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    name = spec.get("name", "adamw")
    if name not in OPTIMIZER_CLASSES:
        raise ValueError(f"optimizer.name must be one of {', '.join(OPTIMIZER_CLASSES)}, got {name!r}")
    return OPTIMIZER_CLASSES[name](params, foreach=False, **optimizer_kwargs(spec))


class WarmupDecay:
    """The lr factor of step s (see the module docstring). Plain attributes, so LambdaLR's state
    (and a checkpoint of it) holds the schedule's parameters."""

    def __init__(self, *, lr: float, warmup_steps: int, decay: str, min_lr: float, total_steps: int) -> None:
        self.lr, self.warmup_steps, self.decay = float(lr), int(warmup_steps), decay
        self.min_lr, self.total_steps = float(min_lr), int(total_steps)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = self.total_steps - 1 - self.warmup_steps
        p = min(1.0, max(0.0, (step - self.warmup_steps) / span)) if span > 0 else 1.0
        if self.decay == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
        if self.decay == "linear":
            return self.lr - (self.lr - self.min_lr) * p
        return self.lr

    def __call__(self, step: int) -> float:
        return self.lr_at(step) / self.lr if self.lr > 0 else 0.0


def build_scheduler(spec: dict[str, Any], optimizer: torch.optim.Optimizer,
                    total_steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A LambdaLR when the spec asks for warmup or decay; None for a constant lr."""
    if not spec.get("warmup_steps", 0) and spec.get("decay", "constant") == "constant":
        return None
    factor = WarmupDecay(lr=spec["lr"], warmup_steps=spec.get("warmup_steps", 0), decay=spec.get("decay", "constant"),
                         min_lr=spec.get("min_lr", 0.0), total_steps=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
