"""The independent oracle: a plain single-process PyTorch training loop over the whole model.

No maestro_flow runtime code runs here. The stages' modules are the model (their `forward` is
its maths), called directly on one global batch per step, in file order (the pipelines under
test set `data.shuffle=false`): each section sees the samples it activates on, each loss
section's loss is the global batch's mean (its loss sum over the whole batch divided by its
denominator) and the objective is their sum (each loss a mean of its own, as if each trained
alone), one `backward()`, `torch.nn.utils.clip_grad_norm_` over every trainable parameter, and plain
`torch.optim.AdamW` / `SGD` whose learning rate this module sets each step from its own
formula (the README's schedule). Parameters that get no gradient keep `grad is None`, and
torch.optim skips them: the semantics the runtime must reproduce.
"""

from __future__ import annotations

import importlib
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import torch
from pyarrow import ipc

from maestro_flow import MicroBatch, Pipeline, StageContext

SCHEDULE_KEYS = ("warmup_steps", "decay", "min_lr")


def lr_at(spec: dict[str, Any], step: int, total: int) -> float:
    lr, warmup = spec["lr"], spec.get("warmup_steps", 0)
    min_lr, decay = spec.get("min_lr", 0.0), spec.get("decay", "constant")
    if step < warmup:
        return lr * (step + 1) / warmup
    if decay == "constant":
        return lr
    progress = (step - warmup) / (total - 1 - warmup) if total - 1 - warmup > 0 else 1.0
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class Result:
    states: dict[str, dict[str, torch.Tensor]]  # trainable section -> its stage's state_dict
    initial: dict[str, dict[str, torch.Tensor]]
    losses: list[Any] = field(default_factory=list)  # per step: the loss, or per loss section
    grad_norms: list[float] = field(default_factory=list)
    lrs: dict[str, list[float]] = field(default_factory=dict)


def _table(path: str) -> pa.Table:
    with pa.memory_map(path, "r") as source:
        return ipc.open_file(source).read_all()


def _column_value(name: str, value: Any) -> Any:
    if name == "tokens":
        return torch.tensor(value, dtype=torch.int64)
    if name == "audio" and value is not None:
        return torch.tensor(value, dtype=torch.float32)
    return value


def train(pipeline: Pipeline, steps: int) -> Result:
    """Train `pipeline`'s model for `steps` steps as a plain loop; float64 or the pipeline's dtype."""
    dtype = getattr(torch, pipeline.dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return _train(pipeline, steps, dtype)
    finally:
        torch.set_default_dtype(previous)


def _train(pipeline: Pipeline, steps: int, dtype: torch.dtype) -> Result:
    assert not pipeline.data.shuffle, "the oracle reads global batches in file order"
    order = _topological(pipeline)
    stages = {}
    for s in pipeline.sections:
        # The stage contract (DESIGN 5.2): the constructor runs in the pipeline's dtype with
        # torch's global RNG seeded by ctx.seed (a stage without an init_seed of its own draws there).
        seed = (pipeline.seed * 1_000_003 + zlib.crc32(s.name.encode())) % (2 ** 31)  # ctx.seed, as runtime/build.section_seed derives it
        ctx = StageContext(section=s.name, dtype=dtype, seed=seed, trainable=s.trainable,
                           placeholder_ids=dict(pipeline.data.placeholder_ids),
                           modality_columns=dict(pipeline.data.modality_columns))
        module_name, _, cls_name = s.stage.partition(":")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            torch.manual_seed(seed)
            stage = getattr(importlib.import_module(module_name), cls_name)(dict(s.config), ctx)
        finally:
            torch.set_default_dtype(previous)
        for module in stage.modules().values():
            module.to(dtype=dtype)
            module.train(s.trainable)
        if not s.trainable:
            for p in stage.parameters():
                p.requires_grad_(False)
        stages[s.name] = stage
    trainable = [s for s in pipeline.sections if s.trainable]
    optimizers = {}
    for s in trainable:
        kwargs = {k: v for k, v in s.optimizer.items() if k != "name" and k not in SCHEDULE_KEYS}
        params = [p for p in stages[s.name].parameters() if p.requires_grad]
        cls = torch.optim.AdamW if s.optimizer["name"] == "adamw" else torch.optim.SGD
        optimizers[s.name] = cls(params, **kwargs)
    result = Result(states={}, initial={s.name: _copy(stages[s.name].state_dict()) for s in trainable},
                    lrs={s.name: [] for s in trainable})
    table = _table(pipeline.data.path).to_pydict()
    per_epoch = len(table["id"]) // pipeline.global_batch
    every = [p for s in trainable for p in stages[s.name].parameters() if p.requires_grad]
    for step in range(steps):
        first = (step % per_epoch) * pipeline.global_batch
        rows = list(range(first, first + pipeline.global_batch))
        outputs: dict[str, dict[int, dict[str, Any]]] = {}
        loss_sums: dict[str, Any] = {}  # per loss section: each is a mean over its own targets
        denominators: dict[str, float] = {}
        for name in order:
            section = pipeline.section(name)
            mine = [r for r in rows if section.activates(set(table["modalities"][r]))]
            if not mine:
                continue
            ids = [table["id"][r] for r in mine]
            columns = {c: [_column_value(c, table[c][r]) for r in mine] for c in (section.columns or table)}
            inputs: dict[str, list] = {}
            for e in pipeline.edges:
                if e.dst == name:
                    for t in e.tensors:
                        inputs[t] = [outputs.get(e.src, {}).get(i, {}).get(t) for i in ids]
            batch = MicroBatch(step=step, index=0, sample_ids=ids, modalities=[frozenset(table["modalities"][r])
                                                                               for r in mine],
                               columns=columns, inputs=inputs)
            with torch.set_grad_enabled(section.trainable):
                out = stages[name].forward(batch)
            if "loss" in out:
                loss_sums[name] = out["loss"]
                denominators[name] = float(out.get("loss_denominator", len(ids)))
            outputs[name] = {i: {k: v[j] for k, v in out.items() if k not in ("loss", "loss_denominator")}
                             for j, i in enumerate(ids)}
        means = {name: loss_sums[name] / denominators[name] for name in loss_sums}
        loss = sum(means.values())
        loss.backward()
        result.losses.append(float(loss.detach()) if len(means) == 1
                             else {name: float(m.detach()) for name, m in means.items()})
        if pipeline.grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(every, pipeline.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in every if p.grad is not None])
        result.grad_norms.append(float(norm))
        for s in trainable:
            opt = optimizers[s.name]
            lr = lr_at(s.optimizer, step, pipeline.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            result.lrs[s.name].append(lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
    result.states = {s.name: _copy(stages[s.name].state_dict()) for s in trainable}
    return result


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def _topological(pipeline: Pipeline) -> list[str]:
    order: list[str] = []
    names = [s.name for s in pipeline.sections]
    while len(order) < len(names):
        for n in names:
            if n not in order and all(e.src in order for e in pipeline.edges if e.dst == n):
                order.append(n)
    return order
