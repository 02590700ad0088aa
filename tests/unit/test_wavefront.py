"""The wavefront planner (maestro_flow/planner/wavefront.py) against FIFO and the lower bound.

A drawn case first (the module docstring's: text keeps the LLM busy while the encoder works),
compared as `Plan.describe()` text. Then realistic vision -> LLM mixes (10-90% images, long-tailed
token counts, varying patch counts) over several seeds: the wavefront is never worse than FIFO,
close to the simulator's lower bound, and keeps an LLM-bound LLM busy. Then the worst cases of
issue 10 (trainable encoders, fan-out 1-8, small micro-batches): within 5% of the bound and
never slower than FIFO in every seed. Then the load balance of the critical section, the
run-ahead credit, a smoke bound on planning time, determinism and the plan's JSON form. Every
number comes from the cost model and simulate.py; nothing is timed except the planning-time
smoke bound.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import time
from collections import Counter

import pytest

from maestro_flow import ArrowData, Cost, Edge, Pipeline, Section
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import CostModel, Plan, make_planner
from maestro_flow.planner.simulate import Simulation, critical_section, simulate, task_s
from maestro_flow.planner.wavefront import WavefrontPlanner
from maestro_flow.samples import SampleMeta
from tests.unit.test_simulate import section_work
from tools.bench import wavefront_sim as bench

TEXT = frozenset({"text"})
IMAGE = frozenset({"text", "image"})
INF = float("inf")

# Forward seconds (a trainable section's backward is 2x): an image costs the encoder ~1-47 ms, a
# sample costs the LLM 2 ms + 20 us/token + 10 us/patch (patches enter the LLM as tokens).
VISION_COST = Cost(per_sample_s=1e-3, per_patch_s=2e-5, backward_factor=2.0)
LLM_COST = Cost(per_sample_s=2e-3, per_token_s=2e-5, per_patch_s=1e-5, backward_factor=2.0)


def S(name: str, **kw) -> Section:
    return Section(name=name, stage=f"stages.fake:{name.title()}", **{"trainable": False, **kw})


def vlm(vision_dp: int, trainable: bool, *, llm_dp: int = 4, vision_mb: int = 4,
        vision_cost: Cost = VISION_COST) -> SectionGraph:
    return SectionGraph(Pipeline(name="vlm", data=ArrowData(path="d"), sections=[
        S("vision", activates_on="image", trainable=trainable, dp=vision_dp, micro_batch=vision_mb, cost=vision_cost),
        S("llm", trainable=True, dp=llm_dp, micro_batch=4, cost=LLM_COST)],
        edges=[Edge(src="vision", dst="llm", tensors=("patches",))]))


def costs_of(graph: SectionGraph, transfer_s: float = 2e-4) -> CostModel:
    return CostModel(costs={n: s.cost for n, s in graph.sections.items()}, transfer_s=transfer_s)


def mix(seed: int, image_share: float, n: int) -> list[SampleMeta]:
    """n samples: tokens lognormal (median ~400, clipped 16..8192), an image with probability
    `image_share` carrying 64..2304 patches."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        tokens = min(8192, max(16, int(rnd.lognormvariate(6.0, 1.0))))
        if rnd.random() < image_share:
            out.append(SampleMeta(id=i, row=i, modalities=IMAGE, num_tokens=tokens,
                                  num_patches=rnd.choice((64, 256, 576, 1024, 2304))))
        else:
            out.append(SampleMeta(id=i, row=i, modalities=TEXT, num_tokens=tokens))
    return out


# -- the drawn case ------------------------------------------------------------------------


