"""Wavefront vs. FIFO: simulated makespans of a vision encoder -> LLM step over image:text mixes.

Pure simulation (no processes, no torch): builds a two-section graph `vision -> llm`, draws a
global batch of sample metadata, plans it with both schedules (maestro_flow.planner), runs each
plan through the planner's event simulator (simulate.py) and compares the makespans with the
simulator's lower bound. Knows nothing of the runtime; the numbers are cost-model seconds.

Workload (seeded, standard library `random`):
  - text tokens per sample: lognormal, median 512, sigma 1.0, clipped to 32..4096 (long tail:
    mean ~800, a few samples ~5x the mean);
  - patches per image: lognormal, median 256, sigma 0.6, clipped to 64..1024;
  - exactly round(fraction x batch) samples carry an image, at random positions.
Costs (forward seconds; a trainable section's backward is 2x its forward):
  - vision: 0.5 ms per image + 20 us per patch (an average image ~6.7 ms forward);
  - llm: 1 ms per sample + per_token_s per token + per_token_s / 4 per image patch (the encoder's
    patches enter the LLM as tokens after a 2x2 merge); per_token_s is calibrated (on a separate
    seeded draw of 20,000 samples) so that at the 1:1 mix the LLM's forward+backward of an
    average sample costs 4x an average image's encoder forward -> per_token_s ~ 9.3 us;
  - transfer_s 2e-4 per message; micro-batches: llm 4, vision 8.
So with vision dp=1 -> llm dp=4 the encoder has half the LLM's per-replica work at 1:1 when it
is frozen, and 1.5x when it is trainable (encoder-bound); vision dp=2 halves that.

For each case (layout x encoder mode x mix) the median over seeds of: makespan with each
schedule, wavefront/FIFO (and its worst seed), wavefront/lower bound (and its worst seed), the
critical section's busy fraction with each schedule, and which term of the lower bound binds:
  work:S      the critical section S's own work per replica (S = llm: a perfect wavefront keeps
              the LLM busy, busy fraction >= 0.97 is achievable; S = vision: encoder-bound, the
              LLM must idle whatever the order);
  head/tail   an edge's dependency bound (the consumer cannot start before the first output, or
              the producer's forward work for the consumer plus one
              consumer task comes before the end); the terms mirror simulate.bound_terms.
Goals (from the issues): wavefront/lower bound <= 1.05 (median over the cases, and since issue
10 in every case), never slower than FIFO, critical busy fraction >= 0.97 wherever the bound is
the LLM's work bound.

`--run-ahead N` sets Pipeline.run_ahead (the wavefront's per-consumer-replica run-ahead credit;
default None = 4 x the consumer's micro-batch = 16 samples here).

`--worst` runs the worst-case grid instead (issue 10, item 3): vision dp 1 or 2 -> llm dp 2, 4
or 8, vision micro-batch 2, 4 or 8, llm micro-batch 2 or 4, 10/33/50/80/90% images, trainable
and frozen encoders, two workloads (this module's `draw_samples` and costs, and `draw_mix`:
tests/unit/test_wavefront.py's mix, lognormal tokens up to 8192 and 64..2304 patches per image,
with its costs), seeds 0-2. It prints, per layout and encoder, the max and median over the
group's cases of wavefront/lower bound and wavefront/FIFO, which rules won (Plan.variant), and
the cases above the 5% goal or slower than FIFO, and the wavefront's planning time (wall-clock,
median and max a plan, and the max of planning time / the planned step's makespan: what the
planner's local search, Pipeline.plan_search, spends); `--batch` sets the global batch
(default 256).

`--step S` plans step S instead of step 0 (the step seeds the search, so other steps show how
much its result depends on the seed).

`--plan-search X` sets Pipeline.plan_search (default: the pipeline's default; 0 turns the
planner's local search off, so the rules alone are measured).

Run from the repository root: python -m tools.bench.wavefront_sim [--tiny] [--run-ahead N] [--plan-search X]
                              python -m tools.bench.wavefront_sim --worst [--batch N] [--step S] [--plan-search X]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
from collections import Counter
from typing import Any

from maestro_flow.config import ArrowData, Cost, Edge, Pipeline, Section
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import CostModel, make_planner
from maestro_flow.planner.simulate import bound_terms, simulate
from maestro_flow.samples import SampleMeta
from tools.bench.common import median, table

MIXES = {"1:9": 0.1, "1:2": 1 / 3, "1:1": 0.5, "9:1": 0.9}  # image : text
LAYOUTS = {"v1->l4": (1, 4), "v2->l4": (2, 4)}  # vision dp -> llm dp
ENCODERS = {"trainable": True, "frozen": False}
LB_GOAL = 1.05
BUSY_GOAL = 0.97

TOKENS = (512.0, 1.0, 32, 4096)  # lognormal median, sigma, clip low, clip high
PATCHES = (256.0, 0.6, 64, 1024)
VISION_COST = Cost(per_sample_s=5e-4, per_patch_s=2e-5, backward_factor=2.0)
LLM_PER_SAMPLE_S = 1e-3
LLM_BACKWARD_FACTOR = 2.0
LLM_TO_ENCODER = 4.0  # at 1:1, LLM fwd+bwd of an average sample / encoder forward of an average image
TRANSFER_S = 2e-4
MB_LLM, MB_VISION = 4, 8


def _lognormal(rng: random.Random, spec: tuple[float, float, int, int]) -> int:
    med, sigma, lo, hi = spec
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(med), sigma)))))


def draw_samples(n: int, image_fraction: float, seed: int) -> list[SampleMeta]:
    rng = random.Random(seed)
    num_images = round(n * image_fraction)
    with_image = set(rng.sample(range(n), num_images))
    out = []
    for i in range(n):
        tokens = _lognormal(rng, TOKENS)
        if i in with_image:
            out.append(SampleMeta(id=i, modalities=frozenset({"text", "image"}), num_tokens=tokens,
                                  num_patches=_lognormal(rng, PATCHES)))
        else:
            out.append(SampleMeta(id=i, modalities=frozenset({"text"}), num_tokens=tokens))
    return out


# tests/unit/test_wavefront.py's workload: an image costs the encoder ~1-47 ms forward, a sample
# costs the LLM 2 ms + 20 us/token + 10 us/patch.
MIX_VISION_COST = Cost(per_sample_s=1e-3, per_patch_s=2e-5, backward_factor=2.0)
MIX_LLM_COST = Cost(per_sample_s=2e-3, per_token_s=2e-5, per_patch_s=1e-5, backward_factor=2.0)


def draw_mix(n: int, image_fraction: float, seed: int) -> list[SampleMeta]:
    """n samples: tokens lognormal (median ~400, clipped 16..8192), an image with probability
    `image_fraction` carrying 64, 256, 576, 1024 or 2304 patches (test_wavefront.mix)."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        tokens = min(8192, max(16, int(rnd.lognormvariate(6.0, 1.0))))
        if rnd.random() < image_fraction:
            out.append(SampleMeta(id=i, row=i, modalities=frozenset({"text", "image"}), num_tokens=tokens,
                                  num_patches=rnd.choice((64, 256, 576, 1024, 2304))))
        else:
            out.append(SampleMeta(id=i, row=i, modalities=frozenset({"text"}), num_tokens=tokens))
    return out


