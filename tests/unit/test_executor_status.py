"""What an executor says it is doing (runtime/executor.py's status, sent with every heartbeat):
the coordinator's hang detection names the replica that is busy, never one that waits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from maestro_flow.graph import SectionGraph
from maestro_flow.planner import make_planner
from maestro_flow.planner.plan import Placement
from maestro_flow.runtime.build import build_stage, open_source
from maestro_flow.runtime.executor import SectionExecutor
from maestro_flow.runtime.ledger import plan_message
from maestro_flow.runtime.liveness import WAITING
from maestro_flow.runtime.sampler import EpochSampler
from maestro_flow.transport.tensor_comm import Stats

ROOT = Path(__file__).resolve().parents[2]


class _Comm:
    """Records what the executor sends; nothing comes back (no gradient ever returns)."""

    def __init__(self) -> None:
        self.stats, self.in_flight, self.sent = Stats(), 0, []

    def send(self, dst, kind, edge, step, items) -> None:
        self.sent.append((dst, kind, step))

    def notify(self, *args) -> None:
        pass

    def reap(self) -> None:
        pass


def test_a_trainable_producer_waiting_for_gradients_says_it_waits(tmp_path):
    # Reproduced before: after its last forward, chain's `embed` kept reporting "forward" while it
    # only waited for the LM's gradients, so a hung LM was blamed on it ("embed is hung: in forward").
    from loaders.demo import build_text_demo

    data = build_text_demo(tmp_path, num_samples=64, parquet=False)
    spec = importlib.util.spec_from_file_location("chain_pipeline", ROOT / "pipelines" / "chain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pipeline = module.pipeline(**{"data.path": str(data), "sections.lm.dp": 1})
    graph = SectionGraph(pipeline)
    placement = Placement.build(graph.order, {n: 1 for n in graph.order})
    source = open_source(pipeline)
    comm = _Comm()
    executor = SectionExecutor(stage=build_stage(pipeline, graph.sections["embed"], 0, "cpu"), graph=graph,
                               placement=placement, section="embed", replica=0, source=source, comm=comm,
                               report=lambda kind, body: None, device=torch.device("cpu"), dtype=torch.float32,
                               reducer=None)
    sampler = EpochSampler(source.metadata(), pipeline.global_batch, pipeline.seed)
    plan = make_planner(pipeline.schedule, graph, search=0.0).plan(0, sampler.batch(0))
    executor.add_plan(plan_message(plan, graph, "embed", 0))

    assert executor.poll()
    forwards = len(plan.replicas["embed"][0])
    assert len(comm.sent) == forwards  # every forward ran and sent its outputs
    assert len(executor.current.pending) == forwards  # every backward waits for its gradients
    status = executor.status
    assert status["state"] == "waiting for gradients" and status["state"].startswith(WAITING)
    assert status["step"] == 0
    assert not executor.poll()  # nothing more to do, and it still says so
    assert executor.status["state"] == "waiting for gradients"