def test_text_keeps_the_llm_busy_while_the_encoder_works():
    """Image samples i1..i4 = ids 1-4 (encoder 1 s, LLM 2 s with backward), text t1..t4 = ids
    11-14 (LLM 1 s); vision dp=1 mb=1 (frozen) -> llm dp=1 mb=2; transfer 0.2 ms.

        time (s)    0   1   2   3   4   5   6   7   8   9  10  11  12
        vision[0]   |i1 |i2 |i3 |i4 |
        llm[0]      |t1,t2  |i1,t3      |i2,i3          |i4,t4      |

    The llm starts with text and never waits: busy 12 of 12 s, makespan = lower bound = its work.
    (The module docstring draws [i2,t4] [i3] [i4] for the tail; the consumer rule it states,
    "what has arrived first, oldest first", takes i2 and i3 together at 5 s, same makespan.)
    """
    graph = SectionGraph(Pipeline(name="p", data=ArrowData(path="d"), sections=[
        S("vision", activates_on="image", dp=1, micro_batch=1, cost=Cost(per_sample_s=1.0)),
        S("llm", trainable=True, dp=1, micro_batch=2,
          cost=Cost(per_sample_s=0.5, per_patch_s=0.5, backward_factor=1.0))],
        edges=[Edge(src="vision", dst="llm", tensors=("patches",))]))
    costs = costs_of(graph)
    samples = ([SampleMeta(id=i, row=i, modalities=IMAGE, num_patches=1) for i in (1, 2, 3, 4)]
               + [SampleMeta(id=i, row=i) for i in (11, 12, 13, 14)])
    for seed in range(5):  # the input order does not matter
        order = list(samples)
        random.Random(seed).shuffle(order)
        plan = make_planner("wavefront", graph, costs).plan(0, order)
        assert plan.describe() == ("step 0 (wavefront)\n"
                                   "vision[0]: [1] [2] [3] [4]\n"
                                   "llm[0]: [11,12] [1,13] [2,3] [4,14]")
        sim = simulate(plan, graph, costs)
        llm = sorted((t.start_s, t.end_s) for t in sim.tasks if t.section == "llm")
        assert llm[0][0] == 0.0 and all(a[1] == b[0] for a, b in zip(llm, llm[1:], strict=False))  # no gap
        assert (sim.makespan_s, sim.lower_bound_s, sim.critical_section) == (12.0, 12.0, "llm")
        assert sim.critical_busy_fraction == 1.0
    fifo = simulate(make_planner("fifo", graph, costs).plan(0, samples), graph, costs)
    assert fifo.makespan_s == pytest.approx(14.0002)  # FIFO waits for i1 first and ends on text


# -- realistic mixes -----------------------------------------------------------------------

SHARES = (0.1, 0.33, 0.5, 0.9)
SEEDS = range(5)
CASES = [(vdp, trainable, share) for vdp in (1, 2) for trainable in (False, True) for share in SHARES]


@functools.cache
def outcomes(vision_dp: int, trainable: bool, share: float) -> tuple[tuple[Simulation, Simulation, float], ...]:
    """Per seed: (wavefront simulation, FIFO simulation, the llm's work bound) on 256 samples."""
    graph = vlm(vision_dp, trainable)
    costs = costs_of(graph)
    out = []
    for seed in SEEDS:
        samples = mix(seed, share, 256)
        sims = [simulate(make_planner(s, graph, costs).plan(0, samples), graph, costs) for s in ("wavefront", "fifo")]
        out.append((sims[0], sims[1], section_work(graph, costs, samples)["llm"] / graph.sections["llm"].dp))
    return tuple(out)


def case_id(case) -> str:
    vdp, trainable, share = case
    return f"vision-dp{vdp}-{'trainable' if trainable else 'frozen'}-{round(share * 100)}pct"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_wavefront_is_never_worse_than_fifo(case):
    ratios = [w.makespan_s / f.makespan_s for w, f, _ in outcomes(*case)]
    assert max(ratios) <= 1.01, ratios


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_wavefront_is_near_the_lower_bound(case):
    ratios = [w.makespan_s / w.lower_bound_s for w, _, _ in outcomes(*case)]
    assert all(r >= 1.0 - 1e-9 for r in ratios)
    assert statistics.median(ratios) <= 1.10, ratios