def llm_cost() -> Cost:
    """The LLM's cost, per_token_s calibrated to LLM_TO_ENCODER at the 1:1 mix (see the docstring)."""
    calib = draw_samples(20_000, 0.5, seed=12345)
    images = [s for s in calib if "image" in s.modalities]
    enc_fwd = sum(VISION_COST.per_sample_s + VISION_COST.per_patch_s * s.num_patches for s in images) / len(images)
    mean_tokens = sum(s.num_tokens + s.num_patches / 4 for s in calib) / len(calib)
    # (1 + backward_factor) * (per_sample + per_token * mean_tokens) = LLM_TO_ENCODER * enc_fwd
    per_token = (LLM_TO_ENCODER * enc_fwd / (1 + LLM_BACKWARD_FACTOR) - LLM_PER_SAMPLE_S) / mean_tokens
    return Cost(per_sample_s=LLM_PER_SAMPLE_S, per_token_s=per_token, per_patch_s=per_token / 4,
                backward_factor=LLM_BACKWARD_FACTOR)


def build(vision_dp: int, llm_dp: int, encoder_trainable: bool, llm: Cost, run_ahead: int | None = None, *,
          vision: Cost = VISION_COST, mb_vision: int = MB_VISION, mb_llm: int = MB_LLM,
          plan_search: float | None = None) -> tuple[SectionGraph, CostModel]:
    p = Pipeline(
        name="vlm-sim", data=ArrowData(path="unused.arrow"),
        sections=[
            Section(name="vision", stage="stages.vision:VisionEncoder", activates_on="image",
                    trainable=encoder_trainable, dp=vision_dp, micro_batch=mb_vision, cost=vision),
            Section(name="llm", stage="stages.multimodal:MultimodalLM", trainable=True, dp=llm_dp,
                    micro_batch=mb_llm, cost=llm),
        ],
        edges=[Edge(src="vision", dst="llm", tensors=("embeddings",))],
        run_ahead=run_ahead,
        **({} if plan_search is None else {"plan_search": plan_search}),
    )
    graph = SectionGraph(p)
    return graph, CostModel(costs={"vision": vision, "llm": llm}, transfer_s=TRANSFER_S)


