"""`maestro tune`: load the pipeline, its sample metadata and costs, run the (pure) tuner, format.

The tensor-parallel sizes each section can take come from its stage class (a tp_plan or its own
parallelize, and check_tp), without building it.
Runs in the CLI process; starts nothing and builds no stage. Costs come from `--costs FILE`
(a `maestro profile` file: fitted costs, per-micro-batch overhead and memory model; refused
when not measured on this pipeline, runtime/costfile.check_cost_file) or else the pipeline's own
`Cost` records (no memory model: the memory limit cannot be checked then, nor for a section the
file did not measure: a note names them).
Sample metadata come from `--trace-in` (JSON Lines) or the pipeline's dataset.
A cost file also carries the runtime's own costs (per micro-batch, per step, planning), and when
every section runs on the CPU the simulation shares `cpu_cores` cores between the worker
processes (default the cores this process may run on, len(os.sched_getaffinity(0)); see
planner/tune_model.py for the approximation).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.overrides import parse_set, with_global_batch
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.tune import Candidate, MemoryModel, TuneResult, representative_batch, to_overrides, tune
from maestro_flow.planner.tune_model import TP_EFFICIENCY
from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.costfile import check_cost_file, cost_overrides, read_costs, unmeasured_note
from maestro_flow.runtime.profile_fit import state_copies
from maestro_flow.wording import count


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneOptions:
    overrides: dict[str, Any]
    devices: int
    memory_gb: float | None = None
    costs: str | None = None
    global_batch: int | None = None
    trace_in: str | None = None
    top: int = 5
    batches: int | None = None  # global batches to average the simulated step over (None: auto_batches)
    cpu_cores: int | None = None  # CPU contention; default len(os.sched_getaffinity(0)) when every section is on the CPU
    max_tp: int | None = None  # the largest tensor-parallel size searched (1: none; None: MAX_TP, none on the CPU)
    tp_efficiency: float | None = None  # None: 0.8 on GPUs, none on the CPU (no faster than one rank)


def tune_pipeline(path: str, options: TuneOptions) -> tuple[TuneResult, list[str]]:
    """The tuning result and notes worth telling the user (e.g. the memory limit went unchecked)."""
    pipeline, costs, batches, kwargs, notes = _inputs(path, options)
    result = tune(pipeline, costs, batches, devices=options.devices, top=options.top,
                  tp_options=_tp_options(pipeline, options, notes), tp_capable=tp_capable(pipeline), **kwargs)
    return result, notes


def predict(path: str, options: TuneOptions, micro_batch: int | None = None) -> tuple[Candidate, Any]:
    """The predicted step of the pipeline as configured (its own dp, micro-batch and tp), and of
    the monolithic baseline on `options.devices` devices at `micro_batch` (default: its best;
    None when it does not fit memory)."""
    from maestro_flow.planner.tune import Tuner, monolithic_for

    pipeline, costs, batches, kwargs, _ = _inputs(path, options)
    tp = {s.name: s.tp for s in pipeline.sections}
    tuner = Tuner(pipeline, costs, batches, devices=max(options.devices, sum(s.dp * s.tp for s in pipeline.sections)),
                  tp=tp, **kwargs)
    own = tuner.evaluate(tuple((s.name, s.dp, s.micro_batch) for s in pipeline.sections))
    return own, monolithic_for(pipeline, costs, batches, options.devices, kwargs,
                               micro_batches=[micro_batch] if micro_batch else None)


SAMPLES_TO_SIMULATE = 256  # at least this many samples over the representative batches (auto_batches)


def auto_batches(global_batch: int) -> int:
    """How many representative batches the tuner simulates by default: enough to cover
    SAMPLES_TO_SIMULATE samples, at most 16. One small batch is a poor sample of a long-tailed
    length distribution: for pipelines/vlm.py (24 samples) one batch predicted 34.6 ms where 32
    predicted 40.0 ms and a real run measured 40.8 ms."""
    return max(1, min(16, -(-SAMPLES_TO_SIMULATE // max(1, global_batch))))


def _inputs(path: str, options: TuneOptions) -> tuple[Any, CostModel, list, dict[str, Any], list[str]]:
    """(pipeline with the cost file's costs, cost model, representative batches, the tuner's
    keyword options, notes)."""
    overrides = dict(options.overrides)
    if options.global_batch is not None:
        overrides["global_batch"] = options.global_batch
    pipeline, _ = load_pipeline(path, overrides)
    notes: list[str] = []
    memory, overhead = None, None
    calibration: dict[str, Any] = {}
    if options.costs:
        cost_file = read_costs(options.costs)
        check_cost_file(pipeline, cost_file)
        profiles = cost_file.sections
        pipeline = pipeline.override(**cost_overrides(pipeline, {n: p.cost for n, p in profiles.items()},
                                                      f"--costs {options.costs}"))
        fed, feeding = {e.dst for e in pipeline.edges}, {e.src for e in pipeline.edges}
        trains = {s.name for s in pipeline.sections if s.trainable}
        memory = {n: MemoryModel(base_mb=p.memory_base_mb, per_sample_mb=p.peak_memory_mb_per_sample,
                                 param_mb=p.param_mb, copies=copies(pipeline.section(n), p), tp_share=p.tp_share,
                                 trained=trained_share(p),
                                 unit_mb=p.unit_mb,  # graph.lockstep, less what the search varies (fsdp, tp)
                                 lockstep=n not in feeding if n in trains else n not in fed)
                  for n, p in profiles.items() if n in {s.name for s in pipeline.sections}}
        overhead = None  # the cost file's fitted fixed cost per micro-batch is in its Cost (per_micro_batch_s)
        calibration = {"runtime_s": {n: p.runtime_overhead_s for n, p in profiles.items()},
                       "message_s": {n: p.message_s for n, p in profiles.items()},
                       "step_s": {n: p.step_overhead_s for n, p in profiles.items()},
                       "grad_mb": {n: p.grad_mb for n, p in profiles.items()},
                       "planning_s": cost_file.planning_s}
        unmeasured = unmeasured_note(pipeline, cost_file)
        if unmeasured:
            notes.append(unmeasured + (", and its memory is not checked against --memory-gb"
                                       if options.memory_gb is not None else ""))
    else:
        notes.append(costs_note(pipeline))
    pipeline.validate()
    SectionGraph(pipeline)
    limit = options.memory_gb * 1024 if options.memory_gb is not None else None
    if limit is not None and memory is None:
        notes.append("--memory-gb is not checked: no memory model without --costs")
        limit = None
    if options.trace_in:
        from maestro_flow.runtime.planning import read_trace

        pool = read_trace(options.trace_in, pipeline)
    else:
        from maestro_flow.runtime.checks import check_pipeline

        pool = check_pipeline(pipeline).metadata
    n_batches = auto_batches(pipeline.global_batch) if options.batches is None else max(1, options.batches)
    batches = [representative_batch(pool, pipeline.global_batch, seed=pipeline.seed + i) for i in range(n_batches)]
    costs = CostModel(costs={s.name: s.cost for s in pipeline.sections})
    cores = options.cpu_cores
    if cores is None and all(on_cpu(s.device) for s in pipeline.sections):
        cores = len(os.sched_getaffinity(0))  # the cores this process (and its workers) may run on
    if cores:
        notes.append(f"CPU workers share {count(cores, 'core')} (contention modelled; --cpu-cores "
                     "to change)")
    # Found in QA: on the CPU a tp=2 replica charged as 1.6x one rank ranked first, and ran 5-7x slower.
    efficiency = {s.name: options.tp_efficiency if options.tp_efficiency is not None else
                  None if on_cpu(s.device) else TP_EFFICIENCY for s in pipeline.sections}
    kwargs = {"memory_limit_mb": limit, "memory": memory, "overhead_s": overhead, "cpu_cores": cores or None,
              "tp_efficiency": efficiency, **calibration}
    return pipeline, costs, batches, kwargs, notes


def _tp_options(pipeline: Any, options: TuneOptions, notes: list[str]) -> dict[str, list[int]]:
    """Section -> the tensor-parallel sizes tune searches (its stage's, up to --max-tp and
    --devices; by default none but its own on the CPU), with notes saying which."""
    tp_options = allowed_tp(pipeline, MAX_TP if options.max_tp is None else options.max_tp, options.devices)
    if options.max_tp is None:  # by default none on the CPU, where gloo's all-reduces cost more than tp saves
        skipped = [s for s in pipeline.sections if on_cpu(s.device) and len(tp_options[s.name]) > len({1, s.tp})]
        tp_options.update({s.name: sorted({1, s.tp}) for s in skipped})
        if skipped:
            notes.append(f"tensor parallelism not searched for {', '.join(s.name for s in skipped)}: on the CPU its "
                         f"all-reduces over gloo cost more than it saves (--max-tp N to search it anyway)")
    searched = [f"{n} {'/'.join(map(str, v))}" for n, v in tp_options.items() if len(v) > 1]
    if searched:
        notes.append(f"tensor parallelism searched: {', '.join(searched)} (--max-tp to change)")
    on_the_cpu = [s.name for s in pipeline.sections if on_cpu(s.device) and len(tp_options[s.name]) > 1]
    if on_the_cpu and options.tp_efficiency is None:
        notes.append(f"tensor parallelism of {', '.join(on_the_cpu)} on the CPU is counted no faster than one rank "
                     "(gloo's all-reduces cost about what it saves, or more), its memory saving in full "
                     "(--tp-efficiency E: count a tp replica as tp x E as fast)")
    return tp_options


def trained_share(profile: Any) -> float:
    """The share of a section's parameter bytes that train (grad_mb of param_mb; 1 where unknown)."""
    if profile.param_mb <= 0 or profile.grad_mb <= 0:
        return 1.0
    return min(1.0, profile.grad_mb / profile.param_mb)