def test_wavefront_median_over_all_mixes_is_within_5_percent_of_the_bound():
    ratios = [w.makespan_s / w.lower_bound_s for case in CASES for w, _, _ in outcomes(*case)]
    assert statistics.median(ratios) <= 1.05
    fifo = [f.makespan_s / f.lower_bound_s for case in CASES for _, f, _ in outcomes(*case)]
    assert statistics.median(ratios) < statistics.median(fifo)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_an_llm_bound_llm_never_waits(case):
    """Where the lower bound is the llm's own work per replica, the llm is busy >= 95% of the time
    (where the encoder binds, the llm must idle whatever the order: not checked)."""
    checked = [w.critical_busy_fraction for w, _, llm_bound in outcomes(*case)
               if w.critical_section == "llm" and w.lower_bound_s == pytest.approx(llm_bound, rel=1e-12)]
    assert all(b >= 0.95 for b in checked), checked


def test_most_mixes_are_llm_bound():
    """The busy-fraction test above must not pass vacuously."""
    bound = sum(w.critical_section == "llm" and w.lower_bound_s == pytest.approx(b, rel=1e-12)
                for case in CASES for w, _, b in outcomes(*case))
    assert bound >= len(CASES) * len(SEEDS) // 2


# -- the worst cases (issue 10) ------------------------------------------------------------

# (workload, vision dp, llm dp, vision micro-batch, llm micro-batch, trainable, image share): the
# issue's cases first, then the worst of tools/bench/wavefront_sim.py --worst before the fix
# (up to 1.31x the bound, up to 7% slower than FIFO). "draw" is the benchmark's workload,
# "mix" this module's (both from tools/bench/wavefront_sim.py, which runs the whole grid).
WORST = [
    ("mix", 1, 4, 2, 4, True, 0.5), ("draw", 1, 4, 2, 4, True, 0.5),  # the issue: 3.6% slower than FIFO
    ("mix", 2, 4, 2, 4, True, 0.8), ("draw", 2, 4, 2, 4, True, 0.8), ("mix", 2, 4, 4, 4, True, 0.8),
    ("mix", 2, 4, 4, 4, True, 0.5), ("draw", 2, 4, 4, 4, True, 0.5),  # 1.22x after "plan both"
    ("mix", 2, 8, 8, 4, True, 0.33), ("draw", 2, 8, 8, 4, True, 0.33), ("mix", 2, 8, 2, 4, True, 0.33),
    ("mix", 1, 8, 8, 4, True, 0.1), ("mix", 1, 8, 8, 2, True, 0.33), ("mix", 1, 8, 2, 4, True, 0.1),
    ("draw", 2, 2, 8, 2, True, 0.9), ("mix", 2, 2, 8, 2, True, 0.9), ("mix", 2, 2, 4, 2, True, 0.9),
    ("mix", 2, 4, 8, 2, True, 0.5), ("draw", 2, 4, 8, 4, True, 0.9), ("mix", 1, 8, 4, 2, True, 0.5),
    ("mix", 2, 8, 8, 4, False, 0.9), ("mix", 1, 8, 2, 4, False, 0.9), ("draw", 1, 8, 2, 2, False, 0.9),
    ("mix", 1, 4, 8, 2, False, 0.9), ("mix", 1, 8, 8, 4, False, 0.5),
]


def worst_id(case) -> str:
    workload, vdp, ldp, vmb, lmb, trainable, share = case
    return f"{workload}-v{vdp}-l{ldp}-mb{vmb}x{lmb}-{'trainable' if trainable else 'frozen'}-{round(share * 100)}pct"


def worst_batches(case, n: int):
    """A worst case's graph, costs and the batches of its three seeds (0-2), `n` samples each."""
    workload, vdp, ldp, vmb, lmb, trainable, share = case
    vision, llm = (bench.MIX_VISION_COST, bench.MIX_LLM_COST) if workload == "mix" else (bench.VISION_COST,
                                                                                      bench.llm_cost())
    graph, costs = bench.build(vdp, ldp, trainable, llm, vision=vision, mb_vision=vmb, mb_llm=lmb)
    draw = bench.draw_mix if workload == "mix" else bench.draw_samples
    return graph, costs, [draw(n, share, seed) for seed in (0, 1, 2)]


