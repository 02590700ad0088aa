"""The coordinator's step loop (Coordinator._train) with fake workers, in one process: when plans
are made and sent around checkpoints, whether the planner's search runs, what a step's time
counts, when a run counts as hung, and in which order a done report's parts are taken.

`StepCoordinator` is the real Coordinator with its sending and receiving replaced: every plan
it sends is queued for its rank, and when the coordinator waits for a report each rank answers
its oldest plan with a done report (without timings: these runs plan with the prior costs),
unless the workers are told to hang. The real receive loop checks for a hang only when nothing is queued; so does
this one, before its workers answer. Nothing here opens a socket or starts a process.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import pytest

from maestro_flow import ArrowData, Cost, Edge, Pipeline, Section
from maestro_flow.checkpoint.checkpointer import Checkpointer, CheckpointOptions
from maestro_flow.checkpoint.manifest import Manifest
from maestro_flow.errors import Terminated, TimeoutFailure, WorkerLost
from maestro_flow.graph import SectionGraph
from maestro_flow.runtime import coordinator as coordinator_module
from maestro_flow.runtime.coordinator import Coordinator
from maestro_flow.runtime.ledger import StepLedger
from maestro_flow.runtime.observe import RunObserver
from maestro_flow.runtime.report import RunReport
from maestro_flow.runtime.sampler import EpochSampler
from maestro_flow.samples import SampleMeta
from maestro_flow.timeouts import Timeouts


def distill(**overrides) -> Pipeline:
    """pipelines/distill.py's shape: a frozen teacher (dp 1, micro-batch 8) feeding a trainable
    student (dp 2, micro-batch 2); its costs make the wavefront's local search find shorter plans."""
    return Pipeline(
        name="distill", data=ArrowData(path="unused.arrow"), global_batch=16, steps=10, seed=0, adapt_costs=False,
        sections=[
            Section(name="teacher", stage="stages.lm:CausalLM", trainable=False, dp=1, micro_batch=8,
                    cost=Cost(per_sample_s=1e-4, per_token_s=3e-5, per_micro_batch_s=1e-3, padded=True)),
            Section(name="student", stage="stages.distill:KDStudent", trainable=True, dp=2, micro_batch=2,
                    optimizer={"name": "adamw", "lr": 3e-3},
                    cost=Cost(per_sample_s=1e-4, per_token_s=1e-5, per_micro_batch_s=1e-3, padded=True)),
        ],
        edges=[Edge(src="teacher", dst="student", tensors=("hidden",))],
    ).override(**overrides)


METADATA = [SampleMeta(id=i, row=i, num_tokens=20 + (i * 37) % 230) for i in range(160)]


class PlanLog(RunObserver):
    """Every plan as made; `planning_s` of sleep in each (a slow planner, as the workers see it)."""

    def __init__(self, planning_s: float = 0.0) -> None:
        super().__init__()
        self.plans: dict[int, dict] = {}
        self.planning_s = planning_s
        self.traced: list[tuple[int, list]] = []

    def planned(self, plan, started: float, finished: float) -> None:
        time.sleep(self.planning_s)
        self.plans[plan.step] = plan.to_json_dict()

    def done(self, rank: int, stats: dict) -> None:
        if "trace" in stats:
            self.traced.append((rank, stats["trace"]))
        super().done(rank, stats)