def copies(section: Any, profile: Any) -> float:
    """Bytes of training state per parameter byte, as `maestro profile` counts them: the
    optimizer's copies for the parameters that train (`trained_share`), one for the rest."""
    n = state_copies(section.trainable, section.optimizer)
    return float(n) if n == 1 else 1.0 + trained_share(profile) * (n - 1)


def costs_note(pipeline: Any) -> str:
    """Where the costs come from without --costs: the sections' Cost records, and which sections
    declare none (they are costed at Cost()'s defaults: a guess, not a measurement)."""
    from maestro_flow.config import Cost

    default = [s.name for s in pipeline.sections if s.cost == Cost()]
    if not default:
        return "costs: the pipeline's Cost records (run `maestro profile` and pass --costs for measured ones)"
    which = "no section declares" if len(default) == len(pipeline.sections) else f"{', '.join(default)} declare{'s' if len(default) == 1 else ''} no"
    return (f"costs: {which} a Cost, so the defaults are used there ({Cost().per_sample_s * 1e3:g} ms a sample, "
            f"nothing per micro-batch or token): a guess; run `maestro profile` and pass --costs")


MAX_TP = 8  # the largest tensor parallelism searched on GPUs unless --max-tp says otherwise


def allowed_tp(pipeline: Any, max_tp: int, devices: int | None = None) -> dict[str, list[int]]:
    """Each section's tensor-parallel sizes up to max_tp and `devices` that `maestro run` accepts
    (checks.check_tensor_parallel): a tp_plan (or its own parallelize), a configuration its
    check_tp accepts, and every dimension the plan shards dividing by tp (the stage built once
    on the meta device); the pipeline's own tp always."""
    from maestro_flow.parallel.tp import check_plan
    from maestro_flow.runtime.build import build_stage

    out = {}
    largest = min(max_tp, devices) if devices is not None else max_tp
    for s in pipeline.sections:
        values = {s.tp}
        cls, own, plan = _tp_plan(s)
        stage = None
        for t in (2, 4, 8, 16):
            if not (own or plan) or t > largest:
                continue
            try:
                cls.check_tp(dict(s.config), t)
            except ValueError:
                continue
            if not own:
                if stage is None:
                    try:
                        stage = build_stage(pipeline, s, 0, "cpu", meta=True)
                    except Exception:  # noqa: BLE001 (the run's own check would refuse it as well)
                        break
                if check_plan(stage, plan, t):
                    continue
            values.add(t)
        out[s.name] = sorted(values | {1})
    return out


