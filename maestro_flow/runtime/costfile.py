"""The cost file `maestro profile` writes and `run`/`plan`/`tune --costs FILE` read.

Runs in the CLI/coordinator process; JSON only (no torch), so reading a cost file is cheap. The
reading is the door (`read_costs`): every field is checked there, with an error naming the file
and the field; `check_cost_file` then refuses a file that does not describe the pipeline.
Format (version 2):

    {"version": 2, "pipeline": NAME, "machine": {..., "cores": the machine's cores}, "created": ISO time,
     "sections": {NAME: {"profiled_with": {...},        # what the measurement depends on (see below)
                         "cost": {per_sample_s, per_token_s, per_patch_s, per_frame_s, backward_factor,
                                  per_micro_batch_s, padded},
                         "micro_batch_overhead_s": s,      # fixed time per micro-batch (forward)
                         "memory_base_mb": MB,             # parameters, gradients, optimizer state + fixed
                         "peak_memory_mb_per_sample": MB,  # activations per sample in a micro-batch
                         "runtime_overhead_s": s,          # executor's own cost per micro-batch (calibrated)
                         "message_s": s,                   # its own time per tensor message received
                                                           # (calibrated; optional, 0 where absent)
                         "step_overhead_s": s,             # optimizer step etc. once per step (trainable)
                         "grad_mb": MB,                    # gradient size (all-reduce estimate when dp > 1)
                         "param_mb": MB,                   # parameters (what tp and fsdp shard)
                         "tp_share": f,                    # share of param_mb the stage's tp_plan shards
                         "unit_mb": MB,                    # its largest FSDP unit (a block)
                         "device": "cpu" | "cuda:0", "memory_method": "...",
                         "measurements": [{micro_batch, samples, tokens, patches, frames,
                                           forward_s, backward_s, peak_mb}, ...]}},
     "unmeasured": {NAME: {"reason": why, "profiled_with": {...}}},  # sections no sample activated
     "planning_s": s}                                      # one plan of a global batch (per step)

Every field above but machine, created, device, memory_method, measurements and unmeasured is
required. `profiled_with` (`profiled_with()`) is a section's stage, config, device setting,
trainable, optimizer (its name and the options that add state or change its kernels:
OPTIMIZER_KEYS; not lr, betas, weight decay or the schedule), activates_on and columns, and the
pipeline's dtype, mixed_precision and data.modality_columns: a file whose sections were
profiled with other values is refused, naming the section and the fields (another model's
parameters, memory and times would be planned and tuned with). dp, micro_batch, tp and fsdp are
not in it: the profile measures every section at dp 1, tp 1, without FSDP, at several
micro-batch sizes, and the tuner scales from there.

Version 1 files (written before `profiled_with`, `unmeasured` and the required fields) are
refused with a request to profile again: nothing in them says which model they measured.

`cost` is what the planner uses (Pipeline sections' `cost`); the overhead and memory figures
are what `maestro tune` adds on top.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from maestro_flow.config import Cost, Pipeline, Section, is_number
from maestro_flow.errors import PipelineError
from maestro_flow.runtime.outputs import check_writable
from maestro_flow.wording import ABSENT, changed_keys, cut

VERSION = 2
FIGURES = ("micro_batch_overhead_s", "memory_base_mb", "peak_memory_mb_per_sample", "runtime_overhead_s",
           "step_overhead_s", "grad_mb", "param_mb", "tp_share", "unit_mb")
OPTIONAL_FIGURES = ("message_s",)  # absent from files written before it: 0
COST_FIELDS = tuple(f.name for f in dataclasses.fields(Cost))
REPROFILE = "re-run `maestro profile PIPELINE --out FILE` for this pipeline"
OPTIMIZER_KEYS = ("name", "amsgrad", "momentum", "nesterov", "fused", "capturable", "maximize")


@dataclass(frozen=True, kw_only=True, slots=True)
class SectionProfile:
    cost: Cost
    micro_batch_overhead_s: float = 0.0
    memory_base_mb: float = 0.0
    peak_memory_mb_per_sample: float = 0.0
    runtime_overhead_s: float = 0.0
    message_s: float = 0.0
    step_overhead_s: float = 0.0
    grad_mb: float = 0.0
    param_mb: float = 0.0
    tp_share: float = 0.0
    unit_mb: float = 0.0
    profiled_with: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostFile:
    """A checked cost file: the measured sections, those no sample activated (name -> their
    `reason` and `profiled_with`) and the planning time per step."""

    path: str
    pipeline: str
    sections: dict[str, SectionProfile]
    unmeasured: dict[str, dict[str, Any]]
    planning_s: float


def _number(value: Any, where: str, share: bool = False) -> float:
    # A bool is not a figure (float(True) is 1.0), and max(0, nan) is 0 downstream: a NaN limit would always fit.
    if not is_number(value) or not math.isfinite(value) or value < 0 or (share and value > 1):
        raise PipelineError(f"{where}: {value!r} is not {'a share from 0 to 1' if share else 'a finite number >= 0'}")
    return float(value)


def read_costs(path: str) -> CostFile:
    """The whole cost file, every field checked; PipelineError naming the path and field."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PipelineError(f"--costs {path}: file not found (write one with `maestro profile`)") from None
    except (OSError, ValueError) as exc:
        raise PipelineError(f"--costs {path}: not a JSON cost file ({exc})") from None
    where = f"--costs {path}"
    if not isinstance(data, dict) or not isinstance(data.get("sections"), dict):
        raise PipelineError(f"{where}: no 'sections' object (is this a `maestro profile` file?)")
    version = data.get("version")
    if version == 1:
        raise PipelineError(f"{where}: a version 1 cost file, which does not record what each section was "
                            f"profiled with (stage, config, device, dtype), so it cannot be checked against "
                            f"the pipeline; {REPROFILE}")
    if version != VERSION or isinstance(version, bool):
        raise PipelineError(f"{where}: version {version!r} is not a cost file version this maestro reads "
                            f"({VERSION}); {REPROFILE}")
    if not isinstance(data.get("pipeline"), str) or not data["pipeline"]:
        raise PipelineError(f"{where}: 'pipeline' (the name of the pipeline profiled) is missing; {REPROFILE}")
    if not data["sections"]:
        raise PipelineError(f"{where}: 'sections' is empty: no section was measured; {REPROFILE}")
    sections = {name: _section(body, f"{where}: sections.{name}") for name, body in data["sections"].items()}
    unmeasured = data.get("unmeasured", {})
    if not isinstance(unmeasured, dict) or not all(
            isinstance(b, dict) and isinstance(b.get("profiled_with"), dict) for b in unmeasured.values()):
        raise PipelineError(f"{where}: 'unmeasured' must map section names to {{reason, profiled_with}}")
    if "planning_s" not in data:
        raise PipelineError(f"{where}: planning_s is missing; {REPROFILE}")
    planning_s = _number(data["planning_s"], f"{where}: planning_s")
    return CostFile(path=path, pipeline=data["pipeline"], sections=sections, unmeasured=unmeasured,
                    planning_s=planning_s)


