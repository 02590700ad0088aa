"""Tensor parallelism from a stage's plan: names -> styles -> torch's `parallelize_module`.

A plan maps module names as they appear in the stage's `state_dict` (the stage attribute first,
or the attribute itself; `*` for any one name part such as a layer index) to a style, in Hugging
Face's tp-plan vocabulary: "colwise" (output features sharded; input replicated), "rowwise"
(input features sharded, output all-reduced; on an nn.Embedding its rows, the token ids whole on
every rank), "colwise_rep" (colwise, output gathered back to replicated), "rowwise_split"
(rowwise on a replicated input, which each rank slices), "replicate" (left alone). Every rank
builds the same full weights (the same seeds), so sharding is a local slice
(`src_data_rank=None`: no broadcast at setup).

`check_plan` runs in `maestro validate` on a stage built on the meta device: every entry must
name at least one module, its style must be known, and the sharded dimension of every matched
`nn.Linear` / `nn.Embedding` must divide by tp.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from torch import nn

LAYER = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a layer index in a module's name (shown as `*`)
STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_split", "replicate")


def matches(plan: dict[str, str], modules: dict[str, nn.Module]) -> dict[str, str]:
    """Module name -> style for every module a plan entry names (a later entry wins)."""
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        compiled = re.compile(fnmatch.translate(pattern).replace(".*", "[^.]*"))  # `*`: one name part
        for name in modules:
            if compiled.fullmatch(name):
                out[name] = style
    return out


def sharded(plan: dict[str, str], modules: dict[str, nn.Module]) -> dict[str, str]:
    """Module name -> style for every module the plan shards (matched, style not "replicate")."""
    return {name: style for name, style in matches(plan, modules).items() if style != "replicate"}


def _style(style: str, module: nn.Module) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        # An embedding's input (token ids) is whole on every rank: as sharded (torch's default for
        # rowwise), it was gathered into tp times the sequence (found in review).
        return RowwiseParallel(input_layouts=Replicate()) if isinstance(module, nn.Embedding) else RowwiseParallel()
    if style == "colwise_rep":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise_split":
        return RowwiseParallel(input_layouts=Replicate())
    raise ValueError(f"tensor-parallel style {style!r} is not supported (supported: {', '.join(STYLES)})")


def stage_modules(stage: Any) -> dict[str, nn.Module]:
    """Every module of a stage by its state_dict name (stage attribute first)."""
    return {f"{attr}.{name}" if name else attr: m for attr, top in stage.modules().items()
            for name, m in top.named_modules()}


def apply_plan(stage: Any, plan: dict[str, str], tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    modules = stage_modules(stage)
    chosen = sharded(plan, modules)
    for attr, top in stage.modules().items():
        if attr in chosen:  # the attribute itself (found in QA: {"up": "colwise"} for self.up was dropped)
            parallelize_module(top, tp_mesh, _style(chosen[attr], top), src_data_rank=None)
            continue  # an nn.Linear or nn.Embedding (check_plan): nothing inside it to shard
        prefix = attr + "."
        local = {name[len(prefix):]: _style(style, modules[name]) for name, style in chosen.items()
                 if name.startswith(prefix)}
        if local:
            parallelize_module(top, tp_mesh, local, src_data_rank=None)


def check_plan(stage: Any, plan: dict[str, str], tp: int, fields: dict[int, list[str]] | None = None) -> list[str]:
    """What keeps `plan` from sharding `stage` (built on the meta device) over tp ranks, each
    layer's module once (as `*`); `fields`: the config fields (dotted) by their value, to name the
    one a dimension that does not divide comes from (each value once: they are popped)."""
    problems, unmatched, layers = [], [], set()
    modules = stage_modules(stage)
    for pattern, style in plan.items():
        if style not in STYLES:
            problems.append(f"tp_plan entry {pattern!r}: style {style!r} is not supported "
                            f"(supported: {', '.join(STYLES)})")
        elif not matches({pattern: style}, modules):
            unmatched.append(repr(pattern))
    if unmatched:  # found in QA: no hint what the names are
        names = list(dict.fromkeys(LAYER.sub("*", n) for n in modules))  # layers as `*`
        problems.append(f"tp_plan {'entries' if len(unmatched) > 1 else 'entry'} {', '.join(unmatched)} "
                        f"name{'' if len(unmatched) > 1 else 's'} no module of the stage (its modules: "
                        f"{', '.join(names[:12])}{', ...' if len(names) > 12 else ''})")
    for name, style in matches(plan, modules).items():
        m = modules[name]
        if style == "replicate" or style not in STYLES:  # an unknown style is said once, above
            continue
        if isinstance(m, nn.Linear):
            size, what = (m.out_features, "output features") if style.startswith("colwise") else \
                (m.in_features, "input features")
        elif isinstance(m, nn.Embedding):
            size, what = (m.embedding_dim, "embedding dim") if style.startswith("colwise") else \
                (m.num_embeddings, "embeddings")
        else:
            problems.append(f"tp_plan entry for {name}: {type(m).__name__} cannot be sharded "
                            "(only nn.Linear and nn.Embedding)")
            continue
        problem = f"{LAYER.sub('*', name)} ({style}): its {size} {what} do not divide by tp={tp}"
        if size % tp and problem not in layers:  # one line for every layer's module alike
            layers.add(problem)
            given = (fields or {}).pop(size, [])  # each value's fields named once
            problems.append(problem + (f" ({' or '.join(given)} is {size})" if given else ""))
    return problems


def tp_share(stage: Any, section: Any) -> float:
    """The share of the stage's parameter bytes its tp_plan shards (0 without a plan): what
    `maestro tune` divides by tp. Each parameter counts once (a tied embedding and LM head are
    one tensor), and a rowwise Linear's bias is replicated, as RowwiseParallel leaves it."""
    try:
        plan = type(stage).tp_plan(dict(section.config)) or {}
    except Exception:
        return 0.0
    modules = stage_modules(stage)
    chosen = sharded(plan, modules)
    params: dict[int, tuple[int, bool]] = {}  # id -> (bytes, sharded by some module holding it)
    for name, m in modules.items():
        style = chosen.get(name)
        for pname, p in m.named_parameters(recurse=False):
            split = style is not None and not (style.startswith("rowwise") and isinstance(m, nn.Linear)
                                               and pname == "bias")
            params[id(p)] = (p.numel() * p.element_size(), split or params.get(id(p), (0, False))[1])
    total = sum(b for b, _ in params.values())
    return sum(b for b, split in params.values() if split) / total if total else 0.0
