"""`maestro plan`: one step's plan and its simulation, from the dataset or a metadata trace.

Runs in the CLI process; starts nothing. With a trace (JSON Lines of sample metadata) the
dataset is not opened, so a plan can be studied for data that is not on this machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import CostModel, Plan, make_planner
from maestro_flow.planner.simulate import simulate
from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.checks import check_pipeline, pipeline_warnings
from maestro_flow.runtime.cpus import pipeline_search
from maestro_flow.runtime.sampler import EpochSampler
from maestro_flow.samples import SampleMeta

TRACE_REQUIRED = ("id", "modalities", "num_tokens")  # and num_patches / num_frames with an image / audio
SIZE_OF = {"image": "num_patches", "audio": "num_frames"}  # a modality's size, required where declared


def read_trace(path: str, pipeline: Any = None) -> list[SampleMeta]:
    """`--trace-in`: sample metadata as JSON Lines, one sample a line (TRACE_REQUIRED keys, and
    SIZE_OF's for the modalities it declares). With `pipeline`, the samples must fit its stages'
    token_limits as a run's data must (checks.check_token_limits; before, a trace of samples no
    run would take was planned, found in QA)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except UnicodeDecodeError:  # found in review: the dataset's .arrow file gave a traceback
        raise PipelineError(f"{path}: not UTF-8 text: give JSON Lines of sample metadata (one "
                            '{"id": ..., "num_tokens": ..., "modalities": [...]} a line)') from None
    except OSError as exc:
        raise PipelineError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    samples, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d: dict[str, Any] = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError(f"a JSON object a line, got {type(d).__name__}")
            missing = [key for key in TRACE_REQUIRED if key not in d]  # a default would plan 0 tokens (review)
            if not missing and isinstance(d["modalities"], list):  # an image of 0 patches, too (QA)
                missing = [SIZE_OF[m] for m in SIZE_OF if m in d["modalities"] and d.get(SIZE_OF[m]) is None]
            if missing:
                raise ValueError(f"no {' and no '.join(missing)}")
            # Found in QA: 0 was planned, though a dataset row without tokens is refused; then -5 was
            # "an integer >= 0" and 0 "at least 1".
            tokens = d["num_tokens"]
            if isinstance(tokens, (int, float)) and not isinstance(tokens, bool) and tokens < 1:
                raise ValueError(f"num_tokens must be at least 1, as a dataset row's tokens are, got {tokens}")
            sample = SampleMeta.from_dict({**d, "row": d.get("row", -1)})
        except (ValueError, KeyError, TypeError) as exc:
            raise PipelineError(f"{path}:{n}: not a sample metadata line ({exc})") from None
        if sample.id in seen:
            raise PipelineError(f"{path}:{n}: duplicate sample id {sample.id}")
        seen.add(sample.id)
        samples.append(sample)
    if not samples:
        raise PipelineError(f"{path}: no samples")
    if pipeline is not None:
        from maestro_flow.runtime.checks import check_token_limits

        try:
            check_token_limits(pipeline, None, samples)
        except PipelineError as exc:
            raise PipelineError(f"--trace-in {path}: {exc}") from None
    return samples


def run_search(pipeline, step: int) -> float:
    """The planner's search share a one-node run on this machine plans `step` with (the
    coordinator's rule, runtime/coordinator.py, the same with checkpoints or resumed): none for
    step 0, which the workers of every run wait for, and none where the search would take a core
    from training (cpus.search_share)."""
    if step == 0:
        return 0.0
    return pipeline_search(pipeline, sum(s.dp * s.tp for s in pipeline.sections), len(os.sched_getaffinity(0)))


def plan_one_step(path: str, overrides: dict[str, Any], *, step: int = 0, trace_in: str | None = None,
                  warn: Callable[[str], None] = lambda _text: None) -> Plan:
    """The plan a run makes for `step`; `warn` gets what validate and run warn of (found in QA:
    a dp above the global batch planned idle replicas without a word)."""
    pipeline, _ = load_pipeline(path, overrides)
    if trace_in:
        pipeline.validate()
        graph = SectionGraph(pipeline)
        samples = read_trace(trace_in, pipeline)
        warnings = pipeline_warnings(pipeline)
    else:
        checked = check_pipeline(pipeline)
        graph = checked.graph
        samples = EpochSampler(checked.metadata, pipeline.global_batch, pipeline.seed,
                               shuffle=pipeline.data.shuffle).batch(step)
        warnings = [*checked.warnings, *checked.data_warnings]
    if step >= pipeline.steps:  # found in QA: planned in silence (a step the run never reaches)
        warnings = [*warnings, f"--step {step} is past the run's last step (index {pipeline.steps - 1}, steps="
                               f"{pipeline.steps}): planned all the same, as a run with more steps would"]
    for text in warnings:
        warn(text)
    costs = CostModel(costs={n: s.cost for n, s in graph.sections.items()})
    result = make_planner(pipeline.schedule, graph, costs, search=run_search(pipeline, step)).plan(step, samples)
    return dataclasses.replace(result, simulated=simulate(result, graph, costs).to_json_dict())
