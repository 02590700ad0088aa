"""The planners (maestro_flow/planner/): FIFO drawn cases compared as text, then properties of every schedule.

The drawn cases show each plan as `Plan.describe()` prints it: one line per replica, its
micro-batches in execution order. The property tests (hypothesis) build random chains, stars
and trees of 2-4 sections whose dp degrees are multiples/divisors along every edge, and check
what every plan must satisfy whatever the schedule: each sample processed exactly once by every
section that activates on it, micro-batches within `micro_batch`, routes that obey the edge
rule, producer and consumer agreeing on the order of their transfers, and determinism.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maestro_flow import ArrowData, Cost, Edge, Pipeline, PipelineError, Section
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import Plan, make_planner
from maestro_flow.runtime.ledger import plan_message
from maestro_flow.samples import SampleMeta

MODALITIES = ("text", "image", "audio")
TEXT = frozenset({"text"})
IMAGE = frozenset({"text", "image"})


def S(name: str, **kw) -> Section:
    return Section(name=name, stage=f"stages.fake:{name.title()}", **{"trainable": False, **kw})


def pipeline(sections, edges) -> Pipeline:
    return Pipeline(name="p", data=ArrowData(path="d"), sections=sections, edges=edges)


def plan_of(p: Pipeline, samples, step: int = 0) -> Plan:
    return make_planner("fifo", SectionGraph(p)).plan(step, samples)


def text_samples(ids) -> list[SampleMeta]:
    return [SampleMeta(id=i, row=i) for i in ids]


# -- invariants every plan must satisfy ----------------------------------------------------


def check_plan(graph: SectionGraph, samples: list[SampleMeta], plan: Plan) -> None:
    ids = [s.id for s in samples]
    mods = {s.id: s.modalities for s in samples}
    assert plan.samples == tuple(samples)
    assert list(plan.replicas) == graph.order
    for name, section in graph.sections.items():
        reps = plan.replicas[name]
        assert len(reps) == section.dp
        # Exactly once by every section that activates on the sample, never by one that does not.
        assert sorted(plan.processed(name)) == sorted(i for i in ids if section.activates(mods[i])), name
        # Every sample has a route, and a processed sample sits on the replica its route names.
        assert set(plan.routes[name]) == set(ids)
        for r, mbs in enumerate(reps):
            for mb in mbs:
                assert 1 <= len(mb) <= section.micro_batch, (name, r, mb)
                assert all(plan.routes[name][sid] == r for sid in mb)
    for e in graph.edges:
        src, dst = graph.sections[e.edge.src], graph.sections[e.edge.dst]
        for sid in ids:
            if src.activates(mods[sid]) and dst.activates(mods[sid]):
                assert plan.routes[dst.name][sid] in e.consumers_of(plan.routes[src.name][sid]), (e.edge.name, sid)
    check_pair_order(graph, plan)
    check_runs_to_completion(graph, plan, mods)


def check_pair_order(graph: SectionGraph, plan: Plan) -> None:
    """Each end computes one (producer replica, consumer replica) pair's transfers from its own
    plan message alone: both must name the same samples. The runtime posts receives in the order
    the sender's headers arrive, so matched P2P operations cannot cross whatever order the
    consumer then uses them in; where the consumer has a single producer edge and feeds no one
    (an LLM behind one encoder, a student behind a teacher) every schedule also consumes each
    pair's samples in the order they were sent (FIFO buffers, oldest first)."""
    messages = {(name, r): plan_message(plan, graph, name, r)
                for name, section in graph.sections.items() for r in range(section.dp)}

    def stream(name: str, r: int, peer: str, peer_replica: int) -> list[int]:
        """Samples exchanged between (name, r) and (peer, peer_replica), in (name, r)'s order."""
        msg = messages[(name, r)]
        mods = {s[0]: frozenset(s[2]) for s in msg["samples"]}
        return [sid for mb in msg["micro_batches"] for sid in mb
                if graph.sections[peer].activates(mods[sid]) and msg["routes"][peer][sid] == peer_replica]

    for e in graph.edges:
        src, dst = e.edge.src, e.edge.dst
        in_order = len(graph.inputs(dst)) == 1 and not graph.outputs(dst)
        for p in range(e.src_dp):
            for c in range(e.dst_dp):
                sent, received = stream(src, p, dst, c), stream(dst, c, src, p)
                assert sorted(sent) == sorted(received), (e.edge.name, p, c)
                if in_order or plan.schedule == "fifo":
                    assert sent == received, (e.edge.name, p, c)