WORST_LAYOUTS = ((1, 2), (2, 2), (1, 4), (2, 4), (1, 8), (2, 8))  # vision dp -> llm dp
WORST_MB_VISION, WORST_MB_LLM = (2, 4, 8), (4, 2)
WORST_SHARES = (0.1, 0.33, 0.5, 0.8, 0.9)
WORST_SEEDS = (0, 1, 2)
# The issue's cases (trainable encoder): vision dp 1 -> llm dp 4, micro-batches 2 / 4, 50% images;
# vision dp 2 -> llm dp 4, 80% images; and vision dp 2 -> llm dp 4, micro-batch 4, 50% images.
ISSUE_CASES = ((1, 4, 2, 4, 0.5), (2, 4, 2, 4, 0.8), (2, 4, 4, 4, 0.8), (2, 4, 4, 4, 0.5))


def worst(n: int, run_ahead: int | None = None, plan_search: float | None = None, step: int = 0) -> dict[str, Any]:
    """The worst-case grid (see the module docstring): every case, then per layout and encoder."""
    llm = llm_cost()
    rows = []
    search = next(f.default for f in dataclasses.fields(Pipeline) if f.name == "plan_search") \
        if plan_search is None else plan_search
    for workload in ("draw", "mix"):
        draw = draw_samples if workload == "draw" else draw_mix
        vision, llm_c = (VISION_COST, llm) if workload == "draw" else (MIX_VISION_COST, MIX_LLM_COST)
        for vision_dp, llm_dp in WORST_LAYOUTS:
            for mb_vision in WORST_MB_VISION:
                for mb_llm in WORST_MB_LLM:
                    for encoder, trainable in ENCODERS.items():
                        graph, costs = build(vision_dp, llm_dp, trainable, llm_c, run_ahead, vision=vision,
                                             mb_vision=mb_vision, mb_llm=mb_llm, plan_search=plan_search)
                        planners = {s: make_planner(s, graph, costs) for s in ("wavefront", "fifo")}
                        for share in WORST_SHARES:
                            for seed in WORST_SEEDS:
                                samples = draw(n, share, seed)
                                start = time.perf_counter()
                                plan = planners["wavefront"].plan(step, samples)
                                planning_s = time.perf_counter() - start
                                wf = simulate(plan, graph, costs)
                                ff = simulate(planners["fifo"].plan(0, samples), graph, costs)
                                rows.append({"workload": workload, "vision_dp": vision_dp, "llm_dp": llm_dp,
                                             "mb_vision": mb_vision, "mb_llm": mb_llm, "encoder": encoder,
                                             "share": share, "seed": seed, "variant": plan.variant,
                                             "issue_case": trainable and (vision_dp, llm_dp, mb_vision, mb_llm, share)
                                             in ISSUE_CASES,
                                             "planning_s": planning_s,
                                             "planning_over_step": planning_s / wf.makespan_s,
                                             "wavefront_over_bound": wf.makespan_s / wf.lower_bound_s,
                                             "wavefront_over_fifo": wf.makespan_s / ff.makespan_s,
                                             "fifo_over_bound": ff.makespan_s / ff.lower_bound_s})
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((f"v{r['vision_dp']}->l{r['llm_dp']}", r["encoder"]), []).append(r)
    table_rows = []
    for (layout, encoder), rs in groups.items():
        lb = [r["wavefront_over_bound"] for r in rs]
        ff = [r["wavefront_over_fifo"] for r in rs]
        won = Counter(r["variant"] for r in rs).most_common(2)
        table_rows.append([layout, encoder, len(rs), max(lb), median(lb), max(ff), median(ff),
                           max(r["fifo_over_bound"] for r in rs), sum(x > LB_GOAL for x in lb),
                           sum(x > 1 + 1e-9 for x in ff), ", ".join(f"{v} {k}" for v, k in won)])
    print(f"Worst-case grid: global batch {n}, {len(rows)} cases (workloads x layouts x micro-batches x encoder x "
          f"mixes x seeds {list(WORST_SEEDS)}), run_ahead {run_ahead}, plan_search {search}, step {step}")
    print(table(["layout", "encoder", "cases", "max wf/LB", "median wf/LB", "max wf/FIFO", "median wf/FIFO",
                 "max FIFO/LB", f"wf/LB > {LB_GOAL}", "wf > FIFO", "rules that won most"], table_rows))
    lb_all = [r["wavefront_over_bound"] for r in rows]
    ff_all = [r["wavefront_over_fifo"] for r in rows]
    issue = [r for r in rows if r["issue_case"]]
    print(f"over all {len(rows)} cases: wavefront/lower bound max {max(lb_all):.4f} median {median(lb_all):.4f}; "
          f"wavefront/FIFO max {max(ff_all):.4f} median {median(ff_all):.4f}")
    plan_s = [r["planning_s"] for r in rows]
    searched = [r for r in rows if r["variant"].startswith("refined")]
    print(f"wavefront planning: median {median(plan_s) * 1e3:.1f} ms, max {max(plan_s) * 1e3:.0f} ms a plan; "
          f"max planning / planned step {max(r['planning_over_step'] for r in rows):.3f}; "
          f"{len(searched)} plans shortened by the search (plan_search)")
    print(f"the issue's cases ({len(issue)}): wavefront/lower bound max "
          f"{max(r['wavefront_over_bound'] for r in issue):.4f}, wavefront/FIFO max "
          f"{max(r['wavefront_over_fifo'] for r in issue):.4f}")
    missed = sorted((r for r in rows if r["wavefront_over_bound"] > LB_GOAL or r["wavefront_over_fifo"] > 1 + 1e-9),
                    key=lambda r: -r["wavefront_over_bound"])
    for r in missed[:20]:
        print(f"  missed: {r['workload']} v{r['vision_dp']}->l{r['llm_dp']} mb {r['mb_vision']}/{r['mb_llm']} "
              f"{r['encoder']} {r['share']:.0%} seed {r['seed']}: wf/LB {r['wavefront_over_bound']:.4f} "
              f"wf/FIFO {r['wavefront_over_fifo']:.4f} FIFO/LB {r['fifo_over_bound']:.4f} ({r['variant']})")
    return {"rows": rows, "max_wavefront_over_bound": max(lb_all), "median_wavefront_over_bound": median(lb_all),
            "median_planning_s": median(plan_s), "max_planning_s": max(plan_s), "searched": len(searched),
            "max_wavefront_over_fifo": max(ff_all), "missed": len(missed),
            "goals": {"within_5pct_of_bound_everywhere": max(lb_all) <= LB_GOAL,
                      "never_slower_than_fifo": max(ff_all) <= 1 + 1e-9}}