@pytest.mark.parametrize("case", WORST, ids=[worst_id(c) for c in WORST])
def test_worst_cases_are_within_5_percent_of_the_bound_and_never_slower_than_fifo(case):
    """256 samples, seeds 0-2: the wavefront plan simulates within 5% of the lower bound and no
    slower than FIFO's plan, in every seed (not only the median)."""
    graph, costs, batches = worst_batches(case, 256)
    for seed, samples in enumerate(batches):
        plan = make_planner("wavefront", graph, costs).plan(0, samples)
        wavefront = simulate(plan, graph, costs)
        fifo = simulate(make_planner("fifo", graph, costs).plan(0, samples), graph, costs)
        assert wavefront.makespan_s <= 1.05 * wavefront.lower_bound_s, (seed, plan.variant, wavefront.makespan_s
                                                                         / wavefront.lower_bound_s)
        assert wavefront.makespan_s <= fifo.makespan_s * (1 + 1e-9), (seed, plan.variant)


# 128 samples (few per replica: the grid's hardest size), cases that were above 1.05x in some seed
# before the `gap` and `prompt` rules (up to 1.23x) and are within it in every seed since; then
# cases the rules alone leave above it (up to 1.127x: a trainable encoder with about the LLM's
# work per replica, the case first) that the planner's search (refine.py) brings within;
# the last two stayed above it until the search's candidates cost less and images could trade
# places across the encoder replicas (RESULTS 11.3).
WORST_128 = [
    ("draw", 2, 8, 8, 4, True, 0.33), ("draw", 1, 8, 8, 4, True, 0.1), ("draw", 2, 8, 8, 4, False, 0.9),
    ("mix", 1, 8, 4, 4, True, 0.1), ("mix", 2, 8, 8, 4, True, 0.33), ("mix", 2, 8, 8, 4, False, 0.9),
    ("draw", 2, 4, 2, 4, True, 0.8), ("draw", 1, 2, 4, 4, True, 0.8), ("draw", 2, 4, 4, 4, True, 0.8),
    ("mix", 1, 8, 8, 4, True, 0.1), ("mix", 2, 2, 4, 4, True, 0.9),
    ("draw", 2, 4, 4, 2, True, 0.8), ("draw", 2, 4, 8, 2, True, 0.8),
]


@pytest.mark.parametrize("case", WORST_128, ids=[worst_id(c) for c in WORST_128])
def test_worst_cases_of_128_samples_are_within_5_percent_of_the_bound(case):
    graph, costs, batches = worst_batches(case, 128)
    for seed, samples in enumerate(batches):
        plan = make_planner("wavefront", graph, costs).plan(0, samples)
        wavefront = simulate(plan, graph, costs)
        assert wavefront.makespan_s <= 1.05 * wavefront.lower_bound_s, (seed, plan.variant, wavefront.makespan_s
                                                                         / wavefront.lower_bound_s)


# Cases whose plan for some later step (the step seeds the search) stayed above 1.05x (up to
# 1.057x) until the search could move one sample to another replica, not only swap two: the
# LLM's replicas stayed unbalanced by a few percent (RESULTS 11.3).
WORST_128_STEPS = [("mix", 1, 8, 2, 4, True, 0.1), ("mix", 1, 8, 4, 2, True, 0.1)]


@pytest.mark.parametrize("case", WORST_128_STEPS, ids=[worst_id(c) for c in WORST_128_STEPS])
def test_worst_cases_of_128_samples_stay_within_5_percent_at_later_steps(case):
    graph, costs, batches = worst_batches(case, 128)
    planner = make_planner("wavefront", graph, costs)
    for step in (1, 2, 3):
        wavefront = simulate(planner.plan(step, batches[0]), graph, costs)
        assert wavefront.makespan_s <= 1.05 * wavefront.lower_bound_s, (step, wavefront.makespan_s
                                                                         / wavefront.lower_bound_s)


