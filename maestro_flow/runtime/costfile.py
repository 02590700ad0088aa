"""The cost file `maestro profile` writes and `run`/`plan`/`tune --costs FILE` read.

Runs in the CLI/coordinator process; JSON only (no torch), so reading a cost file is cheap.
Format (version 1):

    {"version": 1, "pipeline": NAME, "machine": {...}, "created": ISO time,
     "sections": {NAME: {"cost": {per_sample_s, per_token_s, per_patch_s, per_frame_s, backward_factor},
                         "micro_batch_overhead_s": s,      # fixed time per micro-batch (forward)
                         "memory_base_mb": MB,             # parameters, gradients, optimizer state + fixed
                         "peak_memory_mb_per_sample": MB,  # activations per sample in a micro-batch
                         "runtime_overhead_s": s,          # executor's own cost per micro-batch (calibrated)
                         "step_overhead_s": s,             # optimizer step etc. once per step (trainable)
                         "grad_mb": MB,                    # gradient size (all-reduce estimate when dp > 1)
                         "param_mb": MB,                   # parameters (what tp and fsdp shard)
                         "tp_share": f,                    # share of param_mb the stage's tp_plan shards
                         "unit_mb": MB,                    # its largest FSDP unit (a block)
                         "device": "cpu" | "cuda:0", "memory_method": "...",
                         "measurements": [{micro_batch, samples, tokens, patches, frames,
                                           forward_s, backward_s, peak_mb}, ...]}},
     "planning_s": s}                                      # one plan of a global batch (per step)

runtime_overhead_s, step_overhead_s, grad_mb, planning_s, param_mb, tp_share and unit_mb were added
later (still version 1): a file without them reads as 0 (no runtime costs modelled, no memory saved
by sharding), as before.

`cost` is what the planner uses (Pipeline sections' `cost`); the overhead and memory figures
are what `maestro tune` adds on top.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from maestro_flow.config import Cost, Pipeline
from maestro_flow.errors import PipelineError

VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class SectionProfile:
    cost: Cost
    micro_batch_overhead_s: float = 0.0
    memory_base_mb: float = 0.0
    peak_memory_mb_per_sample: float = 0.0
    runtime_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    grad_mb: float = 0.0
    param_mb: float = 0.0
    tp_share: float = 0.0
    unit_mb: float = 0.0


def read_cost_file(path: str) -> tuple[str, dict[str, SectionProfile]]:
    """The pipeline name and every section's profile; PipelineError naming the path and field."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PipelineError(f"--costs {path}: file not found (write one with `maestro profile`)") from None
    except (OSError, ValueError) as exc:
        raise PipelineError(f"--costs {path}: not a JSON cost file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("sections"), dict):
        raise PipelineError(f"--costs {path}: no 'sections' object (is this a `maestro profile` file?)")
    out: dict[str, SectionProfile] = {}
    fields = {f.name for f in dataclasses.fields(Cost)}
    for name, body in data["sections"].items():
        where = f"--costs {path}: sections.{name}"
        cost = body.get("cost") if isinstance(body, dict) else None
        if not isinstance(cost, dict):
            raise PipelineError(f"{where}.cost is missing")
        unknown = set(cost) - fields
        if unknown:
            raise PipelineError(f"{where}.cost: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            values = {k: (v if k == "padded" else float(v)) for k, v in cost.items()}
            if "per_micro_batch_s" not in values:  # a file from before Cost had the fixed cost
                values["per_micro_batch_s"] = float(body.get("micro_batch_overhead_s", 0.0))
            c = Cost(**values)
            c.validate(where)
            extra = {k: float(body.get(k, 0.0)) for k in ("micro_batch_overhead_s", "memory_base_mb",
                                                          "peak_memory_mb_per_sample", "runtime_overhead_s",
                                                          "step_overhead_s", "grad_mb", "param_mb", "tp_share", "unit_mb")}
        except (TypeError, ValueError) as exc:
            raise PipelineError(f"{where}: {exc}") from None
        for k, v in extra.items():  # max(0, nan) is 0 downstream: a NaN limit would always fit
            if not math.isfinite(v) or v < 0 or (k == "tp_share" and v > 1):
                raise PipelineError(f"{where}.{k}: {body.get(k)!r} is not "
                                    f"{'a share from 0 to 1' if k == 'tp_share' else 'a finite number >= 0'}")
        out[name] = SectionProfile(cost=c, **extra)
    return str(data.get("pipeline", "")), out


def read_planning_s(path: str) -> float:
    """The file's per-step planning time (0 for files written before it was measured)."""
    try:
        with open(path) as f:
            return float(json.load(f).get("planning_s", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def load_cost_file(path: str) -> dict[str, Cost]:
    """Section name -> Cost from a cost file."""
    return {n: p.cost for n, p in read_cost_file(path)[1].items()}


def file_overrides(pipeline: Pipeline, path: str) -> dict[str, Any]:
    """`Pipeline.override` keys that give each section the cost file's cost for it; a file of
    another pipeline (by name) is refused: its sections' costs are another model's."""
    profiled, profiles = read_cost_file(path)
    return cost_overrides(pipeline, {n: p.cost for n, p in profiles.items()}, f"--costs {path}", profiled)


def cost_overrides(pipeline: Pipeline, costs: dict[str, Cost], where: str = "--costs",
                   profiled: str = "") -> dict[str, Any]:
    """`Pipeline.override` keys that replace each profiled section's cost (`profiled`: the name of
    the pipeline the costs were measured on, when known)."""
    if profiled and profiled != pipeline.name:
        raise PipelineError(f"{where}: the costs were measured on pipeline {profiled!r}, not {pipeline.name!r}; "
                            f"profile this pipeline (maestro profile PIPELINE --out FILE)")
    names = set(pipeline.section_names)
    unknown = sorted(set(costs) - names)
    if unknown:
        raise PipelineError(f"{where}: section(s) {', '.join(unknown)} are not in pipeline {pipeline.name!r} "
                            f"(sections: {', '.join(pipeline.section_names)}); profile this pipeline again")
    return {f"sections.{n}.cost": dataclasses.asdict(c) for n, c in costs.items()}


def apply_cost_file(pipeline: Pipeline, path: str) -> Pipeline:
    """`pipeline` with each section's cost replaced by the file's (sections not in it keep theirs)."""
    return pipeline.override(**file_overrides(pipeline, path))


def write_cost_file(path: str, data: dict[str, Any]) -> None:
    import os

    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"version": VERSION, **data}, f, indent=1, sort_keys=False)
        f.write("\n")
