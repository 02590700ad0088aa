"""The plan simulator (maestro_flow/planner/simulate.py): drawn timelines, then properties.

The drawn cases give each section's tasks on a time axis (one column per second) and compare the
simulator's Task records, makespan and lower bound with the hand-computed numbers. The property
tests (hypothesis) build random chains, stars and trees of 2-4 sections with random trainable
flags (kept valid: every trainable section reaches exactly one loss), random activations and
random positive costs, plan them with every schedule and check what any faithful simulation
must satisfy: inputs before consumers, one task at a time per replica in plan order, backward
passes only after their gradients return, no idling while work is ready, busy time that adds
up, a lower bound that is one, and determinism.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maestro_flow import ArrowData, Cost, Edge, Pipeline, Section
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import CostModel, Plan, make_planner
from maestro_flow.planner.simulate import (
    Simulation,
    Task,
    bound_terms,
    critical_section,
    message_counts,
    messages_received,
    simulate,
    task_s,
)
from maestro_flow.samples import SampleMeta
from tests.unit.test_planner import draw_tree

MODALITIES = ("text", "image", "audio")
TEXT = frozenset({"text"})
IMAGE = frozenset({"text", "image"})
EPS = 1e-9


def S(name: str, **kw) -> Section:
    return Section(name=name, stage=f"stages.fake:{name.title()}", **{"trainable": False, **kw})


def pipeline(sections, edges) -> Pipeline:
    return Pipeline(name="p", data=ArrowData(path="d"), sections=sections, edges=edges)


def costs_of(graph: SectionGraph, transfer_s: float = 0.0, padded: bool = False) -> CostModel:
    return CostModel(costs={n: dataclasses.replace(s.cost, padded=padded) for n, s in graph.sections.items()},
                     transfer_s=transfer_s)


def section_work(graph: SectionGraph, costs: CostModel, samples) -> dict[str, float]:
    """Every sample's task_s summed per section (what it computes, fixed costs and padding aside)."""
    return {n: sum(task_s(graph, costs, n, s) for s in samples if graph.sections[n].activates(s.modalities))
            for n in graph.order}


def forward_s(costs: CostModel, name: str, samples) -> float:
    """A micro-batch's forward from first principles: the fixed cost, and every sample at its
    own cost, or, where the stage pads, at the cost of the micro-batch's costliest sample."""
    each = [costs.sample_s(name, s) for s in samples]
    if costs.costs[name].padded:
        each = [max(each)] * len(each)
    return costs.micro_batch_s(name) + sum(each)


def timeline(sim: Simulation, graph: SectionGraph) -> list[tuple[str, int, int, str, float, float]]:
    """Tasks as plain tuples sorted by start, then topological order, then replica."""
    return sorted(((t.section, t.replica, t.micro_batch, t.kind, t.start_s, t.end_s) for t in sim.tasks),
                  key=lambda x: (x[4], graph.order.index(x[0]), x[1]))


# -- drawn cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("transfer_s", [0.0, 0.25])
def test_distillation_fifo_timeline(transfer_s):
    """8 samples, teacher dp=1 mb=4 (frozen, 1 s/sample) -> student dp=2 mb=2 (trainable, 1 s
    forward + 1 s backward per sample, one task because the student is the loss section).

        FIFO plan:  teacher[0]: [0,1,4,5] [2,3,6,7]
                    student[0]: [0,1] [2,3]      student[1]: [4,5] [6,7]

        time (s)     0   1   2   3   4   5   6   7   8   9  10  11  12
        teacher[0]   |--- mb0 -------|--- mb1 -------|
        student[0]                   |--- mb0 -------|--- mb1 -------|
        student[1]                   |--- mb0 -------|--- mb1 -------|

    With transfer t every student task starts t later: makespan 12 + t. The lower bound is the
    "last teacher output" bound: teacher forward work 8/1 + t + the cheapest student task (2 s)
    = 10 + t (the others: work 16/2 = 8, teacher 8/1, first output 1 + t + 16/2 = 9 + t). The
    student is the critical section (8 s per replica, later in topological order than the
    teacher's 8 s), busy 8 of 12 + t seconds.
    """
    p = pipeline([S("teacher", dp=1, micro_batch=4, cost=Cost(per_sample_s=1.0)),
                  S("student", trainable=True, dp=2, micro_batch=2, cost=Cost(per_sample_s=1.0, backward_factor=1.0))],
                 [Edge(src="teacher", dst="student", tensors=("hidden",))])
    graph = SectionGraph(p)
    costs = costs_of(graph, transfer_s)
    plan = make_planner("fifo", graph, costs).plan(0, [SampleMeta(id=i, row=i) for i in range(8)])
    assert plan.describe() == ("step 0 (fifo)\n"
                               "teacher[0]: [0,1,4,5] [2,3,6,7]\n"
                               "student[0]: [0,1] [2,3]\n"
                               "student[1]: [4,5] [6,7]")
    sim = simulate(plan, graph, costs)
    t = transfer_s
    assert timeline(sim, graph) == [
        ("teacher", 0, 0, "forward", 0.0, 4.0),
        ("teacher", 0, 1, "forward", 4.0, 8.0),
        ("student", 0, 0, "forward", 4.0 + t, 8.0 + t),
        ("student", 1, 0, "forward", 4.0 + t, 8.0 + t),
        ("student", 0, 1, "forward", 8.0 + t, 12.0 + t),
        ("student", 1, 1, "forward", 8.0 + t, 12.0 + t),
    ]
    assert sim.makespan_s == 12.0 + t
    assert sim.lower_bound_s == 10.0 + t
    assert sim.critical_section == "student"
    assert sim.critical_busy_fraction == pytest.approx(16.0 / (2 * (12.0 + t)))
    assert sim.busy_s == {"teacher": (8.0,), "student": (8.0, 8.0)}
    assert sim.finish_s == {"teacher": (8.0,), "student": (12.0 + t, 12.0 + t)}