def _section(body: Any, where: str) -> SectionProfile:
    cost = body.get("cost") if isinstance(body, dict) else None
    if not isinstance(cost, dict):
        raise PipelineError(f"{where}.cost is missing")
    unknown, missing = set(cost) - set(COST_FIELDS), [k for k in COST_FIELDS if k not in cost]
    if unknown:
        raise PipelineError(f"{where}.cost: unknown field(s) {', '.join(sorted(unknown))}")
    if missing:
        raise PipelineError(f"{where}.cost: missing field(s) {', '.join(missing)}")
    lacking = [k for k in (*FIGURES, "profiled_with") if k not in body]
    if lacking:
        raise PipelineError(f"{where}: missing field(s) {', '.join(lacking)}")
    if not isinstance(body["profiled_with"], dict):
        raise PipelineError(f"{where}.profiled_with must be an object, got {body['profiled_with']!r}")
    values = {k: (v if k == "padded" else _number(v, f"{where}.cost.{k}")) for k, v in cost.items()}
    c = Cost(**values)
    c.validate(where)
    figures = {k: _number(body[k], f"{where}.{k}", share=k == "tp_share") for k in FIGURES}
    figures.update({k: _number(body[k], f"{where}.{k}") for k in OPTIONAL_FIGURES if k in body})
    return SectionProfile(cost=c, **figures, profiled_with=body["profiled_with"])


def read_cost_file(path: str) -> tuple[str, dict[str, SectionProfile]]:
    """The pipeline name and every measured section's profile (`read_costs`, in short)."""
    costs = read_costs(path)
    return costs.pipeline, costs.sections


def read_planning_s(path: str) -> float:
    """The file's per-step planning time (checked: a finite number >= 0)."""
    return read_costs(path).planning_s


def load_cost_file(path: str) -> dict[str, Cost]:
    """Section name -> Cost from a cost file."""
    return {n: p.cost for n, p in read_cost_file(path)[1].items()}


def _plain(value: Any) -> Any:
    """As JSON holds it (tuples are lists), so a fingerprint compares equal to its own reading."""
    return json.loads(json.dumps(value, sort_keys=True))


def profiled_with(pipeline: Pipeline, section: Section) -> dict[str, Any]:
    """What a section's measured costs and memory depend on (the cost file's `profiled_with`)."""
    # What sizes or times the optimizer's step: its class, and the options that add state
    # (AdamW's amsgrad, SGD's momentum buffer) or change its kernels; not lr, betas, weight decay...
    optimizer = {k: v for k, v in section.optimizer.items() if k in OPTIMIZER_KEYS}
    optimizer.setdefault("name", "adamw")
    return _plain({"stage": section.stage, "config": section.config, "device": section.device,
                   "trainable": section.trainable, "optimizer": optimizer if section.trainable else None,
                   "activates_on": section.activates_on, "columns": section.columns, "dtype": pipeline.dtype,
                   "mixed_precision": pipeline.mixed_precision,
                   "modality_columns": pipeline.data.modality_columns})


