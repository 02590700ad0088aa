"""Fingerprints of the plans the planners make over a grid of cases, to show that a change to the
planner leaves every plan as it was (a refactor, a speed-up) or to see which cases it changes.

Each line: the case (vision dp, llm dp, samples, image share, padded, run_ahead, schedule, seed)
and a hash of the whole plan (every replica's micro-batches, the routes, the gates, the variant
and the simulated times it carries): 216 cases, 864 plans. The graph, costs and sample draws are tools/bench/wavefront_sim.py's (a trainable
encoder); the large layouts plan 4096 samples (no search: the budget cuts the rule sets short),
the small ones 24 to 256 samples (every rule set, refine's search). Plans are deterministic, so
two runs of one revision give the same file. To compare two revisions:

    git worktree add /tmp/before REV   # older than this tool: copy tools/plan_fingerprints.py in
    (cd /tmp/before && python -m tools.plan_fingerprints /tmp/before.txt)
    python -m tools.plan_fingerprints /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt

The full grid takes about a minute; --tiny plans a handful of cases in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import sys

from maestro_flow.planner import make_planner
from maestro_flow.planner.plan import Plan
from tools.bench.wavefront_sim import VISION_COST, build, draw_samples, llm_cost

LARGE = ((16, 48), (8, 56), (16, 64))  # 4096 samples
SMALL = ((4, 8), (1, 4), (2, 4), (2, 8), (1, 2))  # 24, 64 and 256 samples


def fingerprint(plan: Plan) -> str:
    routes = sorted((n, sorted(r.items())) for n, r in plan.routes.items())
    whole = (plan.replicas, routes, plan.gates, plan.variant, sorted(plan.simulated.items()))
    return hashlib.sha256(repr(whole).encode()).hexdigest()[:16]


def cases(tiny: bool) -> list[tuple]:
    grid = [(*layout, 4096) for layout in LARGE] + [(*layout, n) for layout in SMALL for n in (24, 64, 256)]
    shares, paddings, run_aheads = (0.1, 0.33, 0.8), (False, True), (None, 4)
    if tiny:
        grid, shares = [(2, 4, 24), (1, 2, 64)], (0.33,)
    return [(*g, share, padded, ra) for g, share, padded, ra in itertools.product(grid, shares, paddings, run_aheads)]


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(prog="python -m tools.plan_fingerprints", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="file to write (default: stdout)")
    ap.add_argument("--tiny", action="store_true", help="a handful of small cases (seconds)")
    args = ap.parse_args(argv)
    lines = []
    for vision_dp, llm_dp, n, share, padded, run_ahead in cases(args.tiny):
        llm, vision = llm_cost(), VISION_COST
        if padded:
            llm, vision = dataclasses.replace(llm, padded=True), dataclasses.replace(vision, padded=True)
        graph, costs = build(vision_dp, llm_dp, True, llm, run_ahead, vision=vision)
        for schedule in ("wavefront", "fifo"):
            planner = make_planner(schedule, graph, costs)
            for seed in (0, 1):
                plan = planner.plan(seed, draw_samples(n, share, seed))
                lines.append(f"{vision_dp},{llm_dp},{n},{share},{padded},{run_ahead},{schedule},{seed} {fingerprint(plan)}")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"{len(lines)} plans fingerprinted into {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return lines


if __name__ == "__main__":
    main()