class StepCoordinator(Coordinator):
    def __init__(self, pipeline: Pipeline, *, every: int | None = None, resume_at: int | None = None,
                 search: float = 0.0, checkpoint_s: float = 0.0, hang_s: float = 120.0, planning_s: float = 0.0,
                 tmp_path=None, on_term: bool = False) -> None:
        options = CheckpointOptions(dir=str(tmp_path) if every else None, every=every, on_term=on_term)
        resume = None if resume_at is None else (
            "ckpt", Manifest(step=resume_at, pipeline={}, sections={}, sampler={}, costs=[]))
        super().__init__(pipeline, SectionGraph(pipeline), EpochSampler(METADATA, pipeline.global_batch, pipeline.seed),
                         RunReport(total_steps=pipeline.steps, metrics_out=None, show_progress=False),
                         paths=[], timeouts=Timeouts(hang_s=hang_s, step_s=30.0), observer=PlanLog(planning_s),
                         checkpointer=Checkpointer(options, log=lambda text: None), resume=resume)
        self.search, self.checkpoint_s = search, checkpoint_s
        self.pending = {r: collections.deque() for r in range(self.placement.world_size)}
        self.queue: collections.deque = collections.deque()
        self.hang_after: int | None = None  # the workers answer no plan of this step or later
        self.trace = False  # done reports carry trace events
        self.repeat = False  # every done report arrives twice
        self.checkpoints: list[tuple[int, int, set[int]]] = []  # (step, last plan made, plans out unanswered)
        self.term_at: int | None = None  # a SIGTERM taken (take_term) as this step's first report comes in
        self.term_taken = False

    def _plan_search(self) -> float:
        return self.search  # as on a host with cores to spare (this one's workers would fill its cores)

    def _checkpoint(self, step: int, ledger: StepLedger, row: dict) -> bool:
        out = {msg["step"] for plans in self.pending.values() for msg in plans}
        self.checkpoints.append((step, max(self.observer.plans), out))
        time.sleep(self.checkpoint_s)
        return True

    def _stop(self) -> None:  # the workers told to exit (after a SIGTERM taken: term_at)
        self.stopped_with = self.save_dir

    def _send(self, rank: int, msg: dict) -> None:
        if msg["t"] == "plan":
            self.pending[rank].append(msg)

    def _recv(self, deadline, what, setting, allow_exit=None, hang=False):
        while not self.queue:
            if hang:
                hung = self.liveness.hang(self.awaited_step, time.monotonic())
                if hung is not None:
                    raise hung
            if time.monotonic() > deadline:
                raise TimeoutFailure(what, 0.0, setting)
            for rank, plans in self.pending.items():
                if not plans or (self.hang_after is not None and plans[0]["step"] >= self.hang_after):
                    continue
                msg = plans.popleft()
                stats = {"busy_s": 0.01, "wall_s": 0.02, "micro_batches": len(msg["micro_batches"]),
                         "samples": sum(map(len, msg["micro_batches"])), "loss_sum": 1.0, "denominator": 1.0}
                if self.trace:
                    stats["trace"] = [{"name": f"step {msg['step']}"}]
                reports = 2 if self.repeat else 1
                for _ in range(reports):
                    self.queue.append((rank, {"t": "done", "step": msg["step"], "stats": dict(stats)}))
            if not self.queue:
                time.sleep(0.01)
        if self.queue[0][1]["step"] == self.term_at:  # once
            self.term_at, self.term_taken = None, self.checkpointer.take_term()
        return self.queue.popleft()


def run(c: StepCoordinator) -> None:
    try:
        c._train()
    finally:
        c.close()


# -- the planner's search: the same plans with checkpoints, without, and resumed ---------------


def test_plans_are_the_same_with_checkpoints_without_and_resumed(tmp_path):
    """Whether a step's plan is searched (planner/refine.py) depends on the step alone, not on
    when the plan is made: before, a plan held back at a checkpoint boundary (or a resumed run's
    first) was made while the workers waited, without the search, so `--checkpoint-every` and
    `--resume` changed the plans, and so the trained parameters (DESIGN 4b: resume is bitwise
    identical)."""
    runs = {}
    for name, every, resume_at in (("plain", None, None), ("every 2", 2, None), ("every 3", 3, None),
                                   ("resumed at 4", 2, 4), ("resumed at 3, every 4", 4, 3)):
        c = StepCoordinator(distill(), every=every, resume_at=resume_at, search=0.5, tmp_path=tmp_path / name)
        run(c)
        runs[name] = c.observer.plans
    plain = runs.pop("plain")
    assert sorted(plain) == list(range(10))
    assert any(p["variant"].startswith("refined") for p in plain.values())  # the search does shorten these
    assert not plain[0]["variant"].startswith("refined")  # step 0: the workers wait for it in every run
    for name, plans in runs.items():
        for step, plan in plans.items():
            assert plan == plain[step], f"{name}: step {step}'s plan differs"