def test_frozen_image_encoder_feeds_only_image_samples():
    """6 samples; 1, 2 and 4 carry an image of 2, 1 and 3 patches. vision (frozen, image only,
    1 s/patch) dp=1 mb=1 -> llm (trainable, 0.5 s forward + 0.5 s backward per sample) dp=1 mb=2.

        FIFO plan:  vision[0]: [1] [2] [4]        (text samples 0, 3, 5 never reach it)
                    llm[0]:    [0,1] [2,3] [4,5]

        time (s)    0   1   2   3   4   5   6   7   8
        vision[0]   |-- 1 --|-2-|---- 4 ----|
        llm[0]              |-0,1--|-2,3--|-4,5--|
                    (waits for 1)        (waits for 4 until 6)

    Makespan 8. Lower bound 7: the vision forward work (6 s) + the cheapest llm task (1 s); the
    llm (6 s of work, later in order than vision's 6 s) is critical and busy 6 of 8 s.
    """
    p = pipeline([S("vision", activates_on="image", dp=1, micro_batch=1, cost=Cost(per_sample_s=0.0, per_patch_s=1.0)),
                  S("llm", trainable=True, dp=1, micro_batch=2, cost=Cost(per_sample_s=0.5, backward_factor=1.0))],
                 [Edge(src="vision", dst="llm", tensors=("patches",))])
    graph = SectionGraph(p)
    costs = costs_of(graph)
    patches = {1: 2, 2: 1, 4: 3}
    samples = [SampleMeta(id=i, row=i, modalities=IMAGE if i in patches else TEXT, num_patches=patches.get(i, 0))
               for i in range(6)]
    plan = make_planner("fifo", graph, costs).plan(0, samples)
    assert plan.describe() == "step 0 (fifo)\nvision[0]: [1] [2] [4]\nllm[0]: [0,1] [2,3] [4,5]"
    sim = simulate(plan, graph, costs)
    assert timeline(sim, graph) == [
        ("vision", 0, 0, "forward", 0.0, 2.0),
        ("vision", 0, 1, "forward", 2.0, 3.0),
        ("llm", 0, 0, "forward", 2.0, 4.0),
        ("vision", 0, 2, "forward", 3.0, 6.0),
        ("llm", 0, 1, "forward", 4.0, 6.0),
        ("llm", 0, 2, "forward", 6.0, 8.0),
    ]
    assert (sim.makespan_s, sim.lower_bound_s, sim.critical_section) == (8.0, 7.0, "llm")
    assert sim.critical_busy_fraction == 0.75
    assert sim.busy_s == {"vision": (6.0,), "llm": (6.0,)}


