"""The wavefront planner's local search (planner/refine.py): it only ever shortens the rules'
plan, exactly as simulate.py times it, keeps every plan invariant and the run-ahead credit, stays
within its budget and is deterministic."""

from __future__ import annotations

import dataclasses
import random
from unittest import mock

import pytest
from hypothesis import given, settings

from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import CostModel, refine
from maestro_flow.planner.regroup import sent_order
from maestro_flow.planner.simulate import replay, simulate
from maestro_flow.planner.wavefront import WavefrontPlanner
from tests.unit.test_planner import batches, check_plan, pipelines
from tests.unit.test_wavefront import run_with_credits
from tools.bench import wavefront_sim as bench


@pytest.fixture(scope="module")
def issue_case():
    """The issue's case (vision dp 2 -> llm dp 4, trainable, micro-batches 2 / 4, 80% images) on
    the 128-sample draw that every rule set leaves 12.7% over the lower bound."""
    graph, costs = bench.build(2, 4, True, bench.llm_cost(), mb_vision=2, mb_llm=4)
    return graph, costs, bench.draw_samples(128, 0.8, 2)


def test_the_search_shortens_the_rules_plan_exactly_as_simulated(issue_case):
    graph, costs, samples = issue_case
    rules = WavefrontPlanner(graph, costs, search=0.0)
    searched = WavefrontPlanner(graph, costs)  # the pipeline's plan_search
    assert searched.search == graph.pipeline.plan_search > 0
    before = simulate(rules.plan(0, samples), graph, costs)
    plan, span = searched._plan(0, samples, searched.tried(len(samples)), True, searched.search)
    after = simulate(plan, graph, costs)
    assert plan.variant.startswith("refined ") and not rules.plan(0, samples).variant.startswith("refined")
    assert after.makespan_s == span  # the planner's own figure is the simulation's, exactly
    assert before.makespan_s > 1.12 * before.lower_bound_s
    assert after.makespan_s <= 1.05 * after.lower_bound_s, after.makespan_s / after.lower_bound_s
    check_plan(graph, samples, plan)  # routes keep every edge's fan-out blocks; each sample once


def test_a_searched_plan_keeps_the_run_ahead_credit(issue_case):
    graph, costs, samples = issue_case
    for run_ahead in (4, None):
        k = run_ahead or max(4 * graph.sections["llm"].micro_batch, 16)
        plan = WavefrontPlanner(graph, costs, run_ahead=run_ahead).plan(0, samples)
        assert plan.variant.startswith("refined ")
        peak, makespan = run_with_credits(plan, graph, costs, k)
        assert max(peak) <= k + graph.sections["vision"].micro_batch, (run_ahead, peak)
        assert makespan <= simulate(plan, graph, costs).makespan_s * (1 + 1e-9)


def test_the_search_is_deterministic(issue_case):
    graph, costs, samples = issue_case
    first = WavefrontPlanner(graph, costs).plan(3, samples)
    assert first.variant.startswith("refined ")
    assert first == WavefrontPlanner(graph, costs).plan(3, list(samples))


def test_the_budget_follows_the_share_of_the_planned_step():
    assert refine.evals_allowed(1.0, 200, 128, 0.0) == 0
    assert refine.evals_allowed(0.0, 200, 128, 0.1) == 0
    small, large = refine.evals_allowed(0.05, 20, 16, 0.1), refine.evals_allowed(1.0, 200, 128, 0.1)
    assert 0 < small < large <= refine.MAX_EVALS
    # What the budget lets it simulate costs at most the share, at the modelled cost per candidate.
    assert large * (refine.EVAL_FIXED_S + 200 * refine.EVAL_TASK_S + 128 * refine.EVAL_PLACED_S) <= 0.1 * 1.0
    assert refine.evals_allowed(1.0, 200, 512, 0.1) < large  # more samples to walk: fewer candidates
    assert refine.evals_allowed(1e6, 200, 128, 1.0) == refine.MAX_EVALS