def test_no_plan_past_a_checkpoint_boundary_is_made_before_the_checkpoint(tmp_path):
    """With lookahead 2, the plans of the steps after a boundary are made after the checkpoint
    (with the cost model a resumed run loads from it) and none is out while the workers save."""
    c = StepCoordinator(distill(lookahead_steps=2), every=3, tmp_path=tmp_path)
    run(c)
    assert c.checkpoints == [(3, 2, set()), (6, 5, set()), (9, 8, set()), (10, 9, set())]  # and after the last
    assert sorted(c.observer.plans) == list(range(10))
    assert [r["step"] for r in c.report.rows] == list(range(10))


def test_a_sigterm_taken_by_checkpoint_on_term_saves_the_planned_steps_then_stops(tmp_path):
    """--checkpoint-on-term: after the SIGTERM no plan goes out; the steps planned before it
    (lookahead 2: up to step index 4 when step 2 reports) finish, the last is saved with nothing
    in flight, and the run stops as an interrupt, before its own boundary (every 8)."""
    c = StepCoordinator(distill(lookahead_steps=2), every=8, on_term=True, tmp_path=tmp_path)
    c.term_at, c.save_dir = 2, str(tmp_path / "save")
    with pytest.raises(Terminated):
        run(c)
    assert c.term_taken and c.checkpoints == [(5, 4, set())]
    assert c.stopped_with is None  # the workers exit as at the end, writing no --save-dir
    assert sorted(c.observer.plans) == [0, 1, 2, 3, 4]
    assert [r["step"] for r in c.report.rows] == [0, 1, 2, 3, 4]
    assert not c.checkpointer.training and not c.checkpointer.take_term()  # a second SIGTERM stops at once


def test_a_sigterm_taken_during_a_checkpoint_stops_after_it_and_says_so(tmp_path, capsys):
    """Found in review: taken while the step-3 checkpoint (every 3, lookahead 2: nothing planned
    past it) was written, the run stopped with no word of why."""
    c = StepCoordinator(distill(lookahead_steps=2), every=3, on_term=True, tmp_path=tmp_path)
    real = c._checkpoint

    def checkpoint(step, ledger, row):
        c.checkpointer.take_term()
        return real(step, ledger, row)

    c._checkpoint, c.report.stream = checkpoint, sys.stderr
    with pytest.raises(Terminated):
        run(c)
    assert c.checkpoints == [(3, 2, set())] and sorted(c.observer.plans) == [0, 1, 2]
    assert "SIGTERM (--checkpoint-on-term): stopping after step 3 (the last one planned), with its checkpoint" \
        in capsys.readouterr().err


def test_a_sigterm_when_the_last_step_is_planned_lets_the_run_end_and_says_so(tmp_path, capsys):
    c = StepCoordinator(distill(lookahead_steps=5), every=10, on_term=True, tmp_path=tmp_path)
    c.term_at, c.report.stream = 6, sys.stderr
    run(c)  # steps 6..9 were planned when it came: it ends as usual, with its checkpoint after the last
    assert c.term_taken and c.checkpoints == [(10, 9, set())]
    assert "the last step had been planned already, so the run ends as usual" in capsys.readouterr().err


def test_without_checkpoint_on_term_a_sigterm_is_not_taken(tmp_path):
    c = StepCoordinator(distill(lookahead_steps=2), every=8, tmp_path=tmp_path)
    c.term_at = 2
    run(c)
    assert not c.term_taken and c.checkpoints == [(8, 7, set()), (10, 9, set())]


# -- a step's time ------------------------------------------------------------------------------


def test_a_steps_time_counts_the_planning_its_workers_wait_for(tmp_path):
    """With nothing planned ahead (lookahead 0: every step) the workers wait while the plan is
    made; before, the step's time counted from the plan's end and left that out."""
    c = StepCoordinator(distill(steps=3, lookahead_steps=0), planning_s=0.2, tmp_path=tmp_path)
    run(c)
    assert [r["step"] for r in c.report.rows] == [0, 1, 2]
    assert all(r["step_time_s"] >= 0.2 for r in c.report.rows), [r["step_time_s"] for r in c.report.rows]