# -- load balance --------------------------------------------------------------------------


BALANCE_LAYOUTS = {
    "llm-alone": lambda: SectionGraph(Pipeline(name="p", data=ArrowData(path="d"), sections=[
        S("llm", trainable=True, dp=4, micro_batch=4, cost=LLM_COST)])),
    "teacher2-llm4": lambda: SectionGraph(Pipeline(name="p", data=ArrowData(path="d"), sections=[
        S("teacher", dp=2, micro_batch=8, cost=Cost(per_sample_s=1e-3, per_token_s=5e-6)),
        S("llm", trainable=True, dp=4, micro_batch=4, cost=LLM_COST)],
        edges=[Edge(src="teacher", dst="llm", tensors=("hidden",))])),
    "vision1-frozen": lambda: vlm(1, False),
    "vision2-frozen": lambda: vlm(2, False),
    "vision1-trainable": lambda: vlm(1, True),
    "vision2-trainable": lambda: vlm(2, True),
}


@pytest.mark.parametrize("layout", list(BALANCE_LAYOUTS))
def test_critical_replicas_are_balanced_within_one_sample(layout):
    """Identical replicas: the critical section's replicas carry work within the most expensive
    single sample of each other (LPT's guarantee), whatever the mix; with equal sample costs
    that is a difference of at most one sample."""
    graph = BALANCE_LAYOUTS[layout]()
    costs = costs_of(graph)
    for seed in range(4):
        for share in (0.0, 0.33, 0.9):
            samples = mix(seed, share, 200)
            plan = make_planner("wavefront", graph, costs).plan(0, samples)
            crit = critical_section(graph, costs, samples)
            meta = {s.id: s for s in samples}
            loads = [sum(task_s(graph, costs, crit, meta[sid]) for mb in rep for sid in mb)
                     for rep in plan.replicas[crit]]
            biggest = max(task_s(graph, costs, crit, s) for s in samples
                          if graph.sections[crit].activates(s.modalities))
            assert max(loads) - min(loads) <= biggest + 1e-12, (seed, share, crit, loads, biggest)
    equal = [SampleMeta(id=i, row=i, num_tokens=100) for i in range(37)]
    plan = make_planner("wavefront", graph, costs).plan(0, equal)
    counts = [sum(len(mb) for mb in rep) for rep in plan.replicas["llm"]]
    assert max(counts) - min(counts) <= 1, counts


# -- run-ahead -----------------------------------------------------------------------------


def cheap_encoder(vision_dp: int, vision_mb: int) -> SectionGraph:
    """A frozen encoder ~20x cheaper per sample than the llm."""
    return vlm(vision_dp, False, vision_mb=vision_mb, vision_cost=Cost(per_sample_s=1e-3, per_patch_s=1e-6))


def outstanding_in_simulation(plan: Plan, sim: Simulation) -> int:
    """Most encoder outputs ever produced for one llm replica and not yet consumed by it."""
    at = {(t.section, t.replica, t.micro_batch): t for t in sim.tasks if t.kind == "forward"}
    route, produced = plan.routes["llm"], set(plan.processed("vision"))
    peak = 0
    for c, mbs in enumerate(plan.replicas["llm"]):
        events = [(at[("vision", r, m)].end_s, 1, sum(route[s] == c for s in mb))
                  for r, rep in enumerate(plan.replicas["vision"]) for m, mb in enumerate(rep)]
        events += [(at[("llm", c, m)].start_s, 0, -sum(s in produced for s in mb)) for m, mb in enumerate(mbs)]
        level = 0
        for _, _, n in sorted(events):  # at equal times, consumption (0) before production (1)
            level += n
            peak = max(peak, level)
    return peak


