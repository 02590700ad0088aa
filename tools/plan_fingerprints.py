"""Fingerprints of the plans the planners make over a grid of cases, to show that a change to the
planner leaves every plan as it was (a refactor, a speed-up) or to see which cases it changes.

Each line: the case (vision dp, llm dp, samples, image share, padded, run_ahead, schedule, seed)
and a hash of the whole plan (every replica's micro-batches, the routes, the gates, the variant
and the simulated times it carries): 216 cases, 864 plans. The graph, costs and sample draws are tools/bench/wavefront_sim.py's (a trainable
encoder); the large layouts plan 4096 samples (no search: the budget cuts the rule sets short),
the small ones 24 to 256 samples (every rule set, refine's search). Then random section graphs
(`--graphs N`, default 300): chains, stars and trees of 2 to 5 sections with fan-out and fan-in
edges, trainable or frozen sections activating on random modalities, random costs (some terms
zero, some padded), run_ahead and batches of 0 to 150 samples; a graph the config refuses is
listed as such. Plans are deterministic, so two runs of one revision give the same file. To
compare two revisions:

    git worktree add /tmp/before REV   # older than this tool: copy tools/plan_fingerprints.py in
    (cd /tmp/before && python -m tools.plan_fingerprints /tmp/before.txt)
    python -m tools.plan_fingerprints /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt

The full run takes about a minute and a half; --tiny plans a handful of cases in seconds.
--simulated adds each plan's makespan and lower bound (simulate.py, the planner's own costs), to
see what a change that moves plans does to them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import random
import sys

from maestro_flow import ArrowData, Edge, Pipeline, Section
from maestro_flow.config import Cost
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import CostModel, make_planner
from maestro_flow.planner.plan import Plan
from maestro_flow.planner.simulate import simulate
from maestro_flow.samples import SampleMeta
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


MODALITIES = ("text", "image", "audio")


def random_graph(seed: int) -> tuple[Pipeline | str, list[SampleMeta]]:
    """A random valid pipeline (or why the config refused it) and a batch for it."""
    rnd = random.Random(seed)
    n = rnd.randint(2, 5)
    shape = rnd.choice(("chain", "star", "tree"))
    parents = [-1] + [i - 1 if shape == "chain" else 0 if shape == "star" else rnd.randint(0, i - 1)
                      for i in range(1, n)]
    dps = [rnd.choice((1, 2, 3, 4, 6))]
    for i in range(1, n):  # a neighbour's dp times or divided by 1, 2 or 3: fan-out and fan-in edges
        d = dps[parents[i]]
        dps.append(rnd.choice([x for x in sorted({d, 2 * d, 3 * d} | {d // f for f in (2, 3) if d % f == 0})
                               if x <= 12]))

    def term() -> float:
        return 0.0 if rnd.random() < 0.3 else rnd.choice((1e-3, 3.7e-4, 1.1e-2))

    sections = [Section(name=f"s{i}", stage=f"stages.fake:S{i}", trainable=rnd.random() < 0.5, dp=dps[i],
                        micro_batch=rnd.randint(1, 6), activates_on=rnd.choice((None, None, *MODALITIES)),
                        cost=Cost(per_sample_s=term(), per_token_s=term() * 1e-2, per_patch_s=term() * 1e-2,
                                  backward_factor=rnd.choice((0.0, 2.0)), per_micro_batch_s=term(),
                                  padded=rnd.random() < 0.3))
                for i in range(n)]
    edges = []
    for i in range(1, n):
        a, b = (parents[i], i) if rnd.random() < 0.5 else (i, parents[i])
        edges.append(Edge(src=f"s{a}", dst=f"s{b}", tensors=(f"t{a}{b}",)))
    try:
        pipeline: Pipeline | str = Pipeline(name="p", data=ArrowData(path="d"), sections=sections, edges=edges,
                                            run_ahead=rnd.choice((None, 1, 4)))
        SectionGraph(pipeline)
    except Exception as exc:  # the config's own refusals (a cycle, two losses, ...)
        pipeline = f"invalid {type(exc).__name__}"
    count = rnd.choice((0, 1, 5, 24, 64, 150))
    ids = rnd.sample(range(10**5), count)
    samples = [SampleMeta(id=i, row=k, num_tokens=rnd.choice((0, 5, 300, 2000)), num_patches=rnd.choice((0, 0, 64, 900)),
                          modalities=frozenset(m for j, m in enumerate(MODALITIES) if rnd.randint(1, 7) >> j & 1))
               for k, i in enumerate(ids)]
    return pipeline, samples


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(prog="python -m tools.plan_fingerprints", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="file to write (default: stdout)")
    ap.add_argument("--tiny", action="store_true", help="a handful of small cases (seconds)")
    ap.add_argument("--graphs", type=int, help="random section graphs after the grid (default 300, tiny 20)")
    ap.add_argument("--simulated", action="store_true", help="add each plan's simulated makespan and lower bound")
    args = ap.parse_args(argv)
    lines = []

    def line(head: str, plan: Plan, graph: SectionGraph, costs: CostModel) -> str:
        if not args.simulated:
            return f"{head} {fingerprint(plan)}"
        sim = simulate(plan, graph, costs)
        return f"{head} {fingerprint(plan)} makespan={sim.makespan_s:.9g} bound={sim.lower_bound_s:.9g}"
    for vision_dp, llm_dp, n, share, padded, run_ahead in cases(args.tiny):
        llm, vision = llm_cost(), VISION_COST
        if padded:
            llm, vision = dataclasses.replace(llm, padded=True), dataclasses.replace(vision, padded=True)
        graph, costs = build(vision_dp, llm_dp, True, llm, run_ahead, vision=vision)
        for schedule in ("wavefront", "fifo"):
            planner = make_planner(schedule, graph, costs)
            for seed in (0, 1):
                plan = planner.plan(seed, draw_samples(n, share, seed))
                lines.append(line(f"{vision_dp},{llm_dp},{n},{share},{padded},{run_ahead},{schedule},{seed}", plan,
                                  graph, costs))
    for seed in range(args.graphs if args.graphs is not None else (20 if args.tiny else 300)):
        pipeline, samples = random_graph(seed)
        if isinstance(pipeline, str):
            lines.append(f"graph {seed} {pipeline}")
            continue
        graph = SectionGraph(pipeline)
        costs = CostModel(costs={n: s.cost for n, s in graph.sections.items()})  # make_planner's default
        for schedule in ("wavefront", "fifo"):
            try:
                got = line(f"graph {seed} {schedule}", make_planner(schedule, graph, costs).plan(seed, samples), graph,
                           costs)
            except Exception as exc:  # a planner error is a result to compare too
                got = f"graph {seed} {schedule} error {type(exc).__name__}: {exc}"
            lines.append(got)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        plans = sum(1 for line in lines if " invalid " not in line)
        print(f"{plans} plans fingerprinted into {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return lines


if __name__ == "__main__":
    main()
