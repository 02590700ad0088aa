"""The wavefront's orderings (maestro_flow/planner/ordering.py) simulate exactly what simulate.py does.

The wavefront planner plays out several sets of rules and keeps the order whose simulated step
ends first, using the makespan its own event simulation reached while deciding. That is only a
fair choice if that number is simulate.py's makespan of the recorded plan: checked here for every
candidate, on random graphs (hypothesis: chains, stars and trees of 2-4 sections, random
trainable flags, activations, costs and transfer times) and on vision -> LLM layouts. Then the
choice itself: the planner's plan is never slower in simulation than any candidate alone, nor
than FIFO, and a plan of FIFO's order still honours the run-ahead credit.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maestro_flow.graph import SectionGraph
from maestro_flow.planner import make_planner
from maestro_flow.planner.rules import CANDIDATES, Rules
from maestro_flow.planner.simulate import simulate
from maestro_flow.planner.wavefront import CANDIDATE_BUDGET, WavefrontPlanner
from tests.unit.test_simulate import batches, check_simulation, costs_of, trained_pipelines
from tests.unit.test_wavefront import mix, vlm
from tools.bench import wavefront_sim as bench

EPS = 1e-9


@settings(max_examples=60, deadline=None, database=None)
@given(p=trained_pipelines(), samples=batches(), transfer_s=st.sampled_from((0.0, 2e-4, 0.05, 0.5)),
       rules=st.sampled_from(CANDIDATES), padded=st.booleans())
def test_every_ordering_simulates_to_its_makespan(p, samples, transfer_s, rules, padded):
    graph = SectionGraph(p)
    costs = costs_of(graph, transfer_s, padded)
    plan, makespan = WavefrontPlanner(graph, costs).plan_with(0, samples, rules)
    sim = simulate(plan, graph, costs)
    check_simulation(graph, costs, plan, sim)
    assert makespan == pytest.approx(sim.makespan_s, abs=EPS)


@pytest.mark.parametrize("rules", CANDIDATES, ids=[r.name for r in CANDIDATES])
@pytest.mark.parametrize(("vision_dp", "llm_dp", "trainable", "padded"),
                         [(1, 4, True, False), (2, 4, True, True), (2, 8, False, False), (1, 2, True, True)])
def test_vlm_orderings_simulate_to_their_makespan(rules, vision_dp, llm_dp, trainable, padded):
    graph = vlm(vision_dp, trainable, llm_dp=llm_dp)
    costs = costs_of(graph, 2e-4, padded)
    for seed, share in ((0, 0.1), (1, 0.5), (2, 0.9)):
        plan, makespan = WavefrontPlanner(graph, costs).plan_with(0, mix(seed, share, 96), rules)
        assert makespan == pytest.approx(simulate(plan, graph, costs).makespan_s, abs=EPS)


@settings(max_examples=40, deadline=None, database=None)
@given(p=trained_pipelines(), samples=batches(), transfer_s=st.sampled_from((0.0, 2e-4, 0.05)),
       padded=st.booleans())
def test_the_plan_is_the_best_candidate_and_never_slower_than_fifo(p, samples, transfer_s, padded):
    graph = SectionGraph(p)
    costs = costs_of(graph, transfer_s, padded)
    planner = WavefrontPlanner(graph, costs)
    plan = planner.plan(0, samples)
    sim = simulate(plan, graph, costs)
    check_simulation(graph, costs, plan, sim)
    assert len(samples) * len(CANDIDATES) <= CANDIDATE_BUDGET  # small batches try every candidate
    for rules in CANDIDATES:
        assert sim.makespan_s <= simulate(planner.plan_with(0, samples, rules)[0], graph, costs).makespan_s + EPS
    fifo = simulate(make_planner("fifo", graph, costs).plan(0, samples), graph, costs)
    assert sim.makespan_s <= fifo.makespan_s + EPS


def test_budget_limits_the_candidates_of_a_large_batch():
    graph = vlm(2, True)
    planner = WavefrontPlanner(graph, costs_of(graph))
    assert planner.tried(256) == CANDIDATES
    assert planner.tried(4096) == CANDIDATES[:2]
    assert planner.tried(10**6) == CANDIDATES[:1]


def test_rules_refuse_unknown_choices():
    for bad in (dict(balance="time"), dict(serve="random"), dict(fill="random"), dict(taper=-1.0)):
        with pytest.raises(ValueError, match="Rules"):
            Rules(name="bad", **bad).validate()


def test_a_padding_stage_splits_a_micro_batch_where_padding_costs_more_than_a_micro_batch():
    """One loss section, 8 samples of lengths 100, 90, 10 x 6 in one micro-batch of 8: whole it
    costs fixed + 8 x 100; in two pieces (the 6 short ones, then the 2 long ones) 2 x fixed +
    6 x 10 + 2 x 100; in three (the long ones apart) 3 x fixed + 6 x 10 + 90 + 100. The planner
    takes the cheapest: three at fixed 1, two at fixed 20, one when the fixed cost outweighs the
    padding (fixed 1000), and one without padding."""
    from maestro_flow.config import ArrowData, Cost, Pipeline, Section
    from maestro_flow.planner.cost import CostModel
    from maestro_flow.samples import SampleMeta

    samples = [SampleMeta(id=i, num_tokens=n) for i, n in enumerate((100, 10, 90, 10, 10, 10, 10, 10))]
    for fixed, padded, want in ((1.0, True, [[1, 3, 4, 5, 6, 7], [2], [0]]), (20.0, True, [[1, 3, 4, 5, 6, 7], [2, 0]]),
                                (1000.0, True, None), (1.0, False, None)):
        cost = Cost(per_sample_s=0.0, per_token_s=1.0, per_micro_batch_s=fixed, padded=padded)
        graph = SectionGraph(Pipeline(name="p", data=ArrowData(path="d"), global_batch=8,
                                      sections=[Section(name="lm", stage="m:L", micro_batch=8, cost=cost)]))
        costs = CostModel(costs={"lm": cost})
        plan, makespan = WavefrontPlanner(graph, costs).plan_with(0, samples, CANDIDATES[0])
        got = [list(mb) for mb in plan.replicas["lm"][0]]
        if want is None:
            assert len(got) == 1 and sorted(got[0]) == list(range(8))
        else:
            assert got == want
        assert makespan == pytest.approx(simulate(plan, graph, costs).makespan_s)
    assert makespan == pytest.approx((1.0 + 250.0) * 3.0)  # unpadded: one micro-batch, backward 2x


def _two_sections(trainable: bool, mb_vision: int, mb_llm: int):
    """vision -> llm (tools/bench/wavefront_sim.build) with round costs: an image's forward is
    1 ms + 1 ms per patch, the LLM's 1 ms per token, backward 2x; transfers 0.2 ms."""
    from maestro_flow.config import Cost

    vision = Cost(per_sample_s=1e-3, per_patch_s=1e-3, backward_factor=2.0)
    llm = Cost(per_sample_s=0.0, per_token_s=1e-3, backward_factor=2.0)
    return bench.build(1, 1, trainable, llm, vision=vision, mb_vision=mb_vision, mb_llm=mb_llm)


