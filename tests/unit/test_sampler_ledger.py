"""Per-step bookkeeping: EpochSampler (runtime/sampler.py), plan_message and StepLedger
(runtime/ledger.py). All pure: clocks are passed in as `now`."""

from __future__ import annotations

import pytest

from maestro_flow import ArrowData, Edge, Pipeline, PipelineError, Section
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import Placement, make_planner
from maestro_flow.protocol.auth import Rejected
from maestro_flow.runtime.ledger import StepLedger, plan_message
from maestro_flow.runtime.sampler import EpochSampler, data_fingerprint
from maestro_flow.samples import SampleMeta

TEXT, IMAGE = frozenset({"text"}), frozenset({"text", "image"})


def S(name: str, **kw) -> Section:
    return Section(name=name, stage=f"stages.fake:{name.title()}", **kw)


def graph_of(sections, edges=()) -> SectionGraph:
    return SectionGraph(Pipeline(name="p", data=ArrowData(path="d"), sections=sections, edges=edges))


def placement_of(graph: SectionGraph) -> Placement:
    return Placement.build(graph.order, {n: s.dp for n, s in graph.sections.items()})


def distill() -> SectionGraph:
    return graph_of([S("teacher", trainable=False, dp=1, micro_batch=8), S("student", dp=2, micro_batch=2)],
                    [Edge(src="teacher", dst="student", tensors=("hidden",))])


def metadata(n: int) -> list[SampleMeta]:
    return [SampleMeta(id=1000 + i, row=i, num_tokens=10 + i) for i in range(n)]


# -- EpochSampler --------------------------------------------------------------------------


def ids(batch: list[SampleMeta]) -> list[int]:
    return [s.id for s in batch]


def test_same_seed_same_batches():
    a, b = EpochSampler(metadata(50), 8, seed=3), EpochSampler(metadata(50), 8, seed=3)
    assert [ids(a.batch(s)) for s in range(20)] == [ids(b.batch(s)) for s in range(20)]


def test_batches_do_not_depend_on_the_order_they_are_asked_for():
    a, b = EpochSampler(metadata(50), 8, seed=3), EpochSampler(metadata(50), 8, seed=3)
    forward = {s: ids(a.batch(s)) for s in range(20)}
    assert {s: ids(b.batch(s)) for s in reversed(range(20))} == forward


def test_each_epoch_covers_distinct_samples_and_drops_the_remainder():
    sampler = EpochSampler(metadata(50), 8, seed=0)
    assert sampler.per_epoch == 6  # 48 of 50 samples per epoch; the last 2 of the permutation are dropped
    for epoch in range(3):
        batches = [ids(sampler.batch(epoch * 6 + k)) for k in range(6)]
        assert all(len(b) == 8 and len(set(b)) == 8 for b in batches)  # no duplicate inside a batch
        seen = [sid for b in batches for sid in b]
        assert len(set(seen)) == 48  # batches of one epoch are disjoint
        assert set(seen) <= {s.id for s in metadata(50)}


def test_different_epochs_and_seeds_give_different_orders():
    sampler = EpochSampler(metadata(64), 16, seed=0)
    epoch = [[sid for k in range(4) for sid in ids(sampler.batch(e * 4 + k))] for e in range(3)]
    assert sorted(epoch[0]) == sorted(epoch[1]) == sorted(s.id for s in metadata(64))  # nothing dropped
    assert epoch[0] != epoch[1] and epoch[1] != epoch[2]
    other = EpochSampler(metadata(64), 16, seed=1)
    assert ids(other.batch(0)) != ids(sampler.batch(0))


def test_batches_hold_the_metadata_records():
    meta = metadata(10)
    batch = EpochSampler(meta, 4, seed=0).batch(0)
    assert all(any(s is m for m in meta) for s in batch)


def test_global_batch_equal_to_the_dataset_is_a_permutation_per_step():
    sampler = EpochSampler(metadata(6), 6, seed=0)
    assert sampler.per_epoch == 1
    assert sorted(ids(sampler.batch(0))) == sorted(ids(sampler.batch(1))) == list(range(1000, 1006))