def test_trainable_encoder_backward_waits_for_the_llm():
    """4 image samples; vision (trainable, 1 s forward + 1 s backward per sample) dp=1 mb=2 ->
    llm (trainable, the loss: 1 s + 1 s per sample, one task) dp=1 mb=2.

        time (s)    0   1   2   3   4   5   6   7   8   9  10  11  12
        vision[0]   |F mb0--|F mb1--|       |B mb0--|       |B mb1--|
        llm[0]              |F+B mb0--------|F+B mb1--------|

    The encoder keeps mb0's activations until the llm's task for samples 0,1 ends (6), then runs
    its backward; its forward of mb1 went first because it was ready at 2. Makespan 12; the lower
    bound is the llm's first input (1 s) + its 8 s of work = 9.
    """
    p = pipeline([S("vision", activates_on="image", trainable=True, dp=1, micro_batch=2,
                    cost=Cost(per_sample_s=1.0, backward_factor=1.0)),
                  S("llm", trainable=True, dp=1, micro_batch=2, cost=Cost(per_sample_s=1.0, backward_factor=1.0))],
                 [Edge(src="vision", dst="llm", tensors=("patches",))])
    graph = SectionGraph(p)
    costs = costs_of(graph)
    plan = make_planner("fifo", graph, costs).plan(0, [SampleMeta(id=i, row=i, modalities=IMAGE) for i in range(4)])
    assert plan.describe() == "step 0 (fifo)\nvision[0]: [0,1] [2,3]\nllm[0]: [0,1] [2,3]"
    sim = simulate(plan, graph, costs)
    assert timeline(sim, graph) == [
        ("vision", 0, 0, "forward", 0.0, 2.0),
        ("vision", 0, 1, "forward", 2.0, 4.0),
        ("llm", 0, 0, "forward", 2.0, 6.0),
        ("vision", 0, 0, "backward", 6.0, 8.0),
        ("llm", 0, 1, "forward", 6.0, 10.0),
        ("vision", 0, 1, "backward", 10.0, 12.0),
    ]
    # Task records come in start order per replica, and every backward follows its llm task.
    assert [t.kind for t in sim.tasks if t.section == "vision"] == ["forward", "forward", "backward", "backward"]
    llm_end = {t.micro_batch: t.end_s for t in sim.tasks if t.section == "llm"}
    assert all(t.start_s >= llm_end[t.micro_batch] for t in sim.tasks if t.kind == "backward")
    assert (sim.makespan_s, sim.lower_bound_s, sim.critical_section) == (12.0, 9.0, "llm")
    assert sim.busy_s == {"vision": (8.0,), "llm": (8.0,)}


def test_each_message_received_costs_its_receiver_where_message_s_says_so():
    """4 image samples; vision (trainable, 1 s + 1 s per sample) dp=1 mb=1 -> llm (the loss,
    1 s + 1 s per sample in one task) dp=1 mb=2; each message costs the llm 0.5 s and vision
    0.25 s of their own time. As the executor sends them: one forward message per vision
    micro-batch (so 2 into each llm task), one gradient message per llm micro-batch (taken by
    the first vision backward holding one of its samples: mb0 and mb2).

        time (s)    0   1   2   3   4   5   6   7   8   9  10  11  12  13  14
        vision[0]   |F0 |F1 |F2 |F3 |                   |B0+ |B1 |          |B2+ |B3 |
        llm[0]              |F+B mb0 + 2 messages---|F+B mb1 + 2 messages---|

    Without message_s the same plan ends at 12 (the llm's 8 s after its first input at 2, then
    the encoder's last backward)."""
    p = pipeline([S("vision", activates_on="image", trainable=True, dp=1, micro_batch=1,
                    cost=Cost(per_sample_s=1.0, backward_factor=1.0)),
                  S("llm", trainable=True, dp=1, micro_batch=2, cost=Cost(per_sample_s=1.0, backward_factor=1.0))],
                 [Edge(src="vision", dst="llm", tensors=("patches",))])
    graph = SectionGraph(p)
    plan = make_planner("fifo", graph, costs_of(graph)).plan(0, [SampleMeta(id=i, row=i, modalities=IMAGE)
                                                                 for i in range(4)])
    assert plan.describe() == "step 0 (fifo)\nvision[0]: [0] [1] [2] [3]\nllm[0]: [0,1] [2,3]"
    assert message_counts(graph, plan.replicas) == {("vision", 0): [(0, 1), (0, 0), (0, 1), (0, 0)],
                                                     ("llm", 0): [(2, 0), (2, 0)]}
    plain = simulate(plan, graph, costs_of(graph))
    costs = dataclasses.replace(costs_of(graph), message_s={"llm": 0.5, "vision": 0.25})
    sim = simulate(plan, graph, costs)
    assert timeline(sim, graph) == [
        ("vision", 0, 0, "forward", 0.0, 1.0),
        ("vision", 0, 1, "forward", 1.0, 2.0),
        ("vision", 0, 2, "forward", 2.0, 3.0),
        ("llm", 0, 0, "forward", 2.0, 7.0),
        ("vision", 0, 3, "forward", 3.0, 4.0),
        ("vision", 0, 0, "backward", 7.0, 8.25),
        ("llm", 0, 1, "forward", 7.0, 12.0),
        ("vision", 0, 1, "backward", 8.25, 9.25),
        ("vision", 0, 2, "backward", 12.0, 13.25),
        ("vision", 0, 3, "backward", 13.25, 14.25),
    ]
    assert (plain.makespan_s, sim.makespan_s) == (12.0, 14.25)
    # Busy time adds up: every message once, on its receiver.
    assert sim.busy_s["llm"][0] == pytest.approx(plain.busy_s["llm"][0] + 4 * 0.5)
    assert sim.busy_s["vision"][0] == pytest.approx(plain.busy_s["vision"][0] + 2 * 0.25)


