"""What an executor says it is doing (runtime/executor.py's status, sent with every heartbeat):
the coordinator's hang detection names the replica that is busy, never one that waits. And when
a loss section tells the coordinator its loss denominator (upstream sections wait for it)."""

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


def test_the_loss_denominator_is_reported_before_the_last_backward(tmp_path):
    # Found in RESULTS 11.2 (2026-12-01): the loss section reported its denominator only after its
    # last backward, so the trainable encoder upstream waited that long for it before its
    # gradient reduction and optimizer step, and started the next step's forward late: the LLM
    # then waited for its first images. The denominator is complete after the last forward.
    from loaders.demo import build_text_demo

    data = build_text_demo(tmp_path, num_samples=64, parquet=False)
    spec = importlib.util.spec_from_file_location("chain_pipeline", ROOT / "pipelines" / "chain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pipeline = module.pipeline(**{"data.path": str(data), "sections.lm.dp": 1, "sections.embed.dp": 1})
    graph = SectionGraph(pipeline)
    placement = Placement.build(graph.order, {n: 1 for n in graph.order})
    source = open_source(pipeline)
    log: list[tuple] = []
    at_report: dict[str, float] = {}
    executors: dict[str, SectionExecutor] = {}

    class Routed(_Comm):
        def send(self, dst, kind, edge, step, items) -> None:
            log.append(("send", kind, step, grads() if kind == "bwd" else None))
            if kind == "fwd":  # embed -> lm (rank 1); gradients are only logged
                executors["lm"].deliver(kind, edge, step, 0, items)

    def grads() -> float:  # the loss section's accumulated gradients, summed
        return sum(float(p.grad.abs().sum()) for p in executors["lm"].stage.parameters() if p.grad is not None)

    def report(kind, body) -> None:
        if kind == "loss":
            at_report.update(grads=grads(), loss_sum=body["loss_sum"])
        elif kind == "done":
            at_report["done_loss_sum"] = body["stats"]["loss_sum"]
        denominator = body.get("denominator", body.get("stats", {}).get("denominator"))
        log.append(("report", kind, body.get("step"), denominator))

    for name in ("embed", "lm"):
        executors[name] = SectionExecutor(stage=build_stage(pipeline, graph.sections[name], 0, "cpu"), graph=graph,
                                          placement=placement, section=name, replica=0, source=source,
                                          comm=Routed(), report=report if name == "lm" else lambda k, b: None,
                                          device=torch.device("cpu"), dtype=torch.float32, reducer=None)
    sampler = EpochSampler(source.metadata(), pipeline.global_batch, pipeline.seed)
    plan = make_planner(pipeline.schedule, graph, search=0.0).plan(0, sampler.batch(0))
    for name, executor in executors.items():
        executor.add_plan(plan_message(plan, graph, name, 0))
    executors["embed"].poll()
    while executors["lm"].poll():
        pass
    sends = [i for i, entry in enumerate(log) if entry[:2] == ("send", "bwd")]
    losses = [i for i, entry in enumerate(log) if entry[:2] == ("report", "loss")]
    assert len(sends) == len(plan.replicas["lm"][0]) >= 2 and len(losses) == 1
    assert sends[-2] < losses[0] < sends[-1]  # after the last forward, before the last backward's gradients
    done = [entry for entry in log if entry[:2] == ("report", "done")]
    assert len(done) == 1 and log[losses[0]][3] == done[0][3] > 0  # the step's whole denominator, as before
    assert at_report["loss_sum"] == at_report["done_loss_sum"] > 0  # and the whole loss
    # Reported before the last backward added its gradients: as many as after the one before.
    assert 0 < log[sends[-2]][3] == at_report["grads"] < log[sends[-1]][3]