def test_a_pruned_simulation_stops_only_past_its_limit(issue_case):
    """replay(limit=...) gives up on a plan only once it cannot end by the limit: the search's
    rejected candidates are the ones it would have rejected after the whole simulation."""
    graph, costs, _ = issue_case
    rules = WavefrontPlanner(graph, costs, search=0.0)
    for seed in range(6):  # draws whose remaining seconds round either way
        plan = rules.plan(0, bench.draw_samples(128, 0.8, seed))
        whole = replay(plan, graph, costs)
        ends_at = replay(plan, graph, costs, limit=whole.makespan_s)  # ending exactly at the limit is no reason
        assert ends_at is not None and ends_at.tasks == whole.tasks, seed
        assert replay(plan, graph, costs, limit=whole.makespan_s * (1 - 1e-9)) is None, seed
        assert replay(plan, graph, costs, limit=whole.makespan_s * 0.5) is None, seed


def test_samples_trade_places_everywhere_across_fan_out_blocks(issue_case):
    """With vision dp 2 -> llm dp 4 each encoder replica feeds its own two LLM replicas, so an
    image cannot change encoder replica alone: two images trade places in both sections, and the
    plan stays valid (each edge's blocks, each sample once, the send order)."""
    graph, costs, samples = issue_case
    plan = WavefrontPlanner(graph, costs, search=0.0).plan(0, samples)
    search = refine._Search(graph, costs, list(graph.order), "llm", 16, samples)
    a = plan.replicas["vision"][0][0][0]
    b = plan.replicas["vision"][1][-1][-1]
    assert not search.routable(plan.routes, "vision", a, 1)  # its LLM replica is in the other block
    replicas, routes, changed = search._swap_everywhere(plan, a, b)
    assert changed == {"vision", "llm"}
    assert routes["vision"][a] == 1 and routes["vision"][b] == 0
    assert (routes["llm"][a], routes["llm"][b]) == (plan.routes["llm"][b], plan.routes["llm"][a])
    replicas["llm"] = sent_order(replicas["vision"], replicas["llm"], search.takes["vision"], search.takes["llm"],
                                 routes["vision"], routes["llm"])
    check_plan(graph, samples, search.gated(dataclasses.replace(plan, replicas=replicas, routes=routes)))
    text = next(s.id for s in samples if "image" not in s.modalities)
    assert search._swap_everywhere(plan, a, text) is None  # not taken by the same sections


def test_a_sample_moves_to_another_replica(issue_case):
    """One sample leaves its LLM replica for another (its load changes by that sample alone):
    the plan stays valid (routes, micro-batch sizes, send order); a move that breaks an edge's
    blocks or would empty the replica is refused."""
    graph, costs, samples = issue_case
    plan = WavefrontPlanner(graph, costs, search=0.0).plan(0, samples)
    search = refine._Search(graph, costs, list(graph.order), "llm", 16, samples)
    rng = random.Random(0)
    reps = [list(map(list, mbs)) for mbs in plan.replicas["llm"]]
    src = next(r for r in range(4) if plan.routes["llm"][reps[r][0][0]] == r and
               search.routable(plan.routes, "llm", reps[r][0][0], r ^ 1))
    sid = reps[src][0][0]
    routes = search._move(reps[src], reps[src ^ 1], reps[src][0], 0, plan.routes, "llm", src, src ^ 1, 4, rng)
    assert routes is not None and routes["llm"][sid] == src ^ 1
    assert sid in [x for mb in reps[src ^ 1] for x in mb] and sid not in [x for mb in reps[src] for x in mb]
    assert all(len(mb) <= 4 for mb in reps[src ^ 1])
    replicas = {**plan.replicas, "llm": tuple(tuple(tuple(mb) for mb in rep if mb) for rep in reps)}
    replicas["llm"] = sent_order(replicas["vision"], replicas["llm"], search.takes["vision"], search.takes["llm"],
                                 routes["vision"], routes["llm"])
    check_plan(graph, samples, search.gated(dataclasses.replace(plan, replicas=replicas, routes=routes)))
    # An image's LLM replica must be one its encoder replica feeds (vision dp 2 -> llm dp 4).
    image = next(s.id for s in samples if "image" in s.modalities)
    here = plan.routes["llm"][image]
    away = next(r for r in range(4) if r not in graph.edges[0].consumers_of(plan.routes["vision"][image]))
    mbs = [list(map(list, rep)) for rep in plan.replicas["llm"]]
    mb = next(mb for mb in mbs[here] if image in mb)
    assert search._move(mbs[here], mbs[away], mb, mb.index(image), plan.routes, "llm", here, away, 4, rng) is None
    assert search._move([[sid]], [[]], [sid], 0, routes, "llm", src ^ 1, src, 4, rng) is None  # would empty it