def run_with_credits(plan: Plan, graph: SectionGraph, costs: CostModel, run_ahead: int) -> tuple[list[int], float]:
    """Execute the plan as a runtime with run-ahead credits would: each replica runs its
    micro-batches in plan order; an encoder replica starts its next micro-batch only if every llm
    replica it feeds then has at most `run_ahead` outputs produced (or in production) but not yet
    consumed, unless that llm replica is idle (waiting on inputs), which overrides the credit as
    in the planner. Returns the peak outstanding count per llm replica and the makespan."""
    meta = {s.id: s for s in plan.samples}
    enc, llm, route = plan.replicas["vision"], plan.replicas["llm"], plan.routes["llm"]
    produced = {sid for rep in enc for mb in rep for sid in mb}
    e_next, e_free = [0] * len(enc), [0.0] * len(enc)
    l_next, l_free = [0] * len(llm), [0.0] * len(llm)
    arrive: dict[int, float] = {}
    outstanding, peak = [0] * len(llm), [0] * len(llm)
    now = end = 0.0

    def llm_ready(c: int) -> float:
        if l_next[c] == len(llm[c]):
            return INF
        return max([l_free[c]] + [arrive.get(s, INF) for s in llm[c][l_next[c]] if s in produced])

    def idle(c: int, t: float) -> bool:
        return l_free[c] <= t < llm_ready(c)

    def unfinished() -> bool:
        return any(e_next[r] < len(rep) for r, rep in enumerate(enc)) or any(
            l_next[c] < len(rep) for c, rep in enumerate(llm))

    while unfinished():
        options = [(max(llm_ready(c), now), 0, c) for c in range(len(llm)) if llm_ready(c) < INF]
        for r in range(len(enc)):
            if e_next[r] == len(enc[r]):
                continue
            t = max(e_free[r], now)
            wants = Counter(route[s] for s in enc[r][e_next[r]])
            if all(outstanding[c] + n <= run_ahead or idle(c, t) for c, n in wants.items()):
                options.append((t, 1, r))
            else:  # held back: look again when an llm replica frees up or can start
                later = [x for c in range(len(llm)) for x in (l_free[c], llm_ready(c)) if t < x < INF]
                if not later:  # an llm replica that can start by t is an option of its own and goes first
                    assert any(llm_ready(c) < INF for c in range(len(llm))), "credits deadlock"
                    later = [t]
                options.append((min(later), 2, r))
        assert options, "credits deadlock"
        now, kind, i = min(options)
        if kind == 0:
            mb = llm[i][l_next[i]]
            l_next[i] += 1
            outstanding[i] -= sum(s in produced for s in mb)
            l_free[i] = now + sum(task_s(graph, costs, "llm", meta[s]) for s in mb)
            end = max(end, l_free[i])
        elif kind == 1:
            mb = enc[i][e_next[i]]
            e_next[i] += 1
            e_free[i] = now + sum(costs.sample_s("vision", meta[s]) for s in mb)
            end = max(end, e_free[i])
            for s in mb:
                outstanding[route[s]] += 1
                peak[route[s]] = max(peak[route[s]], outstanding[route[s]])
                arrive[s] = e_free[i] + costs.transfer_s
    return peak, end


@pytest.mark.parametrize(("vision_dp", "vision_mb"), [(1, 2), (2, 4), (1, 8)])
def test_run_ahead_credit_bounds_outstanding_outputs(vision_dp, vision_mb):
    """A cheap frozen encoder feeding an expensive llm, planned with run_ahead=k and executed with
    credits (run_with_credits: a model of credits independent of the plan's gates, which
    simulate.py enforces, see the next test): the plan never deadlocks under credits, loses
    nothing against free-running producers, and no llm replica ever has more than k + one
    encoder micro-batch of outputs waiting (the documented bound: an idle llm replica overrides
    its credit). With k = 1 or 4 the peak is exactly k, so the encoder does use its whole buffer
    (k <= peak is asserted too). run_ahead=None means the planner's default, 4 x the llm's
    micro_batch and at least 16 (16 here), more than this encoder needs to keep the llm busy (no
    k <= peak there)."""
    graph = cheap_encoder(vision_dp, vision_mb)
    costs = costs_of(graph)
    for seed, share in ((0, 0.33), (1, 0.5), (2, 0.9)):
        samples = mix(seed, share, 128)
        for run_ahead in (1, 4, None):
            k = run_ahead or max(4 * graph.sections["llm"].micro_batch, 16)
            plan = WavefrontPlanner(graph, costs, run_ahead=run_ahead).plan(0, samples)
            peak, makespan = run_with_credits(plan, graph, costs, k)
            assert max(peak) <= k + vision_mb, (seed, share, k, peak)
            assert run_ahead is None or k <= max(peak), (seed, share, k, peak)
            assert makespan <= simulate(plan, graph, costs).makespan_s * (1 + 1e-9)


