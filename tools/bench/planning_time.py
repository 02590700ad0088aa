"""Planning time: wall-clock seconds of one `planner.plan(step, samples)` call, wavefront vs. FIFO.

Pure planner timing (no processes, no torch): the same vision -> LLM graph, cost model and sample
distribution as tools/bench/wavefront_sim.py (lognormal tokens 32..4096, patches 64..1024,
trainable encoder, micro-batches llm 4 / vision 8), a 4096-sample global batch with 33% images,
over layouts of 64 replicas in total (the goal's "4096-sample global batch over 64 replicas") and
one of 80. Each repetition draws the batch with its own seed and plans it with a planner built
once (as the coordinator does); the timer covers `plan()` only. The median of the repetitions is
reported with its quartiles (wall-clock, the goal's measure), with the median CPU time, for
each layout how many batches had which critical section (the wavefront's balancing anchor, whose
replica groups set the cost of balance.assign), and which of the wavefront's rule sets won
(Plan.variant: at 4096 samples the planner plays out the first two of rules.CANDIDATES, or
stops after the first when it is within 0.5% of the lower bound, then rules FIFO out from its
replicas' work or simulates it).
Goal: wavefront <= 100 ms per plan.

`--padded` charges padding (Cost.padded: every micro-batch at its longest sample, split into
pieces where that pays), as the shipped pipelines do.

`--profile` runs cProfile over one more wavefront plan of the first layout and prints the top
functions by cumulative time (profiling overhead inflates them ~2x; read them as proportions).

Run from the repository root: python -m tools.bench.planning_time [--tiny] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import pstats
import time
from collections import Counter
from typing import Any

from maestro_flow.planner import make_planner
from maestro_flow.planner.simulate import critical_section
from tools.bench.common import median, quartiles, table
from tools.bench.wavefront_sim import VISION_COST, build, draw_samples, llm_cost

LAYOUTS = {"v16->l48": (16, 48), "v8->l56": (8, 56), "v16->l64": (16, 64)}  # vision dp -> llm dp
IMAGE_FRACTION = 0.33
GOAL_S = 0.100
GOAL_REPLICAS = 64  # the goal: 4096 samples over 64 replicas


def time_plans(planners: dict[str, Any], batches: list) -> dict[str, tuple[list[float], list[float], Counter]]:
    """Wall-clock and CPU seconds of each plan (CPU time leaves out the time this process was
    descheduled, which a busy shared machine adds to the wall-clock), and the plans' variants,
    per planner: the planners take turns on each batch (side by side, so a slow moment of the
    host falls on both), the first to go alternating from batch to batch."""
    out: dict[str, tuple[list[float], list[float], Counter]] = {k: ([], [], Counter()) for k in planners}
    names = list(planners)
    for step, samples in enumerate(batches):
        for name in names if step % 2 == 0 else names[::-1]:
            wall, cpu, variants = out[name]
            gc.collect()  # a collection from the previous repetition's garbage must not land in this one
            c0, t0 = time.process_time(), time.perf_counter()
            plan = planners[name].plan(step, samples)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            variants[plan.variant or plan.schedule] += 1
    return out


def profile_plan(planner, samples, top: int) -> list[dict[str, Any]]:
    prof = cProfile.Profile()
    prof.enable()
    planner.plan(0, samples)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    stats.print_stats(top)
    print(buf.getvalue())
    rows = []
    for (filename, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{filename.rsplit('/', 1)[-1]}:{line}({func})", "calls": ncalls,
                     "tottime_s": tottime, "cumtime_s": cumtime})
    rows.sort(key=lambda r: -r["cumtime_s"])
    return rows[:top]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.planning_time", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size (256 samples, 3 repetitions)")
    ap.add_argument("--samples", type=int, help="global batch in samples (default 4096, tiny 256)")
    ap.add_argument("--reps", type=int, help="timed plans per layout and schedule (default 9, tiny 3)")
    ap.add_argument("--profile", action="store_true", help="cProfile one wavefront plan of the first layout")
    ap.add_argument("--top", type=int, default=20, help="functions shown by --profile")
    ap.add_argument("--padded", action="store_true",
                    help="both sections pad (Cost.padded): micro-batches charged at their longest sample and "
                         "split where that pays")
    args = ap.parse_args(argv)
    n = args.samples or (256 if args.tiny else 4096)
    reps = args.reps or (3 if args.tiny else 9)

    llm = llm_cost()
    vision = VISION_COST
    if args.padded:
        llm, vision = dataclasses.replace(llm, padded=True), dataclasses.replace(vision, padded=True)
    batches = [draw_samples(n, IMAGE_FRACTION, seed) for seed in range(reps)]
    results = []
    for layout, (vision_dp, llm_dp) in LAYOUTS.items():
        graph, costs = build(vision_dp, llm_dp, True, llm, vision=vision)
        row: dict[str, Any] = {"layout": layout, "vision_dp": vision_dp, "llm_dp": llm_dp,
                               "replicas": vision_dp + llm_dp, "fanout": llm_dp // vision_dp,
                               # The wavefront balances from the critical section (its anchor), which
                               # changes the work of assign(): say which one each batch had.
                               "critical": dict(Counter(critical_section(graph, costs, b) for b in batches))}
        planners = {schedule: make_planner(schedule, graph, costs) for schedule in ("wavefront", "fifo")}
        for planner in planners.values():
            planner.plan(0, batches[0])  # warm-up: first-call costs (imports, allocator) are not planning
        for schedule, (times, cpu, variants) in time_plans(planners, batches).items():
            q1, q3 = quartiles(times)
            row[schedule] = {"median_s": median(times), "q1_s": q1, "q3_s": q3, "times_s": times,
                             "cpu_median_s": median(cpu), "variants": dict(variants)}
        results.append(row)

    rows = [[r["layout"], r["replicas"], r["fanout"], ", ".join(f"{k} {v}" for k, v in sorted(r["critical"].items())),
             1e3 * r["wavefront"]["median_s"],
             f"{1e3 * r['wavefront']['q1_s']:.1f}-{1e3 * r['wavefront']['q3_s']:.1f}", 1e3 * r["wavefront"]["cpu_median_s"],
             1e3 * r["fifo"]["median_s"], f"{1e3 * r['fifo']['q1_s']:.1f}-{1e3 * r['fifo']['q3_s']:.1f}",
             r["wavefront"]["median_s"] / r["fifo"]["median_s"],
             "yes" if r["wavefront"]["median_s"] <= GOAL_S else "NO",
             ", ".join(f"{k} {v}" for k, v in sorted(r["wavefront"]["variants"].items()))] for r in results]
    print(f"Planning time per step, {n} samples ({IMAGE_FRACTION:.0%} images), median of {reps} plans"
          + (", padding charged (Cost.padded)" if args.padded else ""))
    print(table(["layout", "replicas", "fan-out", "critical (batches)", "wavefront ms", "wf IQR ms", "wf CPU ms", "FIFO ms", "FIFO IQR ms",
                 "wf/FIFO", f"wf <= {GOAL_S * 1e3:.0f} ms", "wf rules (batches)"], rows))
    out: dict[str, Any] = {
        "layouts": results,
        # The goal's layouts: 64 replicas (v16->l64, 80 replicas, is shown, not judged).
        "goal_met": all(r["wavefront"]["median_s"] <= GOAL_S for r in results if r["replicas"] == GOAL_REPLICAS),
        "config": {"samples": n, "reps": reps, "image_fraction": IMAGE_FRACTION, "goal_s": GOAL_S,
                   "padded": args.padded},
    }
    if args.profile:
        vision_dp, llm_dp = next(iter(LAYOUTS.values()))
        graph, costs = build(vision_dp, llm_dp, True, llm, vision=vision)
        out["profile"] = profile_plan(make_planner("wavefront", graph, costs), batches[0], args.top)
    return out


if __name__ == "__main__":
    main()
