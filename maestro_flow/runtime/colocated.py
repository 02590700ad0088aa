"""Colocated reference mode: the whole pipeline in one process, one replica per section.

Runs in the `maestro run --colocated` process. The same executors, planner, loss normalisation
and optimizers as section mode, on the same global batches, with an in-process comm instead of
sockets and torch.distributed: the correctness oracle for section mode (parameters after N steps
must match). Sections run one after another in topological order; gradients flow back in
reverse. (The performance baseline is `--baseline monolithic`, baseline/monolithic.py: several
data-parallel ranks, as a Megatron-style trainer runs.)

Failures are reported as section mode's coordinator reports them: a stage's exception, or
outputs that break the Stage contract, as a StageError; anything else an executor raises as a
SystemFailure naming the section and step, the original exception chained (for `--debug`).
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch

from maestro_flow.checkpoint.savedir import begin_save, save_stage
from maestro_flow.config import Pipeline
from maestro_flow.errors import MaestroError, StageError, SystemFailure, brief
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import make_planner
from maestro_flow.planner.plan import Placement
from maestro_flow.runtime.build import build_stage, default_dtype, resolve_device
from maestro_flow.runtime.executor import SectionExecutor
from maestro_flow.runtime.executor_state import StageFault, recording
from maestro_flow.runtime.ledger import StepLedger, plan_message
from maestro_flow.runtime.observe import RunObserver, timed_plan
from maestro_flow.runtime.report import RunReport
from maestro_flow.runtime.sampler import EpochSampler
from maestro_flow.runtime.trace import Tracer
from maestro_flow.transport.local_comm import LocalComm


def run_colocated(pipeline: Pipeline, source: Any, sampler: EpochSampler, report: RunReport, *,
                  save_dir: str | None = None, observer: RunObserver | None = None,
                  record: dict | None = None) -> None:
    # Stage code may create tensors without a dtype, as it would in a worker process; the
    # caller's default is restored afterwards (this may be a test or a notebook).
    with default_dtype(getattr(torch, pipeline.dtype)):
        _run(pipeline, source, sampler, report, save_dir, observer or RunObserver(), record)


def _run(pipeline: Pipeline, source: Any, sampler: EpochSampler, report: RunReport, save_dir: str | None,
         observer: RunObserver, record: dict | None) -> None:
    # One process: every section whole (no data, tensor or FSDP parallelism), the reference.
    single = pipeline.override(**{f"sections.{s.name}.{k}": v for s in pipeline.sections
                                  for k, v in (("dp", 1), ("tp", 1), ("fsdp", False))})
    graph = SectionGraph(single)
    placement = Placement.build(graph.order, {n: 1 for n in graph.order})
    observer.start(placement)
    planner = make_planner(pipeline.schedule, graph, search=0.0)  # one process: a search would lengthen the step
    ledger = StepLedger(graph, placement, adapt_costs=pipeline.adapt_costs)
    events: list[tuple[int, str, dict]] = []
    executors: dict[int, SectionExecutor] = {}
    for name in graph.order:
        rank = placement.rank(name, 0)
        section = graph.sections[name]
        device = resolve_device(section, 0)
        try:
            stage = build_stage(single, section, 0, device)
        except MaestroError:
            raise
        except Exception:
            raise StageError(section=name, replica=0, rank=rank, step=None, phase="setup",
                             traceback=traceback.format_exc()) from None
        try:  # found in review: an error here (the optimizer's, say) escaped as a bare traceback
            executors[rank] = SectionExecutor(
                stage=stage, graph=graph, placement=placement, section=name, replica=0, source=source,
                comm=LocalComm(rank, lambda dst: executors[dst].deliver),
                report=lambda kind, body, rank=rank: events.append((rank, kind, body)),
                device=torch.device(device), dtype=getattr(torch, single.dtype), reducer=None,
                tracer=Tracer(enabled=observer.tracing, epoch=observer.tracer.epoch), record=recording(record, name, 0))
        except MaestroError:
            raise
        except Exception as exc:
            raise SystemFailure(f"system error in section {name!r} replica 0 (rank {rank}) during setup: "
                                f"{brief(exc)}") from exc
    for step in range(pipeline.steps):
        planner.costs = ledger.costs()
        began = time.perf_counter()  # the step waits for its plan: its time counts from here
        plan = timed_plan(planner, step, sampler.batch(step), observer)
        ledger.planned(plan, began)
        for rank, ex in executors.items():
            ex.add_plan(plan_message(plan, graph, *placement.who(rank)))
        row = None
        while row is None:
            progressed = False
            for rank, ex in executors.items():
                progressed |= _poll(ex, rank, step)
            for rank, kind, body in events:
                if kind == "loss":
                    for ranks, denominator in ledger.on_loss(rank, body["step"], body["loss_sum"], body["denominator"]):
                        for r in ranks:
                            executors[r].finalize(body["step"], denominator)
                elif kind == "norm":
                    clip = ledger.on_norm(rank, body["step"], body["sq"])
                    if clip is not None:
                        for r in clip[0]:
                            executors[r].clip(body["step"], clip[1])
                elif kind == "done":
                    observer.done(rank, body["stats"])
                    row = ledger.on_done(rank, body["step"], body["stats"], time.perf_counter()) or row
                progressed = True
            events.clear()
            if not progressed and row is None:
                raise SystemFailure(f"colocated run made no progress at step {step + 1} (a plan/runtime bug)")
        report.step(row)
    if save_dir:
        begin_save(save_dir, pipeline.to_dict())
        for ex in executors.values():
            if ex.trainable:
                try:
                    save_stage(ex.stage, save_dir, ex.name)
                except OSError as exc:  # as a worker reports it (found in this session: a traceback here)
                    raise SystemFailure(f"--save-dir {save_dir}: cannot write section {ex.name!r}: "
                                        f"{exc.strerror or exc}") from exc


def _poll(ex: SectionExecutor, rank: int, step: int) -> bool:
    """`ex.poll()`, its failure turned into the error `maestro run` shows (see the module docstring)."""
    try:
        return ex.poll()
    except StageFault as fault:
        raise StageError(section=ex.name, replica=0, rank=rank, step=fault.step, phase=fault.phase,
                         traceback=fault.text) from None
    except MaestroError:
        raise
    except Exception as exc:
        at = ex.current.step if ex.current is not None else step  # poll() may have begun the next step
        raise SystemFailure(f"system error in section {ex.name!r} replica 0 (rank {rank}) during step "
                            f"{at + 1}: {type(exc).__name__}: {exc}") from exc


def colocated_mode(pipeline: Pipeline) -> str:
    """The startup line's mode for --colocated, saying where the sections' layout does not apply
    (found in QA: tp=2 and fsdp ran colocated without a word that they were not used)."""
    laid = [f for f, used in (("dp", any(s.dp > 1 for s in pipeline.sections)),
                              ("tp", any(s.tp > 1 for s in pipeline.sections)),
                              ("fsdp", any(s.fsdp for s in pipeline.sections))) if used]
    return ("colocated" + (f" (one unsharded replica per section: {', '.join(laid)} not applied; the same maths)"
                           if laid else ""))