def test_messages_are_counted_per_receiving_replica():
    """A producer micro-batch whose samples go to two consumer replicas is two messages, one for
    each; a consumer micro-batch drawing on two producer micro-batches takes two."""
    p = pipeline([S("vision", activates_on="image", trainable=True, dp=1, micro_batch=2,
                    cost=Cost(per_sample_s=1.0)),
                  S("llm", trainable=True, dp=2, micro_batch=2, cost=Cost(per_sample_s=1.0))],
                 [Edge(src="vision", dst="llm", tensors=("patches",))])
    graph = SectionGraph(p)
    replicas = {"vision": (((0, 1), (2, 3)),), "llm": (((0, 2),), ((1, 3),))}
    assert message_counts(graph, replicas) == {("vision", 0): [(0, 2), (0, 0)], ("llm", 0): [(2, 0)],
                                               ("llm", 1): [(2, 0)]}
    # Per section, from a plans.jsonl line's "sections" (what calibration and tune_report read).
    assert messages_received(graph, {n: {"replicas": r} for n, r in replicas.items()}) == {"vision": 2, "llm": 4}


def test_empty_batch():
    p = pipeline([S("enc", dp=2), S("lm", trainable=True, dp=2)], [Edge(src="enc", dst="lm", tensors=("h",))])
    graph = SectionGraph(p)
    sim = simulate(make_planner("wavefront", graph).plan(0, []), graph, costs_of(graph))
    assert (sim.makespan_s, sim.lower_bound_s, sim.critical_busy_fraction, sim.tasks) == (0.0, 0.0, 1.0, ())
    assert sim.busy_s == {"enc": (0.0, 0.0), "lm": (0.0, 0.0)}


def test_a_plan_that_cannot_complete_is_refused():
    """A hand-written plan whose llm replica needs an output (sample 1) that the encoder never
    makes: the simulation names the replica and micro-batch that is stuck."""
    p = pipeline([S("vision", dp=1), S("llm", trainable=True, dp=1)], [Edge(src="vision", dst="llm", tensors=("h",))])
    graph = SectionGraph(p)
    samples = (SampleMeta(id=0), SampleMeta(id=1))
    plan = Plan(step=0, schedule="fifo", samples=samples, replicas={"vision": (((0,),),), "llm": (((0,), (1,)),)},
                routes={"vision": {0: 0, 1: 0}, "llm": {0: 0, 1: 0}})
    with pytest.raises(ValueError, match=r"llm\[0\] is stuck at micro-batch 1"):
        simulate(plan, graph, costs_of(graph))


# The lower bound counts only work that happens: a producer's outputs that a consumer takes, and
# backwards that a gradient comes back for (as the simulation and the executor do).


def test_lower_bound_ignores_producer_samples_no_consumer_takes():
    """enc (frozen, all samples, 1 s) dp=1 mb=1 -> llm (image only, 0.5 + 0.5 s) dp=1 mb=1.
    Sample 0 has an image, 1-3 are text: enc makes 0 first, the llm is done at 2, enc at 4.

        enc[0]  |0|1|2|3|          makespan 4, but lower_bound_s = 4/1 + 0 + 1 = 5
        llm[0]    |0|
    """
    p = pipeline([S("enc", dp=1, cost=Cost(per_sample_s=1.0)),
                  S("llm", activates_on="image", trainable=True, dp=1,
                    cost=Cost(per_sample_s=0.5, backward_factor=1.0))],
                 [Edge(src="enc", dst="llm", tensors=("h",))])
    graph = SectionGraph(p)
    costs = costs_of(graph)
    samples = [SampleMeta(id=0, modalities=IMAGE)] + [SampleMeta(id=i) for i in (1, 2, 3)]
    for schedule in ("fifo", "wavefront"):
        sim = simulate(make_planner(schedule, graph, costs).plan(0, samples), graph, costs)
        assert sim.makespan_s == 4.0
        assert sim.lower_bound_s <= sim.makespan_s