def _tp_plan(section: Any) -> tuple[Any, bool, dict]:
    """A section's stage class, whether it overrides `parallelize`, and its tp_plan ({} when it
    has none, or when the stage cannot be resolved: the run's own checks refuse that)."""
    from maestro_flow.runtime.build import resolve
    from maestro_flow.stage import Stage

    try:
        cls = resolve(section.stage, f"sections.{section.name}.stage")
        own = cls.parallelize is not Stage.parallelize
        return cls, own, ({} if own else cls.tp_plan(dict(section.config)))
    except Exception:  # noqa: BLE001
        return None, False, {}


def tp_capable(pipeline: Any) -> set[str]:
    """The sections whose stage can be tensor-parallel at all (a tp_plan or its own parallelize)."""
    return {s.name for s in pipeline.sections if any(_tp_plan(s)[1:])}


def on_cpu(device: str) -> bool:
    """Whether a section's device setting puts its workers on the CPU of this host."""
    if device == "cpu":
        return True
    if device == "auto":
        try:
            import torch

            return not torch.cuda.is_available()
        except ImportError:
            return True
    return False


def format_result(result: TuneResult, current: Candidate | None = None, path: str = "PIPE") -> str:
    """The best configurations side by side (one column each), then the uniform baseline (`path`:
    the pipeline and its overrides as command-line words, for the command printed)."""
    cols: list[tuple[str, Candidate]] = [(f"#{i + 1}", c) for i, c in enumerate(result.best)]
    if result.uniform is not None:
        cols.append(("uniform", result.uniform))
    if not cols:
        return "no configuration"
    names = [n for n, _, _ in cols[0][1].layout]
    rows: list[list[str]] = [[""] + [h for h, _ in cols]]
    rows.append(["step (simulated)"] + [f"{c.step_s * 1e3:.1f} ms" for _, c in cols])
    best = cols[0][1].step_s

    def vs_best(step_s: float) -> str | None:
        return f"{step_s / best:.2f}x" if best > 0 else None

    rows.append(["vs #1"] + [vs_best(c.step_s) or "-" for _, c in cols])
    rows.append(["devices"] + [str(c.devices) for _, c in cols])
    for n in names:
        rows.append([f"{n} dp x mb"] + [f"{c.dp(n)} x {c.micro_batch(n)}" for _, c in cols])
        if any(c.tp.get(n, 1) > 1 or c.fsdp.get(n) for _, c in cols):
            rows.append([f"{n} tp, fsdp"] + [f"{c.tp.get(n, 1)}, {'yes' if c.fsdp.get(n) else 'no'}" for _, c in cols])
        rows.append([f"{n} busy"] + [f"{c.utilisation[n] * 100:.0f}%" for _, c in cols])
        if any(c.memory_mb[n] for _, c in cols):
            rows.append([f"{n} memory"] + [_mb(c.memory_mb[n]) for _, c in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    # found in QA: "1 configurations simulated, 2 scored" (what was scored was not said)
    lines.append(f"({count(result.evaluated, 'configuration')} simulated, "
                 f"{count(result.scored, 'dp layout')} scored by the analytic model, {result.devices} devices)")
    mono = result.monolithic
    if mono is not None:
        fewer = f", its fastest count of at most {result.devices}" if mono.devices < result.devices else ""
        lines.append(f"monolithic baseline (every section on each of {count(mono.devices, 'rank')}{fewer}, micro-batch "
                     f"{mono.micro_batch}): {mono.step_s * 1e3:.1f} ms per step; #1 is "
                     f"{vs_best(mono.step_s) or 'as fast as'} its throughput (maestro run {path} --baseline "
                     f"monolithic --devices {mono.devices} --micro-batch {mono.micro_batch})")
    return "\n".join(lines)


def write_overrides(path: str, candidate: Candidate, global_batch: int | None = None,
                    given: Sequence[str] = ()) -> None:
    """The candidate's `--set`s, after what it was tuned with: the user's own `--set`s (`given`)
    and the global batch when not the pipeline's (where they overlap, the candidate's win).

    One `--set KEY=VALUE` a line, each a single shell word (`one_word`): the file is read back by
    `maestro run PIPE --set-file FILE` (cli_sets), or by `$(cat FILE)`, which splits it at whitespace."""
    sets = [*with_global_batch(given, global_batch), *to_overrides(candidate)]
    text = "\n".join(f"--set {one_word(s)}" for s in sets) + "\n"  # refused before the file is touched
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as profile --out does
    with open(path, "w") as f:
        f.write(text)


def one_word(item: str) -> str:
    """A `--set KEY=VALUE` item with no whitespace that parses as the same override: the value as compact
    JSON, a space inside a string written as the JSON escape \\u0020 (json.dumps escapes every other
    whitespace character already). A key with whitespace (a config dict key) cannot be written so: refused."""
    ((key, value),) = parse_set([item]).items()
    if any(c.isspace() for c in key):
        raise PipelineError(f"--write: cannot write --set {key!r}: its key holds whitespace, which "
                            f"`$(cat FILE)` would split; pass that override to maestro run yourself")
    return f"{key}=" + json.dumps(value, separators=(",", ":")).replace(" ", "\\u0020")


def _mb(value: float) -> str:
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.0f} MiB"