def test_simulated_run_ahead_stays_within_the_credit():
    """The plan's gates (which the executor enforces with progress messages) bound how far a
    cheap frozen encoder runs ahead of each llm replica, in the simulation of the plan too."""
    graph = cheap_encoder(1, 2)
    costs = costs_of(graph)
    plan = WavefrontPlanner(graph, costs, run_ahead=4).plan(0, mix(0, 0.5, 256))
    assert outstanding_in_simulation(plan, simulate(plan, graph, costs)) <= 4 + 2


# -- scale, determinism, JSON --------------------------------------------------------------


def test_planning_4096_samples_over_64_llm_replicas_is_quick():
    """Smoke bound only (the benchmark tracks the 100 ms goal): 4096 samples, 33% images, 16
    trainable encoder replicas -> 64 llm replicas."""
    graph = vlm(16, True, llm_dp=64, vision_mb=8)
    samples = mix(0, 0.33, 4096)
    start = time.perf_counter()
    plan = make_planner("wavefront", graph, costs_of(graph)).plan(0, samples)
    assert time.perf_counter() - start < 2.0
    assert sorted(plan.processed("llm")) == list(range(4096))
    assert sorted(plan.processed("vision")) == [s.id for s in samples if "image" in s.modalities]


@pytest.mark.parametrize("seed", range(4))
def test_same_input_same_plan(seed):
    """Fresh planners, and a graph rebuilt from the pipeline's plain-data form, agree exactly."""
    graph = vlm(2, seed % 2 == 0)
    samples = mix(seed, (0.1, 0.33, 0.5, 0.9)[seed], 96)
    random.Random(seed).shuffle(samples)
    first = make_planner("wavefront", graph, costs_of(graph)).plan(seed, samples)
    rebuilt = SectionGraph(Pipeline.from_dict(graph.pipeline.to_dict()))
    again = make_planner("wavefront", rebuilt, costs_of(rebuilt)).plan(seed, list(samples))
    assert first == again and first.describe() == again.describe()
    assert simulate(first, graph, costs_of(graph)) == simulate(again, rebuilt, costs_of(rebuilt))


def test_plan_json_has_the_design_shape():
    graph = vlm(1, False, llm_dp=2)
    samples = mix(3, 0.5, 12)
    plan = make_planner("wavefront", graph, costs_of(graph)).plan(0, samples)
    d = plan.to_json_dict()
    assert {"schedule", "sections", "simulated"} <= set(d)
    assert d["schedule"] == "wavefront"
    assert list(d["sections"]) == ["vision", "llm"]
    for name, section in graph.sections.items():
        reps = d["sections"][name]["replicas"]
        assert len(reps) == section.dp
        assert reps == [[list(mb) for mb in rep] for rep in plan.replicas[name]]
        assert all(isinstance(sid, int) for rep in reps for mb in rep for sid in mb)
    sim = simulate(plan, graph, costs_of(graph))
    attached = dataclasses.replace(plan, simulated=sim.to_json_dict()).to_json_dict()["simulated"]
    assert {"makespan_s", "lower_bound_s", "critical_section", "critical_busy_fraction"} <= set(attached)


# `maestro plan --json` attaches the simulation: see tests/unit/test_cli_plan.py.