def test_lower_bound_ignores_backward_nobody_needs():
    """enc (trainable, all samples, 1 s forward, backward_factor 2) dp=1 mb=1 -> llm (image only,
    the loss) dp=1 mb=1. Only sample 0 gets a gradient back, so enc runs 4 forwards + 1 backward:

        enc[0]  |0|1|B0 |2|3|      makespan 6 (enc busy 6), but lower_bound_s = 4 x (1 + 2) = 12
        llm[0]    |0|
    """
    p = pipeline([S("enc", trainable=True, dp=1, cost=Cost(per_sample_s=1.0, backward_factor=2.0)),
                  S("llm", activates_on="image", trainable=True, dp=1,
                    cost=Cost(per_sample_s=0.5, backward_factor=1.0))],
                 [Edge(src="enc", dst="llm", tensors=("h",))])
    graph = SectionGraph(p)
    costs = costs_of(graph)
    samples = [SampleMeta(id=0, modalities=IMAGE)] + [SampleMeta(id=i) for i in (1, 2, 3)]
    for schedule in ("fifo", "wavefront"):
        sim = simulate(make_planner(schedule, graph, costs).plan(0, samples), graph, costs)
        assert sim.makespan_s == 6.0 and sim.busy_s["enc"] == (6.0,)
        assert sim.lower_bound_s <= sim.makespan_s


def test_the_critical_section_and_the_bound_count_fixed_costs_per_micro_batch():
    """Found in QA: the critical section and the bound counted each sample's work only. teacher
    (frozen, 1 s a sample, micro_batch 8) -> student (the loss, 0.4 s a sample, backward_factor
    1, 2 s per micro-batch, micro_batch 1), 8 samples: per sample, the teacher has more work (8 s
    against 6.4 s), but the student runs at least 8 micro-batches, each with 2 s fixed forward
    and 2 s fixed backward: 38.4 s. `maestro plan` named the teacher critical, bound 8 s."""
    p = pipeline([S("teacher", dp=1, micro_batch=8, cost=Cost(per_sample_s=1.0)),
                  S("student", trainable=True, dp=1, micro_batch=1,
                    cost=Cost(per_sample_s=0.4, backward_factor=1.0, per_micro_batch_s=2.0))],
                 [Edge(src="teacher", dst="student", tensors=("h",))])
    graph = SectionGraph(p)
    costs = costs_of(graph)
    samples = [SampleMeta(id=i) for i in range(8)]
    for schedule in ("fifo", "wavefront"):
        sim = simulate(make_planner(schedule, graph, costs).plan(0, samples), graph, costs)
        assert sim.critical_section == "student" == critical_section(graph, costs, samples)
        assert 38.4 - EPS <= sim.lower_bound_s <= sim.makespan_s + EPS
    # At micro_batch 4 the student needs 2 micro-batches (4 s fixed each, backward included); at
    # dp 2 its work per replica is (6.4 + 8) / 2 = 7.2 s, below the teacher's 8 s.
    wider = SectionGraph(p.override(**{"sections.student.dp": 2, "sections.student.micro_batch": 4}))
    terms = bound_terms(samples, wider, costs)
    assert terms["work:student"] == pytest.approx(7.2) and terms["work:teacher"] == 8.0
    assert critical_section(wider, costs, samples) == "teacher"


# -- random graphs with trainable sections and costs ---------------------------------------


def _settle_trainable(n: int, edges: list[tuple[int, int]], trainable: list[bool]) -> list[bool]:
    """Freeze every trainable section that does not reach exactly one loss (a trainable sink)
    through trainable edges, until the flags are stable (graph.py's rule)."""
    trainable = list(trainable)

    def losses(i: int) -> set[int]:
        outs = [b for a, b in edges if a == i]
        if not outs:
            return {i} if trainable[i] else set()
        return set().union(*(losses(b) for b in outs if trainable[b]))

    changed = True
    while changed:
        changed = False
        for i in range(n):
            if trainable[i] and len(losses(i)) != 1:
                trainable[i], changed = False, True
    return trainable


