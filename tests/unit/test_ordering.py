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

EPS = 1e-9


@settings(max_examples=60, deadline=None, database=None)
@given(p=trained_pipelines(), samples=batches(), transfer_s=st.sampled_from((0.0, 2e-4, 0.05, 0.5)),
       rules=st.sampled_from(CANDIDATES))
def test_every_ordering_simulates_to_its_makespan(p, samples, transfer_s, rules):
    graph = SectionGraph(p)
    costs = costs_of(graph, transfer_s)
    plan, makespan = WavefrontPlanner(graph, costs).plan_with(0, samples, rules)
    sim = simulate(plan, graph, costs)
    check_simulation(graph, costs, plan, sim)
    assert makespan == pytest.approx(sim.makespan_s, abs=EPS)


@pytest.mark.parametrize("rules", CANDIDATES, ids=[r.name for r in CANDIDATES])
@pytest.mark.parametrize(("vision_dp", "llm_dp", "trainable"), [(1, 4, True), (2, 4, True), (2, 8, False), (1, 2, True)])
def test_vlm_orderings_simulate_to_their_makespan(rules, vision_dp, llm_dp, trainable):
    graph = vlm(vision_dp, trainable, llm_dp=llm_dp)
    costs = costs_of(graph, 2e-4)
    for seed, share in ((0, 0.1), (1, 0.5), (2, 0.9)):
        plan, makespan = WavefrontPlanner(graph, costs).plan_with(0, mix(seed, share, 96), rules)
        assert makespan == pytest.approx(simulate(plan, graph, costs).makespan_s, abs=EPS)


@settings(max_examples=40, deadline=None, database=None)
@given(p=trained_pipelines(), samples=batches(), transfer_s=st.sampled_from((0.0, 2e-4, 0.05)))
def test_the_plan_is_the_best_candidate_and_never_slower_than_fifo(p, samples, transfer_s):
    graph = SectionGraph(p)
    costs = costs_of(graph, transfer_s)
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