def binding_term(terms: dict[str, float], lower_bound_s: float) -> str:
    name, value = max(terms.items(), key=lambda kv: kv[1])
    # A term this module does not know (the simulator's bound changed) shows as "other".
    return name if math.isclose(value, lower_bound_s, rel_tol=1e-9) else "other"


def run_case(graph: SectionGraph, costs: CostModel, n: int, fraction: float, seeds: list[int]) -> dict[str, Any]:
    runs = []
    for seed in seeds:
        samples = draw_samples(n, fraction, seed)
        row: dict[str, Any] = {"seed": seed}
        for schedule in ("wavefront", "fifo"):
            sim = simulate(make_planner(schedule, graph, costs).plan(0, samples), graph, costs)
            row[schedule] = {"makespan_s": sim.makespan_s, "critical_busy_fraction": sim.critical_busy_fraction,
                             "busy_s": {k: sum(v) for k, v in sim.busy_s.items()}}
            row["lower_bound_s"], row["critical_section"] = sim.lower_bound_s, sim.critical_section
        terms = bound_terms(samples, graph, costs)
        row["bound_terms"] = terms
        row["bound"] = binding_term(terms, row["lower_bound_s"])
        wf, ff = row["wavefront"]["makespan_s"], row["fifo"]["makespan_s"]
        row["wavefront_over_fifo"] = wf / ff
        row["wavefront_over_bound"] = wf / row["lower_bound_s"]
        row["fifo_over_bound"] = ff / row["lower_bound_s"]
        runs.append(row)

    def med(get) -> float:
        return median([get(r) for r in runs])

    return {
        "makespan_wavefront_s": med(lambda r: r["wavefront"]["makespan_s"]),
        "makespan_fifo_s": med(lambda r: r["fifo"]["makespan_s"]),
        "lower_bound_s": med(lambda r: r["lower_bound_s"]),
        "wavefront_over_fifo": med(lambda r: r["wavefront_over_fifo"]),
        "wavefront_over_bound": med(lambda r: r["wavefront_over_bound"]),
        "fifo_over_bound": med(lambda r: r["fifo_over_bound"]),
        "busy_wavefront": med(lambda r: r["wavefront"]["critical_busy_fraction"]),
        "busy_fifo": med(lambda r: r["fifo"]["critical_busy_fraction"]),
        "worst_wavefront_over_fifo": max(r["wavefront_over_fifo"] for r in runs),
        "worst_wavefront_over_bound": max(r["wavefront_over_bound"] for r in runs),
        "critical_section": Counter(r["critical_section"] for r in runs).most_common(1)[0][0],
        "bound": Counter(r["bound"] for r in runs).most_common(1)[0][0],
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.wavefront_sim", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size (batch 32, 2 seeds)")
    ap.add_argument("--batch", type=int, help="global batch in samples (default 256, tiny 32)")
    ap.add_argument("--seeds", type=int, help="seeds per case, medians reported (default 5, tiny 2)")
    ap.add_argument("--run-ahead", type=int, help="Pipeline.run_ahead for the wavefront (default: planner's)")
    ap.add_argument("--worst", action="store_true", help="the worst-case grid of issue 10 instead (see the docstring)")
    ap.add_argument("--step", type=int, default=0, help="with --worst: the step number planned (it seeds the "
                    "planner's search; default 0)")
    ap.add_argument("--plan-search", type=float, help="Pipeline.plan_search (default: the pipeline's, 0 turns the "
                                                       "planner's local search off)")
    args = ap.parse_args(argv)
    if args.worst:
        return worst(args.batch or (32 if args.tiny else 256), args.run_ahead, args.plan_search, args.step)
    n = args.batch or (32 if args.tiny else 256)
    seeds = list(range(args.seeds or (2 if args.tiny else 5)))

    llm = llm_cost()
    cases = []
    for layout, (vision_dp, llm_dp) in LAYOUTS.items():
        for encoder, trainable in ENCODERS.items():
            graph, costs = build(vision_dp, llm_dp, trainable, llm, args.run_ahead, plan_search=args.plan_search)
            for mix, fraction in MIXES.items():
                case = run_case(graph, costs, n, fraction, seeds)
                case.update(layout=layout, encoder=encoder, mix=mix, vision_dp=vision_dp, llm_dp=llm_dp)
                # The LLM's work bound is the one where keeping the critical section busy is possible.
                case["busy_goal_applies"] = case["bound"] == "work:llm"
                case["busy_goal_met"] = case["busy_wavefront"] >= BUSY_GOAL if case["busy_goal_applies"] else None
                cases.append(case)

    rows = [[c["layout"], c["encoder"], c["mix"], c["makespan_wavefront_s"], c["makespan_fifo_s"],
             c["lower_bound_s"], c["wavefront_over_fifo"], c["worst_wavefront_over_fifo"], c["wavefront_over_bound"],
             c["worst_wavefront_over_bound"], c["fifo_over_bound"],
             c["critical_section"], c["busy_wavefront"], c["busy_fifo"], c["bound"],
             {True: "yes", False: "NO", None: "n/a"}[c["busy_goal_met"]]] for c in cases]
    print(f"Simulated step makespans, global batch {n}, medians over seeds {seeds} "
          f"(llm per_token_s {llm.per_token_s:.3g}, transfer_s {TRANSFER_S}, micro-batches llm {MB_LLM}, "
          f"vision {MB_VISION}, run_ahead {args.run_ahead})")
    print(table(["layout", "encoder", "img:txt", "wavefront s", "FIFO s", "lower bound s", "wf/FIFO", "worst wf/FIFO", "wf/LB",
                 "worst wf/LB", "FIFO/LB", "critical", "busy wf", "busy FIFO", "bound", f"busy>={BUSY_GOAL}"], rows))
    median_over_bound = median([c["wavefront_over_bound"] for c in cases])
    print(f"max over cases and seeds: wavefront/lower bound {max(c['worst_wavefront_over_bound'] for c in cases):.4f}, "
          f"wavefront/FIFO {max(c['worst_wavefront_over_fifo'] for c in cases):.4f}")
    applies = [c for c in cases if c["busy_goal_applies"]]
    busy_met = all(c["busy_goal_met"] for c in applies)
    worse = [c for c in cases if c["wavefront_over_fifo"] > 1.0]
    print(f"wavefront/lower bound, median over {len(cases)} cases: {median_over_bound:.4f} "
          f"(goal <= {LB_GOAL}: {'met' if median_over_bound <= LB_GOAL else 'NOT met'})")
    print(f"critical busy fraction >= {BUSY_GOAL} where the LLM's work bound binds: "
          f"{sum(bool(c['busy_goal_met']) for c in applies)}/{len(applies)} cases "
          f"({'met' if busy_met else 'NOT met'})")
    if worse:
        print("wavefront slower than FIFO (median over seeds) in: "
              + ", ".join(f"{c['layout']} {c['encoder']} {c['mix']} ({c['wavefront_over_fifo']:.3f})" for c in worse))
    return {
        "cases": cases,
        "median_wavefront_over_bound": median_over_bound,
        "max_wavefront_over_bound": max(c["worst_wavefront_over_bound"] for c in cases),
        "max_wavefront_over_fifo": max(c["worst_wavefront_over_fifo"] for c in cases),
        "goals": {"within_5pct_of_bound": median_over_bound <= LB_GOAL, "busy_where_bound_allows": busy_met},
        "config": {"batch": n, "seeds": seeds, "run_ahead": args.run_ahead, "mixes": MIXES, "layouts": LAYOUTS,
                   "llm_cost": {"per_sample_s": llm.per_sample_s, "per_token_s": llm.per_token_s,
                                "per_patch_s": llm.per_patch_s, "backward_factor": llm.backward_factor},
                   "vision_cost": {"per_sample_s": VISION_COST.per_sample_s, "per_patch_s": VISION_COST.per_patch_s,
                                   "backward_factor": VISION_COST.backward_factor},
                   "transfer_s": TRANSFER_S, "micro_batch": {"llm": MB_LLM, "vision": MB_VISION}},
    }


if __name__ == "__main__":
    main()