def test_gap_runs_short_text_before_an_arrival_instead_of_a_long_one():
    """One image (its forward ends at 5 ms, it arrives at 5.2) and three texts, of 300, 1 and 1
    tokens, on one LLM replica of micro-batch 1 behind a trainable encoder. Longest-first fills
    the wait with the long text, so the image's gradient and the encoder's backward come last.
    `gap` runs a short text (3 ms of LLM work: it fits the 5.2 ms), then, with 2.2 ms left and no
    free sample that fits, the shortest (the other short one), then the image, and the encoder's
    backward hides behind the long text."""
    from maestro_flow.samples import SampleMeta

    graph, costs = _two_sections(True, 1, 1)
    samples = [SampleMeta(id=0, modalities=frozenset({"text", "image"}), num_tokens=10, num_patches=4),
               SampleMeta(id=1, num_tokens=300), SampleMeta(id=2, num_tokens=1), SampleMeta(id=3, num_tokens=1)]
    plain = Rules(name="plain", fill="longest")
    gap = Rules(name="gap", fill="longest", gap=True)
    planner = WavefrontPlanner(graph, costs)
    (plan_plain, span_plain), (plan_gap, span_gap) = (planner.plan_with(0, samples, r) for r in (plain, gap))
    assert plan_plain.replicas["llm"][0][0] == (1,)
    assert plan_gap.replicas["llm"][0] == ((2,), (3,), (0,), (1,))
    assert span_gap < span_plain
    assert span_gap == pytest.approx(simulate(plan_gap, graph, costs).makespan_s)
    # The LLM never waits: its work (forward + backward of 312 tokens) ends the step, and the
    # encoder's backward (10 ms) hid behind the long text.
    assert span_gap == pytest.approx(3 * 1e-3 * (10 + 300 + 1 + 1), rel=1e-6)


def test_prompt_cuts_a_producer_micro_batch_a_hungry_consumer_would_wait_for():
    """A frozen encoder of micro-batch 8 feeding one LLM replica that has nothing else to do: as
    one micro-batch, the LLM waits for all 8 forwards; with `prompt` the encoder's first
    micro-batch stops at one image (the LLM holds no work yet), the next ones grow with the
    LLM's buffer, and the step is shorter."""
    from maestro_flow.samples import SampleMeta

    graph, costs = _two_sections(False, 8, 1)
    samples = [SampleMeta(id=i, modalities=frozenset({"text", "image"}), num_tokens=4, num_patches=9)
               for i in range(8)]
    planner = WavefrontPlanner(graph, costs)
    plain, span_plain = planner.plan_with(0, samples, Rules(name="plain"))
    prompt, span_prompt = planner.plan_with(0, samples, Rules(name="prompt", prompt=True))
    assert [len(mb) for mb in plain.replicas["vision"][0]] == [8]
    sizes = [len(mb) for mb in prompt.replicas["vision"][0]]
    assert sizes[0] == 1 and len(sizes) > 1 and sum(sizes) == 8
    assert span_prompt < span_plain
    assert span_prompt == pytest.approx(simulate(prompt, graph, costs).makespan_s)