@st.composite
def trained_pipelines(draw) -> Pipeline:
    """A chain, star or tree of 2-4 sections (dp multiples/divisors along edges), random
    activations, trainable flags and positive costs."""
    n, parents, dps = draw_tree(draw)
    edges = [(parents[i], i) if draw(st.booleans()) else (i, parents[i]) for i in range(1, n)]
    trainable = _settle_trainable(n, edges, [draw(st.sampled_from((True, True, False))) for _ in range(n)])
    money = st.floats(0.01, 2.0, allow_nan=False)
    sections = [S(f"s{i}", dp=dps[i], micro_batch=draw(st.integers(1, 5)), trainable=trainable[i],
                  activates_on=draw(st.sampled_from((None, None, *MODALITIES))),
                  cost=Cost(per_sample_s=draw(money), per_token_s=draw(st.sampled_from((0.0, 0.01, 0.1))),
                            per_patch_s=draw(st.sampled_from((0.0, 0.05))),
                            backward_factor=draw(st.sampled_from((0.5, 1.0, 2.0, 3.0))),
                            per_micro_batch_s=draw(st.sampled_from((0.0, 0.0, 0.3)))))
                for i in range(n)]
    return pipeline(sections, [Edge(src=f"s{a}", dst=f"s{b}", tensors=(f"t{a}{b}",)) for a, b in edges])


@st.composite
def batches(draw) -> list[SampleMeta]:
    """0-40 samples with distinct ids, random non-empty modality sets and sizes."""
    n = draw(st.integers(0, 40))
    rnd = draw(st.randoms(use_true_random=False))
    ids = rnd.sample(range(10**6), n)
    out = []
    for k, sid in enumerate(ids):
        mods = frozenset(m for i, m in enumerate(MODALITIES) if rnd.randint(1, 7) >> i & 1) or TEXT
        out.append(SampleMeta(id=sid, row=k, modalities=mods, num_tokens=rnd.randint(1, 50),
                              num_patches=rnd.choice((0, 4, 16)) if "image" in mods else 0))
    return out


def bound_assumptions_hold(graph: SectionGraph) -> bool:
    """Every edge's consumer activates on every sample its producer does."""
    return all(graph.sections[e.edge.dst].activates_on in (None, graph.sections[e.edge.src].activates_on)
               for e in graph.edges)


