"""planner/regroup.py: a padding LLM's micro-batches regrouped by length behind one encoder,
with the encoder's send order kept (both ends agree), the run-ahead gates' counts kept, and no
simulated step made longer."""

from __future__ import annotations

import itertools
import random

from maestro_flow import ArrowData, Cost, Edge, Pipeline, Section
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import wavefront
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.regroup import pairs, regroup
from maestro_flow.planner.simulate import simulate
from maestro_flow.planner.wavefront import WavefrontPlanner
from maestro_flow.samples import SampleMeta
from tests.unit.test_planner import check_plan

TEXT, IMAGE = frozenset({"text"}), frozenset({"text", "image"})


def vlm(vision_dp: int = 1, llm_dp: int = 1, padded: bool = True) -> SectionGraph:
    return SectionGraph(Pipeline(
        name="v", data=ArrowData(path="d"), global_batch=24, schedule="wavefront",
        sections=[Section(name="vision", stage="x:V", activates_on="image", dp=vision_dp, micro_batch=8,
                          cost=Cost(per_sample_s=5e-4, per_patch_s=2e-5, per_micro_batch_s=2e-3, padded=True)),
                  Section(name="llm", stage="x:L", dp=llm_dp, micro_batch=4,
                          cost=Cost(per_sample_s=1e-4, per_token_s=1e-5, per_patch_s=1e-5, per_micro_batch_s=1e-3,
                                    padded=padded))],
        edges=[Edge(src="vision", dst="llm", tensors=("image_embeds",))]))


def draw(rng: random.Random, n: int = 24, share: float = 0.33) -> list[SampleMeta]:
    out = []
    for i in range(n):
        image = rng.random() < share
        out.append(SampleMeta(id=i, row=i, modalities=IMAGE if image else TEXT, num_tokens=rng.randrange(20, 120),
                              num_patches=rng.randrange(1, 65) if image else 0))
    return out


def padded_positions(mbs, size) -> int:
    return sum(len(mb) * max(size[s] for s in mb) for rep in mbs for mb in rep)


def gated_counts(plan) -> dict:
    """Per encoder micro-batch and gate (llm replica, j): how many of that encoder replica's
    samples the llm replica's first j micro-batches hold, what the gate's credit counts."""
    out = {}
    for pr, rep in enumerate(plan.replicas["vision"]):
        mine = {sid for mb in rep for sid in mb}
        for k, gate in enumerate(plan.gates["vision"][pr]):
            for _, cr, j in gate:
                out[(pr, k, cr, j)] = sum(sid in mine for mb in plan.replicas["llm"][cr][:j] for sid in mb)
    return out


def test_an_encoder_micro_batch_reaches_the_llm_longest_first_and_the_llm_sorts_what_it_holds():
    """Eight images in one encoder micro-batch, taken by two LLM micro-batches in the encoder's
    order (what the ordering did, RESULTS 11.2), then a text micro-batch: the encoder now sends
    them longest first, the LLM's two image micro-batches get the four longest and the four
    shortest, and with wide runs the text after them joins the sort."""
    graph = vlm()
    length = {0: 50, 1: 90, 2: 30, 3: 80, 4: 40, 5: 70, 6: 60, 7: 20, 8: 100, 9: 10, 10: 55, 11: 35}
    fwd = {"vision": {sid: 1.0 for sid in length}, "llm": {sid: float(v) for sid, v in length.items()}}
    mbs = {"vision": (((0, 1, 2, 3, 4, 5, 6, 7),),), "llm": (((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)),)}
    routes = {n: dict.fromkeys(length, 0) for n in mbs}
    padded = {"vision": True, "llm": True}
    assert pairs(graph, ["vision", "llm"], padded) == [("vision", "llm")]
    narrow = regroup(graph, ["vision", "llm"], mbs, routes, fwd, padded, {})
    assert narrow["vision"] == (((1, 3, 5, 6, 0, 4, 2, 7),),)
    assert narrow["llm"] == (((1, 3, 5, 6), (0, 4, 2, 7), (8, 9, 10, 11)),)
    wide = regroup(graph, ["vision", "llm"], mbs, routes, fwd, padded, {}, wide=True)
    assert wide["vision"] == narrow["vision"]
    assert wide["llm"] == (((8, 1, 3, 5), (6, 10, 0, 4), (11, 2, 7, 9)),)  # images keep their send order
    size = {sid: v for sid, v in length.items()}
    assert padded_positions(wide["llm"], size) < padded_positions(narrow["llm"], size) \
        < padded_positions(mbs["llm"], size)
    assert regroup(graph, ["vision", "llm"], narrow, routes, fwd, padded, {}) is None  # nothing left to sort
    assert pairs(vlm(padded=False), ["vision", "llm"], {"vision": True, "llm": False}) == []  # no padding, no gain

    # A run-ahead gate counting the LLM's first two micro-batches (some encoder micro-batch waits
    # for them): no run spans that boundary, so the encoder's samples in those two stay counted.
    gated = regroup(graph, ["vision", "llm"], mbs, routes, fwd, padded, {"vision": (((("llm", 0, 2),),),)},
                    wide=True)
    assert gated["llm"] == narrow["llm"]
    # Two encoder micro-batches feed the first LLM micro-batch: no run starts there (the second
    # encoder micro-batch may end after the first LLM micro-batch could start); one starts at
    # the second LLM micro-batch, which takes the second encoder micro-batch's samples alone.
    two = {"vision": (((0, 1), (2, 3, 4, 5, 6, 7)),), "llm": (((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)),)}
    moved = regroup(graph, ["vision", "llm"], two, routes, fwd, padded, {}, wide=True)
    assert moved["vision"] == (((1, 0), (3, 5, 6, 4, 2, 7)),)  # each longest first
    assert moved["llm"] == (((1, 0, 3, 5), (8, 6, 10, 4), (11, 2, 7, 9)),)  # send order kept