def check_runs_to_completion(graph: SectionGraph, plan: Plan, mods) -> None:
    """Run every replica's micro-batches in plan order, a micro-batch only once all its inputs
    exist: every replica must finish (no consumer waits on a producer that waits on it)."""
    produced: set[tuple[str, int]] = set()
    at = {(name, r): 0 for name, reps in plan.replicas.items() for r in range(len(reps))}
    progress = True
    while progress:
        progress = False
        for (name, r), k in at.items():
            mbs = plan.replicas[name][r]
            if k == len(mbs):
                continue
            needs = {(e.edge.src, sid) for sid in mbs[k] for e in graph.inputs(name)
                     if graph.sections[e.edge.src].activates(mods[sid])}
            if needs <= produced:
                produced |= {(name, sid) for sid in mbs[k]}
                at[(name, r)] = k + 1
                progress = True
    assert all(k == len(plan.replicas[name][r]) for (name, r), k in at.items()), at


# -- drawn cases ---------------------------------------------------------------------------


def test_distill_fan_out():
    """16 samples, teacher dp=1 mb=8 -> student dp=2 mb=2 (fan-out 2).

        student[0] takes samples 0-7, student[1] 8-15, two per micro-batch. The teacher
        serves both: its first micro-batch holds what both students need first (their first two
        micro-batches), so neither student waits for the teacher's second micro-batch early.

            teacher[0]: [0 1 | 8 9 | 2 3 | 10 11] [4 5 | 12 13 | 6 7 | 14 15]
                          |     |                       (to student 0 | to student 1)
            student[0]: [0,1] [2,3] [4,5] [6,7]
            student[1]: [8,9] [10,11] [12,13] [14,15]
    """
    p = pipeline([S("teacher", dp=1, micro_batch=8), S("student", trainable=True, dp=2, micro_batch=2)],
                 [Edge(src="teacher", dst="student", tensors=("hidden",))])
    samples = text_samples(range(16))
    plan = plan_of(p, samples)
    assert plan.describe() == (
        "step 0 (fifo)\n"
        "teacher[0]: [0,1,8,9,2,3,10,11] [4,5,12,13,6,7,14,15]\n"
        "student[0]: [0,1] [2,3] [4,5] [6,7]\n"
        "student[1]: [8,9] [10,11] [12,13] [14,15]"
    )
    check_plan(SectionGraph(p), samples, plan)


def test_blocks_follow_batch_order_not_id_order():
    """A shuffled global batch (ids 30, 10, 20, 40): the student (anchor, dp=2) takes contiguous
    blocks of the batch *as given*; the teacher follows the students' micro-batch order.

            student[0]: [30] [10]      student[1]: [20] [40]
            teacher[0]: [30,20] [10,40]
    """
    p = pipeline([S("teacher", dp=1, micro_batch=2), S("student", trainable=True, dp=2, micro_batch=1)],
                 [Edge(src="teacher", dst="student", tensors=("hidden",))])
    plan = plan_of(p, text_samples([30, 10, 20, 40]), step=7)
    assert plan.describe() == (
        "step 7 (fifo)\n"
        "teacher[0]: [30,20] [10,40]\n"
        "student[0]: [30] [10]\n"
        "student[1]: [20] [40]"
    )


def test_fan_in():
    """12 samples, encoder dp=4 mb=2 -> llm dp=2 mb=3 (fan-in 2).

        The encoder (largest dp, the anchor) takes blocks of 3; llm[0] is served by encoders 0
        and 1, llm[1] by 2 and 3. Each llm replica takes samples in the order its encoders
        produce them (first micro-batch of each encoder, then the second):

            enc[0]: [0,1] [2]     enc[1]: [3,4] [5]     enc[2]: [6,7] [8]     enc[3]: [9,10] [11]
            llm[0]: [0,1,3] [4,2,5]                     llm[1]: [6,7,9] [10,8,11]
    """
    p = pipeline([S("enc", dp=4, micro_batch=2), S("llm", trainable=True, dp=2, micro_batch=3)],
                 [Edge(src="enc", dst="llm", tensors=("emb",))])
    samples = text_samples(range(12))
    plan = plan_of(p, samples)
    assert plan.describe() == (
        "step 0 (fifo)\n"
        "enc[0]: [0,1] [2]\n"
        "enc[1]: [3,4] [5]\n"
        "enc[2]: [6,7] [8]\n"
        "enc[3]: [9,10] [11]\n"
        "llm[0]: [0,1,3] [4,2,5]\n"
        "llm[1]: [6,7,9] [10,8,11]"
    )
    check_plan(SectionGraph(p), samples, plan)