def check_simulation(graph: SectionGraph, costs: CostModel, plan: Plan, sim: Simulation) -> None:
    meta = {s.id: s for s in plan.samples}
    secs = graph.sections
    losses = set(graph.loss_sections())
    tr = costs.transfer_s
    fwd: dict[tuple[str, int, int], Task] = {}
    bwd: dict[tuple[str, int, int], Task] = {}
    for t in sim.tasks:
        tasks = fwd if t.kind == "forward" else bwd
        assert t.kind in ("forward", "backward")
        assert (t.section, t.replica, t.micro_batch) not in tasks, t
        tasks[(t.section, t.replica, t.micro_batch)] = t
    mb_of = {(n, sid): (n, r, m) for n, reps in plan.replicas.items()
             for r, mbs in enumerate(reps) for m, mb in enumerate(mbs) for sid in mb}
    mbs_of = {(n, r, m): mb for n, reps in plan.replicas.items()
              for r, mbs in enumerate(reps) for m, mb in enumerate(mbs)}

    # Exactly one forward per micro-batch; a backward exactly where a gradient is expected.
    assert set(fwd) == set(mbs_of)
    needs_bwd = {k for k, mb in mbs_of.items() if secs[k[0]].trainable and k[0] not in losses
                 and any(secs[e.edge.dst].activates(meta[s].modalities)
                         for e in graph.needs_grad_from(k[0]) for s in mb)}
    assert set(bwd) == needs_bwd
    for k, t in fwd.items():
        mb = mbs_of[k]
        cost = forward_s(costs, k[0], [meta[s] for s in mb])
        if k[0] in losses:
            cost *= 1.0 + costs.costs[k[0]].backward_factor
        assert t.start_s >= 0 and t.end_s - t.start_s == pytest.approx(cost, abs=EPS)
    for k, t in bwd.items():
        cost = costs.costs[k[0]].backward_factor * forward_s(costs, k[0], [meta[s] for s in mbs_of[k]])
        assert t.end_s - t.start_s == pytest.approx(cost, abs=EPS)

    # (b) a forward starts only once every producer task holding one of its samples ended + transfer.
    def inputs_at(k) -> float:
        return max((fwd[mb_of[(e.edge.src, s)]].end_s + tr for s in mbs_of[k] for e in graph.inputs(k[0])
                    if secs[e.edge.src].activates(meta[s].modalities)), default=0.0)

    # A gated forward (run-ahead credit) also waits for the consumer's j-th forward to end.
    def gate_at(k) -> float:
        at = 0.0
        for c, ci, j in plan.gates_of(k[0], k[1])[k[2]]:
            at = max(at, fwd[(c, ci, j - 1)].end_s)
        return at

    def ready_at(k) -> float:
        return max(inputs_at(k), gate_at(k))

    for k, t in fwd.items():
        assert t.start_s >= ready_at(k) - EPS, (k, t)

    # (d) a backward starts after its own forward and after every consumer that owes it a gradient
    # sent it: a loss section at the end of its task, others after their backward (or forward,
    # where they need none themselves).
    def grads_at(k) -> float:
        at = fwd[k].end_s
        for e in graph.needs_grad_from(k[0]):
            for s in mbs_of[k]:
                if secs[e.edge.dst].activates(meta[s].modalities):
                    ck = mb_of[(e.edge.dst, s)]
                    at = max(at, bwd.get(ck, fwd[ck]).end_s + tr)
        return at

    for k, t in bwd.items():
        assert t.start_s >= grads_at(k) - EPS, (k, t)

    # (c) each replica runs one task at a time, forwards in plan order; and it never idles while a
    # task is ready (after a gap the next task starts exactly when it became ready).
    for n, reps in plan.replicas.items():
        for r in range(len(reps)):
            mine = sorted((t for t in sim.tasks if (t.section, t.replica) == (n, r)), key=lambda t: t.start_s)
            assert [t.micro_batch for t in mine if t.kind == "forward"] == list(range(len(reps[r])))
            # Backwards run oldest first, as the executor runs them (a later one whose gradients
            # came back first waits: the simulation let it go ahead, up to 9.5% optimistic).
            backwards = [t.micro_batch for t in mine if t.kind == "backward"]
            assert backwards == sorted(backwards), (n, r, backwards)
            free = 0.0
            for t in mine:
                assert t.start_s >= free - EPS, (n, r, t)
                k = (n, r, t.micro_batch)
                ready = ready_at(k) if t.kind == "forward" else grads_at(k)
                assert t.start_s == pytest.approx(max(free, ready), abs=EPS), (n, r, t)
                free = t.end_s
            # (e) busy time is the sum of the replica's task durations; finish its last end.
            assert sim.busy_s[n][r] == pytest.approx(sum(t.end_s - t.start_s for t in mine), abs=EPS)
            assert sim.finish_s[n][r] == pytest.approx(max((t.end_s for t in mine), default=0.0), abs=EPS)
    assert sim.makespan_s == pytest.approx(max((t.end_s for t in sim.tasks), default=0.0), abs=EPS)
    crit = sim.critical_section
    assert crit == critical_section(graph, costs, plan.samples)
    assert 0.0 <= sim.critical_busy_fraction <= 1.0 + EPS
    if sim.makespan_s > 0:
        expect = sum(sim.busy_s[crit]) / (sim.makespan_s * secs[crit].dp)
        assert sim.critical_busy_fraction == pytest.approx(expect)
    # (a) the lower bound is one, and it is at least the busiest section's average work.
    assert 0 <= sim.lower_bound_s <= sim.makespan_s + EPS
    work = section_work(graph, costs, plan.samples)
    for n in graph.order:
        # A micro-batch's backward runs through the whole micro-batch even when only some of its
        # samples get a gradient back, so the simulation may do more than the per-sample work.
        assert sum(sim.busy_s[n]) >= work[n] - 1e-7
    assert sim.lower_bound_s >= max(work[n] / secs[n].dp for n in graph.order) - EPS


@pytest.mark.parametrize("schedule", ["fifo", "wavefront"])
@settings(max_examples=120, deadline=None, database=None)
@given(p=trained_pipelines(), samples=batches(), transfer_s=st.sampled_from((0.0, 2e-4, 0.05, 0.5)))
def test_every_simulation_respects_dependencies_and_accounting(schedule, p, samples, transfer_s):
    graph = SectionGraph(p)
    costs = costs_of(graph, transfer_s)
    plan = make_planner(schedule, graph, costs).plan(0, samples)
    sim = simulate(plan, graph, costs)
    check_simulation(graph, costs, plan, sim)
    # (f) deterministic: the same plan simulates to the same result, also from a rebuilt graph.
    assert simulate(plan, SectionGraph(Pipeline.from_dict(p.to_dict())), costs) == sim


