"""The planner: sample metadata + graph (each section's dp and micro-batch) + cost model -> the plan of one step.

Pure (standard library only): no sockets, no torch, no clocks, so it is testable in microseconds
and usable from a simulator. `make_planner` picks the implementation for a schedule name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.plan import Placement, Plan
from maestro_flow.samples import SampleMeta

__all__ = ["CostModel", "Placement", "Plan", "Planner", "make_planner", "SCHEDULES"]


class Planner(Protocol):
    schedule: str

    def plan(self, step: int, samples: Sequence[SampleMeta]) -> Plan: ...


def _fifo(graph: SectionGraph, costs: CostModel, search: float | None) -> Planner:
    from maestro_flow.planner.fifo import FifoPlanner

    return FifoPlanner(graph, costs)


def _wavefront(graph: SectionGraph, costs: CostModel, search: float | None) -> Planner:
    from maestro_flow.planner.wavefront import WavefrontPlanner

    return WavefrontPlanner(graph, costs, run_ahead=graph.pipeline.run_ahead, search=search)


SCHEDULES = {"fifo": _fifo, "wavefront": _wavefront}


def make_planner(schedule: str, graph: SectionGraph, costs: CostModel | None = None,
                 search: float | None = None) -> Planner:
    """`search`: the wavefront's local search share (refine.py); None: the pipeline's plan_search."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if costs is None:
        costs = CostModel(costs={n: s.cost for n, s in graph.sections.items()})
    return SCHEDULES[schedule](graph, costs, search)