def test_image_encoder_sees_only_image_samples():
    """8 samples, 1 2 5 6 7 carry an image; vision dp=1 mb=2 activates_on=image -> llm dp=2 mb=2.

        The llm takes every sample (0-3 on replica 0, 4-7 on replica 1); the vision encoder only
        the image samples, ordered by when the llm needs them (llm micro-batch 0 of both
        replicas first):

            llm[0]:    [0,1] [2,3]          llm[1]: [4,5] [6,7]
            vision[0]: [1,5] [2,6] [7]
    """
    p = pipeline([S("vision", activates_on="image", dp=1, micro_batch=2),
                  S("llm", trainable=True, dp=2, micro_batch=2)],
                 [Edge(src="vision", dst="llm", tensors=("patches",))])
    samples = [SampleMeta(id=i, row=i, modalities=IMAGE if i in (1, 2, 5, 6, 7) else TEXT) for i in range(8)]
    plan = plan_of(p, samples)
    assert plan.describe() == (
        "step 0 (fifo)\n"
        "vision[0]: [1,5] [2,6] [7]\n"
        "llm[0]: [0,1] [2,3]\n"
        "llm[1]: [4,5] [6,7]"
    )
    check_plan(SectionGraph(p), samples, plan)


def test_empty_replicas_and_empty_batch():
    """2 samples on a dp=4 section: two replicas get nothing (shown as "-"); zero samples: all empty."""
    p = pipeline([S("lm", trainable=True, dp=4, micro_batch=2)], [])
    assert plan_of(p, text_samples([5, 6])).describe() == "step 0 (fifo)\nlm[0]: [5]\nlm[1]: -\nlm[2]: [6]\nlm[3]: -"
    assert plan_of(p, []).describe() == "step 0 (fifo)\nlm[0]: -\nlm[1]: -\nlm[2]: -\nlm[3]: -"


def test_plan_json_has_the_design_shape():
    p = pipeline([S("teacher", dp=1, micro_batch=4), S("student", trainable=True, dp=2, micro_batch=2)],
                 [Edge(src="teacher", dst="student", tensors=("hidden",))])
    d = plan_of(p, text_samples(range(4))).to_json_dict()
    assert d["schedule"] == "fifo"
    assert d["sections"] == {"teacher": {"replicas": [[[0, 1, 2, 3]]]},
                             "student": {"replicas": [[[0, 1]], [[2, 3]]]}}
    assert isinstance(d["simulated"], dict)


def test_unknown_schedules_are_refused():
    g = SectionGraph(pipeline([S("a")], []))
    with pytest.raises(PipelineError, match="schedule must be one of fifo, wavefront, got 'lifo'"):
        make_planner("lifo", g)


# -- random graphs -------------------------------------------------------------------------