def test_a_step_after_a_checkpoint_counts_from_the_checkpoints_end(tmp_path):
    """A plan held back at the boundary: its step counts from when it was made, after the
    checkpoint (the checkpoint's own time is its row's checkpoint_s)."""
    c = StepCoordinator(distill(steps=4), every=2, checkpoint_s=0.3, tmp_path=tmp_path)
    run(c)
    rows = {r["step"]: r for r in c.report.rows}
    assert rows[1]["checkpoint_s"] >= 0.3
    assert rows[2]["step_time_s"] < 0.3


# -- hangs ----------------------------------------------------------------------------------------


def test_a_checkpoint_slower_than_the_hang_timeout_is_no_hang(tmp_path):
    """No step can finish while the workers save: before, the hang clock ran on through the
    checkpoint (only done reports moved it), and the next step was called hung at once."""
    c = StepCoordinator(distill(steps=4), every=2, checkpoint_s=0.6, hang_s=0.3, tmp_path=tmp_path)
    run(c)
    assert [r["step"] for r in c.report.rows] == [0, 1, 2, 3]


def test_a_worker_that_hangs_after_a_checkpoint_is_still_caught(tmp_path):
    c = StepCoordinator(distill(steps=4), every=2, checkpoint_s=0.6, hang_s=0.3, tmp_path=tmp_path)
    c.hang_after = 2
    started = time.monotonic()
    with pytest.raises(WorkerLost, match="is hung"):
        run(c)
    assert [r["step"] for r in c.report.rows] == [0, 1]
    assert time.monotonic() - started < 10.0


# -- done reports ---------------------------------------------------------------------------------


def test_the_observer_takes_the_trace_before_the_ledger_sees_the_stats(tmp_path, monkeypatch):
    """runtime/observe.py says so; before, the ledger got the stats (and held them, trace events
    and all, until every rank was done) first."""
    seen = []

    class Ledger(StepLedger):
        def on_done(self, rank, step, stats, now):
            seen.append("trace" in stats)
            return super().on_done(rank, step, stats, now)

    monkeypatch.setattr(coordinator_module, "StepLedger", Ledger)
    c = StepCoordinator(distill(steps=2), tmp_path=tmp_path)
    c.trace = True
    run(c)
    assert seen and not any(seen)
    assert len(c.observer.traced) == 2 * c.placement.world_size


def test_a_repeated_done_report_is_neither_counted_nor_traced(tmp_path):
    c = StepCoordinator(distill(steps=2), tmp_path=tmp_path)
    c.trace, c.repeat = True, True
    run(c)
    assert [r["step"] for r in c.report.rows] == [0, 1]
    assert len(c.observer.traced) == 2 * c.placement.world_size  # once per rank and step


def test_a_colocated_steps_time_counts_its_planning(tmp_path, monkeypatch):
    """Colocated mode plans each step while nothing runs: the step's time includes the plan's
    (it counted from the plan's end before, as section mode did)."""
    import time

    from loaders.demo import build_text_demo
    from maestro_flow.runtime import colocated
    from maestro_flow.runtime.build import open_source
    from maestro_flow.runtime.report import RunReport
    from maestro_flow.runtime.sampler import EpochSampler

    real = colocated.timed_plan

    def slow(*args, **kwargs):
        time.sleep(1.0)  # much more than a step of this pipeline takes
        return real(*args, **kwargs)

    monkeypatch.setattr(colocated, "timed_plan", slow)
    from maestro_flow.runtime.build import load_pipeline

    data = build_text_demo(tmp_path, num_samples=64, parquet=False)
    plain = Path(__file__).resolve().parents[1] / "integration" / "assets" / "plain.py"
    pipeline, _ = load_pipeline(str(plain), {"data.path": str(data), "steps": 2})
    source = open_source(pipeline)
    rows = []
    report = RunReport(total_steps=2, metrics_out=None, show_progress=False, sinks=[
        type("Sink", (), {"step": lambda self, row: rows.append(row), "close": lambda self: None})()])
    colocated.run_colocated(pipeline, source, EpochSampler(source.metadata(), pipeline.global_batch, 0), report)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["step_time_s"] >= 1.0 for r in rows), [r["step_time_s"] for r in rows]
