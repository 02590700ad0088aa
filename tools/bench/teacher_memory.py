"""Teacher memory: a forward-only section's peak RSS must not grow with the micro-batches it serves.

Runs pipelines/distill.py in section mode (run_pipeline) at several global batch sizes with the
same micro-batch sizes (teacher 8, student 2), so the teacher serves global_batch / 8
micro-batches per step, and reads each section's `max_rss_mb` from the metrics rows (the largest
replica's ru_maxrss high-water mark, reported with every step). The teacher runs under no_grad,
keeps nothing between micro-batches and runs ahead of the student by at most lookahead_steps=1
step, so its peak should stay flat: the reported ratio is teacher peak at the largest batch over
teacher peak at the smallest. The student's peaks are shown for comparison (a loss section
accumulates gradients, not activations, so it should stay flat too; it also buffers the hidden
states that arrive ahead of its plan).

Knows nothing of how RSS is measured in workers; it reads the metrics contract (DESIGN 5.4 plus
the runtime's max_rss_mb). Run from the repository root: python -m tools.bench.teacher_memory [--tiny]
"""

from __future__ import annotations

import argparse
from typing import Any

from tools.bench.common import repo_path, table

RATIO_GOAL = 1.10  # "close to 1": under 10% growth for 4x the micro-batches


def run_one(path: str, global_batch: int, steps: int, sets: dict[str, Any]) -> dict[str, Any]:
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    rows = run_pipeline(path, RunOptions(overrides={**sets, "global_batch": global_batch, "steps": steps},
                                         show_progress=False))
    out: dict[str, Any] = {"global_batch": global_batch, "steps": len(rows)}
    for name in rows[0]["sections"]:
        rss = [r["sections"][name]["max_rss_mb"] for r in rows]
        out[name] = {"max_rss_mb": max(rss), "first_step_rss_mb": rss[0], "growth_mb": rss[-1] - rss[0],
                     "micro_batches_per_step": rows[-1]["sections"][name]["micro_batches"]}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.teacher_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size (global batches 8 and 16, 2 steps)")
    ap.add_argument("--batches", type=str, help="comma-separated global batch sizes (default 16,64; tiny 8,16)")
    ap.add_argument("--steps", type=int, help="steps per run (default 4, tiny 2)")
    ap.add_argument("--pipeline", default=repo_path("pipelines", "distill.py"), help="pipeline file")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="pipeline override, as `maestro run --set` (repeatable)")
    args = ap.parse_args(argv)

    from maestro_flow.config import parse_set

    batches = [int(b) for b in (args.batches or ("8,16" if args.tiny else "16,64")).split(",")]
    steps = args.steps or (2 if args.tiny else 4)
    sets = parse_set(args.sets)
    runs = [run_one(args.pipeline, gb, steps, sets) for gb in batches]

    sections = [k for k in runs[0] if isinstance(runs[0][k], dict)]
    rows = [[r["global_batch"], name, r[name]["micro_batches_per_step"], r[name]["first_step_rss_mb"],
             r[name]["max_rss_mb"], r[name]["growth_mb"]] for r in runs for name in sections]
    print(f"Peak RSS per section, {steps} steps per run, section mode")
    print(table(["global batch", "section", "micro-batches/step", "RSS after step 0 MiB", "peak RSS MiB",
                 "growth over run MiB"], rows))
    ratios = {name: runs[-1][name]["max_rss_mb"] / runs[0][name]["max_rss_mb"] for name in sections}
    for name, ratio in ratios.items():
        print(f"{name}: peak at global batch {batches[-1]} / peak at {batches[0]} = {ratio:.3f}")
    teacher = ratios.get("teacher")
    if teacher is not None:
        print(f"teacher ratio {teacher:.3f} (goal: close to 1, here < {RATIO_GOAL})")
    return {"runs": runs, "ratios": ratios, "teacher_ratio": teacher,
            "goal_met": teacher is not None and teacher < RATIO_GOAL,
            "config": {"batches": batches, "steps": steps, "overrides": sets, "pipeline": args.pipeline}}


if __name__ == "__main__":
    main()
