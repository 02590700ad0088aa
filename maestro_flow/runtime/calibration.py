"""Calibrating a cost file against a real multi-worker run (`maestro profile`, after profiling).

Runs in the CLI process. The profile times each section alone, in one pinned worker; a real
run differs from that by what only a real run has: its neighbours computing on the other cores
at the same time (shared caches and memory bandwidth), the executor's own work per micro-batch
(reading rows, transfers, bookkeeping), the micro-batches the plan actually cuts. So the
pipeline runs in section mode for WARMUP_STEPS + `steps` steps, every section at dp 1 (with as many sections
as cores, one pinned worker per core: no time sharing, which the tuner models by itself) with
the profiled costs, and for each section the busy time the last `steps` of them measured (the executor's,
optimizer step left out) is set against what the profile predicts for the micro-batches the
plan ran (with the tensor messages it received, planner/simulate.message_counts): their ratio
scales the section's cost terms, runtime overhead and cost per message in the cost file
(`calibration` records the factors and the run). The tuner then predicts from costs a real run
of this machine had.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any

from maestro_flow.runtime.costfile import check_cost_file, read_costs

WARMUP_STEPS = 4  # run before the `steps` that are measured (workers start, caches fill, costs settle)


def calibrate(path: str, overrides: dict[str, Any], cost_file: str, *, steps: int = 14, warmup: int = WARMUP_STEPS,
              log: Any = None) -> dict[str, float]:
    """Run the pipeline `warmup` + `steps` steps, rewrite `cost_file` with the costs calibrated on
    the last `steps`; returns section -> factor."""
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.checks import check_pipeline
    from maestro_flow.runtime.costfile import cost_overrides
    from maestro_flow.runtime.run import RunOptions, run_pipeline
    from maestro_flow.samples import SampleMeta

    log = log or (lambda _msg: None)
    pipeline, _ = load_pipeline(path, dict(overrides))
    written = read_costs(cost_file)
    check_cost_file(pipeline, written)
    profiles = written.sections
    layout = {f"sections.{s.name}.{k}": v for s in pipeline.sections for k, v in (("dp", 1), ("tp", 1), ("fsdp", False))}
    costs = cost_overrides(pipeline, {n: p.cost for n, p in profiles.items()}, f"--costs {cost_file}")
    run_sets = {**overrides, **layout, **costs, "steps": steps + warmup, "adapt_costs": False}
    meta: dict[int, SampleMeta] = {s.id: s for s in check_pipeline(pipeline.override(**run_sets)).metadata}
    with tempfile.TemporaryDirectory(prefix="maestro-calibrate-") as folder:
        rows = run_pipeline(path, RunOptions(overrides=run_sets, show_progress=False, run_dir=folder, pin_cpus=True))
        with open(os.path.join(folder, "plans.jsonl")) as f:
            plans = [json.loads(line) for line in f]
    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner.cost import CostModel
    from maestro_flow.planner.simulate import messages_received, micro_batch_task_s

    sections = {s.name: s for s in pipeline.sections}
    graph = SectionGraph(pipeline)
    factors: dict[str, float] = {}
    measured_steps = list(zip(plans, rows, strict=False))[warmup:]
    received = [messages_received(graph, plan["sections"]) for plan, _ in measured_steps]
    for name, prof in profiles.items():
        if name not in sections:
            continue
        model = CostModel(costs={name: prof.cost})
        ratios = []
        for (plan, row), messages in zip(measured_steps, received, strict=True):
            mbs = [mb for rep in plan["sections"][name]["replicas"] for mb in rep]
            predicted = sum(micro_batch_task_s(graph, model, name, [meta[i] for i in mb]) + prof.runtime_overhead_s
                            for mb in mbs) + messages.get(name, 0) * prof.message_s
            measured = row["sections"][name]["busy_s"] - (prof.step_overhead_s if sections[name].trainable else 0.0)
            if predicted > 0 and measured > 0:
                ratios.append(measured / predicted)
        if ratios:
            factors[name] = statistics.median(ratios)
            log(f"{name}: a real run's busy time is {factors[name]:.2f}x the profile's (median over {len(ratios)} "
                "steps); costs scaled by it")
    _rewrite(cost_file, factors, steps)
    return factors


def _rewrite(cost_file: str, factors: dict[str, float], steps: int) -> None:
    with open(cost_file) as f:
        data = json.load(f)
    for name, factor in factors.items():
        body = data["sections"][name]
        for key in ("per_micro_batch_s", "per_sample_s", "per_token_s", "per_patch_s", "per_frame_s"):
            body["cost"][key] = body["cost"].get(key, 0.0) * factor
        body["micro_batch_overhead_s"] = body["cost"]["per_micro_batch_s"]
        body["runtime_overhead_s"] = body.get("runtime_overhead_s", 0.0) * factor
        body["message_s"] = body.get("message_s", 0.0) * factor
    data["calibration"] = {"factors": factors, "steps": steps,
                           "how": "section mode, every section dp 1, one pinned worker per core"}
    tmp = cost_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, cost_file)