def test_no_search_near_the_bound_nor_without_a_share(issue_case):
    graph, costs, samples = issue_case
    planner = WavefrontPlanner(graph, costs, search=0.0)
    plan = planner.plan(0, samples)
    sim = simulate(plan, graph, costs)
    comp = list(graph.order)
    start = dataclasses.replace(plan, step=0)
    args = (graph, costs, comp, start)
    # Within ABOVE of the bound: nothing to gain worth the time.
    assert refine.refine(*args, sim.makespan_s, sim.makespan_s / (1 + refine.ABOVE / 2), "llm", 16, 1.0, 0) is None
    # No share of the step: no search at all.
    assert refine.refine(*args, sim.makespan_s, sim.lower_bound_s, "llm", 16, 0.0, 0) is None
    found = refine.refine(*args, sim.makespan_s, sim.lower_bound_s, "llm", 16, 0.1, 0)
    assert found is not None and found.makespan_s < sim.makespan_s
    placed = sum(len(mb) for n in comp for rep in plan.replicas[n] for mb in rep)
    assert 0 < found.evaluated <= refine.evals_allowed(sim.makespan_s, len(sim.tasks), placed, 0.1)


def test_a_large_batch_is_not_searched():
    """Past the batch size at which every rule set is played out, the planner keeps its 100 ms
    goal at 4096 samples: no search."""
    graph, costs = bench.build(2, 8, True, bench.llm_cost())
    planner = WavefrontPlanner(graph, costs, search=1.0)
    samples = bench.draw_samples(1536, 0.8, 2)
    assert len(planner.tried(len(samples))) < len(planner.candidates)
    assert not planner.plan(0, samples).variant.startswith("refined")


def test_plan_search_is_validated():
    graph, _ = bench.build(1, 2, True, bench.llm_cost())
    for bad in (-0.1, 1.5, "0.1", True):
        with pytest.raises(PipelineError, match="plan_search"):
            dataclasses.replace(graph.pipeline, plan_search=bad).validate()
    assert SectionGraph(dataclasses.replace(graph.pipeline, plan_search=0.0)).pipeline.plan_search == 0.0


@settings(max_examples=120, deadline=None, database=None)
@given(p=pipelines(), samples=batches())
def test_a_searched_plan_keeps_every_invariant_on_any_graph(p, samples):
    """Random graphs (chains, fan-in, fan-out, several producers, several components): with the
    search let loose (any plan above its bound searched, its budget not charged), every plan
    still satisfies the planner's invariants, is no longer than the rules' own, and its
    makespan is the simulation's."""
    graph = SectionGraph(p)
    rules = WavefrontPlanner(graph, CostModel(costs={n: s.cost for n, s in graph.sections.items()}), search=0.0)
    with mock.patch.multiple(refine, ABOVE=0.0, EVAL_FIXED_S=1e-12, EVAL_TASK_S=1e-12, EVAL_PLACED_S=1e-12,
                             MAX_EVALS=24, MIN_EVALS=1):
        searched = WavefrontPlanner(graph, rules.costs, search=1.0)
        plan, span = searched._plan(3, samples, searched.tried(len(samples)), True, 1.0)
    check_plan(graph, samples, plan)
    sim = simulate(plan, graph, rules.costs)
    assert sim.makespan_s == pytest.approx(span, rel=1e-12, abs=1e-12)
    assert sim.makespan_s <= simulate(rules.plan(3, samples), graph, rules.costs).makespan_s * (1 + 1e-12) + 1e-12