def test_a_run_is_sorted_only_where_that_pads_less():
    """Unequal sizes (found in review): three short samples and a long one as (3 samples, 1
    sample) pad 13 positions; sent longest first, the long one would pad the three (31
    positions), so the pair keeps its order."""
    graph = vlm()
    length = {0: 1, 1: 1, 2: 1, 3: 10}
    fwd = {"vision": dict.fromkeys(length, 1.0), "llm": {sid: float(v) for sid, v in length.items()}}
    mbs = {"vision": (((0, 1, 2, 3),),), "llm": (((0, 1, 2), (3,)),)}
    out = regroup(graph, ["vision", "llm"], mbs, {n: dict.fromkeys(length, 0) for n in mbs}, fwd,
                  {"vision": True, "llm": True}, {})
    assert out is None  # in the new send order the long one would lead the three: 31 positions


def test_wavefront_plans_keep_every_invariant_and_pad_the_llm_less(monkeypatch):
    """Drawn VLM batches at 33% images, several layouts: every plan keeps the planners' invariants
    (both ends of each pair agree on the order, nothing waits in a circle), and over the draws the
    LLM's padded positions fall against the same planner without the regrouping (which it
    replaced only where simulation found the step no longer)."""
    rng = random.Random(0)
    regrouped = total = gated = 0
    for (vision_dp, llm_dp), run_ahead in itertools.product(((1, 1), (1, 2), (2, 2), (2, 1)), (None, 1)):
        graph = vlm(vision_dp, llm_dp)
        costs = CostModel(costs={s.name: s.cost for s in graph.pipeline.sections})
        for step in range(8):
            samples = draw(rng)
            size = {s.id: s.num_tokens + s.num_patches for s in samples}
            plan = WavefrontPlanner(graph, costs, run_ahead=run_ahead, search=0.0).plan(step, samples)
            check_plan(graph, samples, plan)
            with monkeypatch.context() as m:
                m.setattr(wavefront, "regroup", lambda *args, **kw: None)
                before = WavefrontPlanner(graph, costs, run_ahead=run_ahead, search=0.0).plan(step, samples)
            assert simulate(plan, graph, costs).makespan_s <= simulate(before, graph, costs).makespan_s * (1 + 1e-9)
            assert plan.gates == before.gates and gated_counts(plan) == gated_counts(before)
            gated += any(gated_counts(plan).values())
            assert plan.variant == before.variant or plan.variant == f"regrouped {before.variant}"
            now, then = padded_positions(plan.replicas["llm"], size), padded_positions(before.replicas["llm"], size)
            regrouped += now < then
            total += then - now
    assert regrouped >= 8 and total > 0 and gated >= 8