def draw_tree(draw) -> tuple[int, list[int], list[int]]:
    """A chain, star or tree of 2-4 sections: (count, parent of each, dp of each), every dp a
    multiple or divisor of its parent's (shared with test_simulate.py)."""
    n = draw(st.integers(2, 4))
    shape = draw(st.sampled_from(("chain", "star", "tree")))
    parents = [-1] + [i - 1 if shape == "chain" else 0 if shape == "star" else draw(st.integers(0, i - 1))
                      for i in range(1, n)]
    dps = [draw(st.sampled_from((1, 2, 3, 4)))]
    for i in range(1, n):
        d = dps[parents[i]]
        options = sorted({d, 2 * d, 3 * d} | {d // f for f in (2, 3) if d % f == 0})
        dps.append(draw(st.sampled_from([x for x in options if x <= 8])))
    return n, parents, dps


@st.composite
def pipelines(draw) -> Pipeline:
    """A chain, star or tree of 2-4 sections; each dp a multiple or divisor of its parent's."""
    n, parents, dps = draw_tree(draw)
    sections = [S(f"s{i}", dp=dps[i], micro_batch=draw(st.integers(1, 6)),
                  activates_on=draw(st.sampled_from((None, *MODALITIES)))) for i in range(n)]
    edges = []
    for i in range(1, n):
        a, b = (parents[i], i) if draw(st.booleans()) else (i, parents[i])
        edges.append(Edge(src=f"s{a}", dst=f"s{b}", tensors=(f"t{a}{b}",)))
    return pipeline(sections, edges)


@st.composite
def batches(draw) -> list[SampleMeta]:
    """0-64 samples with distinct ids (not in row order) and random non-empty modality sets."""
    n = draw(st.integers(0, 64))
    rnd = draw(st.randoms(use_true_random=False))  # one draw per batch keeps generation cheap
    ids = rnd.sample(range(10**6), n)
    mods = [frozenset(m for i, m in enumerate(MODALITIES) if mask >> i & 1) for mask in
            (rnd.randint(1, 7) for _ in range(n))]
    return [SampleMeta(id=i, row=k, modalities=m, num_tokens=k % 7)
            for k, (i, m) in enumerate(zip(ids, mods, strict=True))]


@pytest.mark.parametrize("schedule", ["fifo", "wavefront"])
@settings(max_examples=150, deadline=None, database=None)
@given(p=pipelines(), samples=batches())
def test_every_plan_satisfies_the_invariants(schedule, p, samples):
    graph = SectionGraph(p)
    check_plan(graph, samples, make_planner(schedule, graph).plan(3, samples))


@settings(max_examples=80, deadline=None, database=None)
@given(p=pipelines(), samples=batches())
def test_fifo_fills_micro_batches_and_balances_the_anchor(p, samples):
    """FIFO specifics: micro-batches are full except each replica's last, and the anchor (largest
    dp, latest in topological order on ties) gets count-balanced contiguous blocks of its samples."""
    graph = SectionGraph(p)
    plan = make_planner("fifo", graph).plan(0, samples)
    for name, section in graph.sections.items():
        for mbs in plan.replicas[name]:
            count = sum(len(mb) for mb in mbs)
            assert len(mbs) == math.ceil(count / section.micro_batch)
    anchor = max(graph.order, key=lambda n: (graph.sections[n].dp, graph.order.index(n)))
    loads = [sum(len(mb) for mb in rep) for rep in plan.replicas[anchor]]
    assert max(loads) - min(loads) <= 1
    active = [s.id for s in samples if graph.sections[anchor].activates(s.modalities)]
    in_replica_order = [sid for rep in plan.replicas[anchor] for mb in rep for sid in mb]
    assert in_replica_order == active


@pytest.mark.parametrize("schedule", ["fifo", "wavefront"])
@settings(max_examples=50, deadline=None, database=None)
@given(p=pipelines(), samples=batches(), seeds=st.lists(st.integers(0, 2**32 - 1), min_size=3, max_size=3))
def test_same_input_same_plan(schedule, p, samples, seeds):
    """Under several seeds of sample order: equal input -> equal plan, from fresh planners and a
    pipeline rebuilt from its plain-data form (what workers and a restarted coordinator hold)."""
    for seed in seeds:
        order = list(samples)
        random.Random(seed).shuffle(order)
        first = make_planner(schedule, SectionGraph(p)).plan(1, order)
        again = make_planner(schedule, SectionGraph(Pipeline.from_dict(p.to_dict()))).plan(1, list(order))
        assert first == again
        assert first.describe() == again.describe() and first.to_json_dict() == again.to_json_dict()
        check_plan(SectionGraph(p), order, first)


def test_drawn_case_is_the_same_under_several_seeds():
    """The fan-out case planned on many shuffles: each shuffle twice gives the same plan, and
    every plan sends the students the same counts (8 each) in micro-batches of 2."""
    p = pipeline([S("teacher", dp=1, micro_batch=8), S("student", trainable=True, dp=2, micro_batch=2)],
                 [Edge(src="teacher", dst="student", tensors=("hidden",))])
    for seed in range(10):
        samples = text_samples(range(16))
        random.Random(seed).shuffle(samples)
        plan = plan_of(p, samples)
        assert plan == plan_of(p, list(samples))
        assert [[len(mb) for mb in rep] for rep in plan.replicas["student"]] == [[2, 2, 2, 2], [2, 2, 2, 2]]
        check_plan(SectionGraph(p), samples, plan)


def test_a_padded_consumer_keeps_its_producers_send_order():
    """A student behind a teacher takes the teacher's outputs in the order they were sent; the
    wavefront's split of a padded micro-batch re-sorted it by length (student [1] [2,3] [0] for
    teacher [1] [0] [2] [3])."""
    p = Pipeline(name="p", data=ArrowData(path="d"), plan_search=0.0, sections=[
        Section(name="teacher", stage="x:T", micro_batch=1, trainable=False, cost=Cost(per_patch_s=1e-5, padded=True)),
        Section(name="student", stage="x:S", micro_batch=3, cost=Cost(per_token_s=1e-5, padded=True))],
        edges=[Edge(src="teacher", dst="student", tensors=("h",))])
    graph = SectionGraph(p)
    samples = [SampleMeta(id=i, row=i, num_tokens=t, num_patches=q)
               for i, (t, q) in enumerate([(1000, 1000), (1000, 10), (1, 1000), (1, 1000)])]
    plan = make_planner("wavefront", graph).plan(0, samples)
    assert len(plan.replicas["student"][0]) > 1  # the split happened
    check_pair_order(graph, plan)