@pytest.mark.parametrize("schedule", ["fifo", "wavefront"])
@settings(max_examples=60, deadline=None, database=None)
@given(p=trained_pipelines(), samples=batches())
def test_lower_bound_never_exceeds_makespan_where_every_output_is_consumed(schedule, p, samples):
    """(a) on graphs that satisfy the bound's assumptions (every consumer activates on all its
    producer's samples): explicit, so hypothesis does not spend its budget elsewhere."""
    consumers = {e.dst for e in p.edges}
    # Make every consumer activate on everything: the assumption then holds by construction.
    p = pipeline([dataclasses.replace(s, activates_on=None) if s.name in consumers else s for s in p.sections],
                 list(p.edges))
    graph = SectionGraph(p)
    assert bound_assumptions_hold(graph)
    costs = costs_of(graph, 2e-4)
    sim = simulate(make_planner(schedule, graph, costs).plan(0, samples), graph, costs)
    assert sim.lower_bound_s <= sim.makespan_s + EPS


def test_the_simulation_charges_padding_to_the_longest_sample():
    """One replica, one micro-batch of a 10-token and a 90-token sample: a padding stage's
    forward costs 2 x 90 tokens, a packing one's 100."""
    from maestro_flow.config import ArrowData, Cost, Pipeline, Section
    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner.cost import CostModel
    from maestro_flow.planner.plan import Plan
    from maestro_flow.planner.simulate import simulate
    from maestro_flow.samples import SampleMeta

    samples = (SampleMeta(id=0, num_tokens=10), SampleMeta(id=1, num_tokens=90))
    for padded, want in ((False, 100.0), (True, 180.0)):
        cost = Cost(per_sample_s=0.0, per_token_s=1.0, backward_factor=1.0, padded=padded)
        p = Pipeline(name="p", data=ArrowData(path="d"), sections=[Section(name="lm", stage="m:L", cost=cost)])
        plan = Plan(step=0, schedule="fifo", samples=samples, replicas={"lm": (((0, 1),),)}, routes={"lm": {0: 0, 1: 0}})
        sim = simulate(plan, SectionGraph(p), CostModel(costs={"lm": cost}, transfer_s=0.0))
        assert sim.makespan_s == pytest.approx(2 * want)  # a loss section: forward + backward


def test_samples_s_is_sample_s_for_every_sample():
    import random

    from maestro_flow.samples import SampleMeta

    rng = random.Random(0)
    samples = [SampleMeta(id=i, modalities=("text", "image")[: 1 + i % 2], num_tokens=rng.randrange(1, 4000),
                          num_patches=rng.randrange(0, 1000), num_frames=rng.randrange(0, 50)) for i in range(200)]
    costs = CostModel(costs={"x": Cost(per_sample_s=1.3e-4, per_token_s=7.1e-6, per_patch_s=3.3e-5,
                                       per_frame_s=2.9e-4)})
    assert costs.samples_s("x", samples) == {s.id: costs.sample_s("x", s) for s in samples}  # exactly, not approx


def test_a_zero_cost_backward_still_waits_for_its_gradients():
    """a -> b -> c, all trainable, c the loss; b costs nothing. b's backward is a task of no
    length, still after c's gradients: the simulation sent b's gradients at its forward's end, so
    a's backward ran while c was still computing."""
    p = pipeline([S("a", trainable=True, micro_batch=2, cost=Cost(per_sample_s=1.0)),
                  S("b", trainable=True, micro_batch=2, cost=Cost(per_sample_s=0.0)),
                  S("c", trainable=True, micro_batch=2, cost=Cost(per_sample_s=10.0))],
                 [Edge(src="a", dst="b", tensors=("x",)), Edge(src="b", dst="c", tensors=("y",))])
    graph = SectionGraph(p)
    costs = CostModel(costs={n: s.cost for n, s in graph.sections.items()})
    plan = make_planner("fifo", graph, costs).plan(0, [SampleMeta(id=i, row=i) for i in range(4)])
    sim = simulate(plan, graph, costs)
    ends = {(t.section, t.micro_batch, t.kind): t.end_s for t in sim.tasks}
    starts = {(t.section, t.micro_batch, t.kind): t.start_s for t in sim.tasks}
    for m in (0, 1):
        assert starts[("b", m, "backward")] >= ends[("c", m, "forward")]
        assert starts[("a", m, "backward")] >= ends[("b", m, "backward")]
    check_simulation(graph, costs, plan, sim)