def test_global_batch_larger_than_the_dataset_is_refused():
    with pytest.raises(PipelineError, match=r"global_batch=8 is larger than the dataset \(7 samples\)"):
        EpochSampler(metadata(7), 8, seed=0)


# -- plan_message --------------------------------------------------------------------------


def test_plan_message_for_a_student_replica():
    """teacher dp=1 mb=8 -> student dp=2 mb=2 on samples 0..15 (rows 100..115; 12-15 carry an image)."""
    graph = distill()
    samples = [SampleMeta(id=i, row=100 + i, modalities=IMAGE if i >= 12 else TEXT) for i in range(16)]
    plan = make_planner("fifo", graph).plan(5, samples)
    msg = plan_message(plan, graph, "student", 1)
    assert msg == {
        "t": "plan", "step": 5,
        "micro_batches": [[8, 9], [10, 11], [12, 13], [14, 15]],
        "samples": [[i, 100 + i, ["image", "text"] if i >= 12 else ["text"], 0, 0, 0] for i in range(8, 16)],
        "routes": {"teacher": {i: 0 for i in range(8, 16)}},
        "gates": [[], [], [], []], "notify": [],  # FIFO plans have no run-ahead gates
    }


def test_plan_message_for_the_teacher_names_each_sample_s_student():
    graph = distill()
    plan = make_planner("fifo", graph).plan(0, [SampleMeta(id=i, row=i) for i in range(16)])
    msg = plan_message(plan, graph, "teacher", 0)
    assert msg["micro_batches"] == [[0, 1, 8, 9, 2, 3, 10, 11], [4, 5, 12, 13, 6, 7, 14, 15]]
    assert msg["routes"] == {"student": {i: i // 8 for i in range(16)}}
    assert [s[0] for s in msg["samples"]] == list(range(16))


def test_plan_message_has_routes_of_every_neighbour_only():
    graph = graph_of([S("vision", trainable=False, activates_on="image"), S("proj", trainable=False, dp=2),
                      S("llm", dp=2), S("teacher", trainable=False)],
                     [Edge(src="vision", dst="proj", tensors=("v",)), Edge(src="proj", dst="llm", tensors=("p",))])
    plan = make_planner("fifo", graph).plan(0, [SampleMeta(id=i, row=i, modalities=IMAGE) for i in range(4)])
    msg = plan_message(plan, graph, "proj", 0)
    assert set(msg["routes"]) == {"vision", "llm"}
    mine = {sid for mb in msg["micro_batches"] for sid in mb}
    assert all(set(r) == mine for r in msg["routes"].values())
    assert plan_message(plan, graph, "teacher", 0)["routes"] == {}


def test_plan_message_for_a_replica_without_samples():
    graph = distill()
    plan = make_planner("fifo", graph).plan(0, [SampleMeta(id=7, row=0)])
    empty = [r for r in range(2) if not plan.micro_batches("student", r)]
    assert len(empty) == 1
    msg = plan_message(plan, graph, "student", empty[0])
    assert (msg["micro_batches"], msg["samples"], msg["routes"]) == ([], [], {"teacher": {}})


def test_a_lockstep_fsdp_teacher_gets_rounds_and_a_probe():
    """A frozen FSDP teacher fed by the data runs in lockstep (parallel/fsdp.py): every replica
    is told the most micro-batches any of them runs and a sample to run when it has none left."""
    graph = graph_of([S("teacher", trainable=False, dp=2, micro_batch=2, fsdp=True), S("student", dp=2, micro_batch=2)],
                     [Edge(src="teacher", dst="student", tensors=("hidden",))])
    assert graph.lockstep("teacher") and not graph.lockstep("student")
    samples = [SampleMeta(id=i, row=100 + i, num_tokens=10 + 7 * i) for i in range(11)]
    plan = make_planner("wavefront", graph).plan(0, samples)
    counts = [len(plan.micro_batches("teacher", r)) for r in range(2)]
    first = next(mbs[0][0] for mbs in (plan.micro_batches("teacher", r) for r in range(2)) if mbs)
    for r in range(2):
        msg = plan_message(plan, graph, "teacher", r)
        assert msg["rounds"] == max(counts)
        assert msg["probe"] == [first, 100 + first, ["text"]]
        assert "rounds" not in plan_message(plan, graph, "student", r)


def test_a_lockstep_teacher_s_credits_ask_only_for_what_earlier_rounds_feed():
    """Its round k waits on a student's progress, but never for more forwards than the student
    can run on the outputs of rounds before k (every replica has passed those once one starts
    round k), so the wait cannot close a cycle through the teacher's gathers."""
    graph = graph_of([S("teacher", trainable=False, dp=2, micro_batch=2, fsdp=True),
                      S("student", dp=2, micro_batch=2)], [Edge(src="teacher", dst="student", tensors=("hidden",))])
    samples = [SampleMeta(id=i, row=i, num_tokens=10 + 7 * (i % 9)) for i in range(96)]
    plan = make_planner("wavefront", graph).plan(0, samples)
    round_of = {sid: k for r in range(2) for k, mb in enumerate(plan.micro_batches("teacher", r)) for sid in mb}
    waits = 0
    for r in range(2):
        for k, gates in enumerate(plan_message(plan, graph, "teacher", r)["gates"]):
            for c, ci, done in gates:
                assert c == "student"
                fed = plan.micro_batches("student", ci)[:done]
                assert all(round_of[s] < k for mb in fed for s in mb)
                waits += done > 0
    assert waits > 0  # the credits still bound how far the teacher runs ahead
    notified = {tuple(x) for ci in range(2) for x in plan_message(plan, graph, "student", ci)["notify"]}
    assert notified <= {("teacher", 0), ("teacher", 1)} and notified


def test_a_lockstep_consumer_gives_no_run_ahead_credits():
    """Its producers do not wait on its progress: one of its replicas may be waiting on a peer's
    gather while that peer waits on the producer."""
    def graph_with(fsdp: bool) -> SectionGraph:
        return graph_of([S("teacher", trainable=False, dp=1, micro_batch=1),
                         S("student", dp=2, micro_batch=1, fsdp=fsdp)],
                        [Edge(src="teacher", dst="student", tensors=("hidden",))])
    samples = [SampleMeta(id=i, row=i, num_tokens=10 + 7 * (i % 9)) for i in range(64)]
    plain = graph_with(False)
    gated = plan_message(make_planner("wavefront", plain).plan(0, samples), plain, "teacher", 0)["gates"]
    assert any(gated)  # without FSDP the teacher runs ahead of the student by a bounded credit
    graph = graph_with(True)
    plan = make_planner("wavefront", graph).plan(0, samples)
    assert not any(plan_message(plan, graph, "teacher", 0)["gates"])
    assert all(plan_message(plan, graph, "student", r)["notify"] == [] for r in range(2))
    assert plan_message(plan, graph, "student", 0)["rounds"] == max(len(plan.micro_batches("student", r)) for r in range(2))


def test_lockstep_sections_are_fsdp_teachers_fed_by_the_data_and_fsdp_loss_sections():
    edge = [Edge(src="a", dst="b", tensors=("x",))]
    for a, b, expected in [
        (S("a", trainable=False, fsdp=True), S("b"), (True, False)),
        (S("a", trainable=False, fsdp=True, tp=2), S("b"), (False, False)),  # tp: per-step gathering
        (S("a", fsdp=True), S("b", fsdp=True), (False, True)),  # a trainable encoder; the loss section
        (S("a", fsdp=True), S("b", fsdp=True, tp=2), (False, False)),
        (S("a", trainable=False), S("b", trainable=False, fsdp=True), (False, False)),  # fed by a section
    ]:
        graph = graph_of([a, b], edge)
        assert (graph.lockstep("a"), graph.lockstep("b")) == expected


# -- StepLedger ----------------------------------------------------------------------------


def stats(busy_s: float, micro_batches: int, samples: int) -> dict:
    return {"busy_s": busy_s, "micro_batches": micro_batches, "samples": samples}


def opened(ledger: StepLedger, *steps: int) -> StepLedger:
    """The ledger with these steps planned (reports count only for steps in progress)."""
    samples = [SampleMeta(id=i, row=i, num_tokens=10) for i in range(4)]
    for step in steps:
        ledger.planned(make_planner("fifo", ledger.graph).plan(step, samples), now=0.0)
    return ledger


def test_loss_reports_from_every_replica_finalize_the_loss_group():
    graph = distill()  # ranks: teacher 0, student 1 2
    ledger = opened(StepLedger(graph, placement_of(graph)), 0)
    assert ledger.on_loss(1, 0, 3.0, 10.0) == []
    # The students sum their denominators with their gradients; the frozen teacher needs none.
    assert ledger.on_loss(2, 0, 5.0, 6.0) == [([], 16.0)]


def test_finalize_targets_every_trainable_section_upstream_of_the_loss():
    graph = graph_of([S("teacher", trainable=False), S("vision", dp=2, activates_on="image"), S("llm", dp=2)],
                     [Edge(src="teacher", dst="llm", tensors=("t",)), Edge(src="vision", dst="llm", tensors=("v",))])
    placement = placement_of(graph)
    assert placement.ranks == {"teacher": (0,), "vision": (1, 2), "llm": (3, 4)}
    ledger = opened(StepLedger(graph, placement), 2)
    assert ledger.on_loss(4, 2, 1.0, 0.0) == []
    assert ledger.on_loss(3, 2, 2.0, 7.0) == [([1, 2], 7.0)]  # the trainable encoder upstream


def test_two_loss_groups_finalize_separately():
    graph = graph_of([S("enc_a"), S("lm_a", dp=2), S("lm_b")],
                     [Edge(src="enc_a", dst="lm_a", tensors=("h",))])
    placement = placement_of(graph)
    assert placement.ranks == {"enc_a": (0,), "lm_b": (1,), "lm_a": (2, 3)}  # topological order
    ledger = opened(StepLedger(graph, placement), 0)
    assert ledger.on_loss(1, 0, 4.0, 2.0) == [([], 2.0)]
    assert ledger.on_loss(2, 0, 1.0, 1.0) == []
    assert ledger.on_loss(3, 0, 1.0, 3.0) == [([0], 4.0)]


def test_a_report_counts_once_per_rank_for_a_step_in_progress():
    # Reproduced on loopback before: a forged second loss report with a huge denominator was
    # counted as another replica's and changed the trained weights.
    graph = distill()  # ranks: teacher 0, student 1 2
    ledger = opened(StepLedger(graph, placement_of(graph)), 0)
    assert ledger.on_loss(1, 0, 3.0, 10.0) == []
    with pytest.raises(Rejected, match="repeated loss report from rank 1 for step 1"):
        ledger.on_loss(1, 0, 3.0, 1e30)
    with pytest.raises(Rejected, match="loss report from rank 0, which does not send one"):
        ledger.on_loss(0, 0, 3.0, 1e30)  # the frozen teacher is no loss section
    with pytest.raises(Rejected, match="loss report for step 8, which is not in progress"):
        ledger.on_loss(2, 7, 3.0, 1e30)
    assert ledger.on_loss(2, 0, 5.0, 6.0) == [([], 16.0)]  # the forged reports changed nothing
    assert ledger.on_done(0, 0, stats(0.5, 1, 4), now=1.0) is None
    with pytest.raises(Rejected, match="repeated done report"):
        ledger.on_done(0, 0, stats(0.5, 1, 4), now=1.0)
    with pytest.raises(Rejected, match="done report from rank 9"):
        ledger.on_done(9, 0, stats(0.5, 1, 4), now=1.0)
    with pytest.raises(Rejected, match="norm report from rank 0, which does not send one"):
        ledger.on_norm(0, 0, 1.0)
    ledger.on_norm(1, 0, 1.0)
    with pytest.raises(Rejected, match="repeated norm report"):
        ledger.on_norm(1, 0, 1e30)


def test_done_from_every_rank_gives_the_metrics_row():
    graph = distill()
    ledger = StepLedger(graph, placement_of(graph))
    samples = [SampleMeta(id=i, row=i, num_tokens=10 * i) for i in range(4)]
    ledger.planned(make_planner("fifo", graph).plan(0, samples), now=100.0)
    # A loss replica's done report carries its loss sum and denominator.
    assert ledger.on_done(0, 0, stats(0.5, 1, 4), now=101.0) is None
    assert ledger.on_done(2, 0, {**stats(0.75, 1, 2), "loss_sum": 5.0, "denominator": 6.0}, now=101.5) is None
    row = ledger.on_done(1, 0, {**stats(1.0, 1, 2), "bytes_sent": 10, "max_rss_kb": 2048, "loss_sum": 3.0,
                                "denominator": 10.0}, now=102.0)
    assert set(row) >= {"step", "loss", "samples", "tokens", "step_time_s", "sections"}
    assert row["step"] == 0
    assert row["loss"] == pytest.approx((3.0 + 5.0) / (10.0 + 6.0))
    assert (row["samples"], row["tokens"]) == (4, 60)
    assert row["step_time_s"] == pytest.approx(2.0)
    assert (row["samples_per_s"], row["tokens_per_s"]) == (pytest.approx(2.0), pytest.approx(30.0))
    assert list(row["sections"]) == ["teacher", "student"]
    teacher, student = row["sections"]["teacher"], row["sections"]["student"]
    assert set(student) >= {"busy_s", "idle_s", "micro_batches", "samples"}
    assert teacher["busy_s"] == 0.5 and teacher["idle_s"] == pytest.approx(1.5)
    assert student["busy_s"] == 1.75 and student["idle_s"] == pytest.approx(2 * 2.0 - 1.75)
    assert (student["micro_batches"], student["samples"]) == (2, 4)
    assert student["bytes_sent"] == 10 and student["max_rss_mb"] == 2.0
    assert ledger.done == {} and ledger.losses == {}  # nothing kept once the row is out


def test_several_loss_sections_give_a_loss_per_section():
    graph = graph_of([S("lm_a"), S("lm_b")])
    ledger = StepLedger(graph, placement_of(graph))
    ledger.planned(make_planner("fifo", graph).plan(0, [SampleMeta(id=0)]), now=0.0)
    ledger.on_done(0, 0, {**stats(0.1, 1, 1), "loss_sum": 6.0, "denominator": 3.0}, now=1.0)
    row = ledger.on_done(1, 0, {**stats(0.1, 1, 1), "loss_sum": 1.0, "denominator": 4.0}, now=1.0)
    assert row["loss"] == {"lm_a": 2.0, "lm_b": 0.25}


def test_a_pipeline_without_loss_reports_none():
    graph = graph_of([S("teacher", trainable=False)])
    ledger = StepLedger(graph, placement_of(graph))
    ledger.planned(make_planner("fifo", graph).plan(0, [SampleMeta(id=0)]), now=0.0)
    assert ledger.on_done(0, 0, stats(0.1, 1, 1), now=1.0)["loss"] is None


def test_lookahead_step_time_counts_from_the_previous_step_s_end():
    graph = graph_of([S("lm")])
    ledger = StepLedger(graph, placement_of(graph))
    planner = make_planner("fifo", graph)
    ledger.planned(planner.plan(0, [SampleMeta(id=0)]), now=0.0)
    ledger.planned(planner.plan(1, [SampleMeta(id=1)]), now=1.0)  # sent one step ahead
    ledger.on_loss(0, 0, 1.0, 1.0)
    assert ledger.on_done(0, 0, stats(4.0, 1, 1), now=5.0)["step_time_s"] == 5.0
    ledger.on_loss(0, 1, 1.0, 1.0)
    assert ledger.on_done(0, 1, stats(2.0, 1, 1), now=8.0)["step_time_s"] == 3.0


def test_without_shuffle_every_epoch_takes_the_file_order():
    sampler = EpochSampler(metadata(10), 4, seed=3, shuffle=False)
    assert [ids(sampler.batch(s)) for s in range(4)] == [[1000, 1001, 1002, 1003], [1004, 1005, 1006, 1007],
                                                         [1000, 1001, 1002, 1003], [1004, 1005, 1006, 1007]]


def test_the_position_says_where_a_resumed_run_starts():
    sampler = EpochSampler(metadata(10), 4, seed=3)
    assert sampler.position(5) == {"step": 5, "epoch": 2, "batch_in_epoch": 1, "batches_per_epoch": 2,
                                   "num_samples": 10, "global_batch": 4, "seed": 3, "shuffle": True,
                                   "data_fingerprint": data_fingerprint(metadata(10)),
                                   "data_sizes": data_fingerprint(metadata(10), sizes=True)}
    # A fresh sampler (a resumed run) draws the same batches from that step on.
    assert [ids(EpochSampler(metadata(10), 4, seed=3).batch(s)) for s in (5, 6)] == \
        [ids(sampler.batch(s)) for s in (5, 6)]


def test_norm_shares_of_every_trainable_replica_give_one_clip_coefficient():
    graph = graph_of([S("teacher", trainable=False), S("vision", dp=2, activates_on="image"), S("llm", dp=2)],
                     [Edge(src="teacher", dst="llm", tensors=("t",)), Edge(src="vision", dst="llm", tensors=("v",))])
    graph = SectionGraph(Pipeline(name="p", data=ArrowData(path="d"), sections=list(graph.sections.values()),
                                  edges=graph.pipeline.edges, grad_clip=1.0))
    ledger = opened(StepLedger(graph, placement_of(graph)), 0)  # trainable ranks 1 2 (vision), 3 4 (llm)
    assert ledger.on_norm(1, 0, 9.0) is None
    assert ledger.on_norm(3, 0, 16.0) is None
    assert ledger.on_norm(2, 0, 0.0) is None
    with pytest.raises(Rejected):
        ledger.on_norm(1, 0, 9.0)  # a repeated report counts once
    ranks, coef = ledger.on_norm(4, 0, 0.0)
    assert ranks == [1, 2, 3, 4]
    assert coef == pytest.approx(1.0 / (5.0 + 1e-6))  # max_norm / (sqrt(9 + 16) + eps)
    for rank in (1, 4):  # once complete too: a second coefficient could overwrite a rank's clip
        with pytest.raises(Rejected, match="repeated norm report"):
            ledger.on_norm(rank, 0, 1e6)
    assert set(ledger.norms[0]) == {1, 2, 3, 4}  # kept until the step is done (on_done drops them)


def test_the_row_has_the_global_grad_norm_and_each_section_s_lr_and_grad_norm():
    graph = distill()
    ledger = StepLedger(graph, placement_of(graph))
    ledger.planned(make_planner("fifo", graph).plan(0, [SampleMeta(id=i, row=i) for i in range(4)]), now=0.0)
    ledger.on_done(0, 0, stats(0.1, 1, 4), now=1.0)
    ledger.on_done(1, 0, {**stats(0.1, 1, 2), "grad_sq": 9.0, "lr": 0.5, "loss_sum": 1.0, "denominator": 1.0}, now=1.0)
    row = ledger.on_done(2, 0, {**stats(0.1, 1, 2), "grad_sq": 0.0, "lr": 0.5, "loss_sum": 1.0, "denominator": 1.0},
                         now=1.0)
    assert row["grad_norm"] == 3.0
    assert row["sections"]["student"]["lr"] == 0.5 and "lr" not in row["sections"]["teacher"]
    # Each trainable section's own share of the norm (report.py warns of an all-zero one).
    assert row["sections"]["student"]["grad_norm"] == 3.0 and "grad_norm" not in row["sections"]["teacher"]