def _changed(was: dict[str, Any], now: dict[str, Any], most: int = 6) -> list[str]:
    """The fields that differ, named down to the values ("config.d_model (256, now 1024)"; found
    in QA: two levels deep, a nested config showed both dicts cut before the change), the first
    `most` of them."""
    changed = [f"{where} ({_show(a)}, now {_show(b)})" for where, a, b in changed_keys(was, now)]
    return changed if len(changed) <= most + 1 else changed[:most] + [f"and {len(changed) - most} more"]


def _show(value: Any) -> str:
    return cut("unset" if value is ABSENT else repr(value), 60)


def check_cost_file(pipeline: Pipeline, costs: CostFile) -> None:
    """Refuse a cost file that was not measured on `pipeline` as it is now: another pipeline's,
    one with sections it lacks or lacks sections it has, or a section profiled with another
    stage, config, device, dtype, ... (`profiled_with`)."""
    where = f"--costs {costs.path}"
    if costs.pipeline != pipeline.name:
        raise PipelineError(f"{where}: the costs were measured on pipeline {costs.pipeline!r}, not "
                            f"{pipeline.name!r}; profile this pipeline (maestro profile PIPELINE --out FILE)")
    recorded = {**{n: b["profiled_with"] for n, b in costs.unmeasured.items()},
                **{n: p.profiled_with for n, p in costs.sections.items()}}
    names = pipeline.section_names
    unknown = sorted(set(recorded) - set(names))
    if unknown:
        raise PipelineError(f"{where}: section(s) {', '.join(unknown)} are not in pipeline {pipeline.name!r} "
                            f"(sections: {', '.join(names)}); {REPROFILE}")
    missing = [n for n in names if n not in recorded]
    if missing:
        raise PipelineError(f"{where}: section(s) {', '.join(missing)} of pipeline {pipeline.name!r} are not in "
                            f"the file (profiled: {', '.join(recorded)}); {REPROFILE}")
    for s in pipeline.sections:
        was = dict(recorded[s.name])
        if isinstance(was.get("optimizer"), dict):  # as profiled_with reads it now (a file of before 2026-11-27's
            was["optimizer"] = {"name": "adamw", **{k: v for k, v in was["optimizer"].items()  # last change kept all)
                                                   if k in OPTIMIZER_KEYS}}
        changed = _changed(was, profiled_with(pipeline, s))
        if changed:
            raise PipelineError(f"{where}: sections.{s.name} was profiled with another {', '.join(changed)}: the "
                                f"times and memory measured then need not hold now; {REPROFILE}")


def unmeasured_note(pipeline: Pipeline, costs: CostFile) -> str | None:
    """What to tell a user whose cost file measured no cost for some sections (no sample of the
    dataset activated them when it was profiled): those keep the pipeline's own Cost."""
    names = [f"{n} ({costs.unmeasured[n].get('reason', 'not measured')})" if n in costs.unmeasured else n
             for n in pipeline.section_names if n not in costs.sections]
    if not names:
        return None
    return f"--costs {costs.path} has no measurement of {', '.join(names)}: the pipeline's Cost is used for it"


def file_overrides(pipeline: Pipeline, path: str, notes: list[str] | None = None) -> dict[str, Any]:
    """`Pipeline.override` keys that give each measured section the cost file's cost for it;
    a file not measured on this pipeline is refused (check_cost_file). The unmeasured sections
    (unmeasured_note) are appended to `notes` where given."""
    costs = read_costs(path)
    check_cost_file(pipeline, costs)
    note = unmeasured_note(pipeline, costs)
    if note and notes is not None:
        notes.append(note)
    return cost_overrides(pipeline, {n: p.cost for n, p in costs.sections.items()}, f"--costs {path}")


def cost_overrides(pipeline: Pipeline, costs: dict[str, Cost], where: str = "--costs") -> dict[str, Any]:
    """`Pipeline.override` keys that replace each given section's cost."""
    unknown = sorted(set(costs) - set(pipeline.section_names))
    if unknown:
        raise PipelineError(f"{where}: section(s) {', '.join(unknown)} are not in pipeline {pipeline.name!r} "
                            f"(sections: {', '.join(pipeline.section_names)}); profile this pipeline again")
    return {f"sections.{n}.cost": dataclasses.asdict(c) for n, c in costs.items()}


def apply_cost_file(pipeline: Pipeline, path: str) -> Pipeline:
    """`pipeline` with each section's cost replaced by the file's (sections not in it keep theirs)."""
    return pipeline.override(**file_overrides(pipeline, path))


def check_out(path: str) -> None:
    """Refuse, before any work, a cost file path that cannot be written (runtime/outputs)."""
    check_writable(path, "--out", folder=False)


def write_cost_file(path: str, data: dict[str, Any]) -> None:
    """Write `data` as the cost file at `path` (a `staged` path: the caller makes it the file at
    once, so that a reader never sees half of one)."""
    with open(path, "w") as f:
        json.dump({"version": VERSION, **data}, f, indent=1, sort_keys=False)
        f.write("\n")


@contextlib.contextmanager
def staged(path: str) -> Iterator[str]:
    """A temporary path next to `path` that becomes `path` (a rename) when the block succeeds and
    is removed when it fails: a failed profile or calibration leaves no file, nor half of one."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.partial")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
