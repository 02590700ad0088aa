"""Teacher memory: a forward-only section's peak RSS must not grow with the micro-batches it serves.

Runs pipelines/distill.py in section mode (run_pipeline) at several global batch sizes with the
same micro-batch sizes (teacher 8, student 2) under FIFO's schedule (whole micro-batches), so the
teacher serves global_batch / 8 micro-batches per step, and reads each section's `max_rss_mb`
from the metrics rows (the largest replica's ru_maxrss high-water mark, reported with every
step). Every run processes the same
number of samples (--samples, so steps = samples / global_batch): the sampler cuts one seeded
epoch order into batches, so all runs see the same samples in the same order, and the longest
sequences (which set the activation high-water mark) are the same for every batch size.

The teacher runs under no_grad, keeps nothing between micro-batches and runs ahead of the student
by at most lookahead_steps=1 step, so its peak should stay flat: the reported ratio is the
teacher's peak at the largest batch over its peak at the smallest. "growth, 2nd half" is how much
the high-water mark still rose over the second half of a run (0 = settled, no per-step leak).
The student's figures are shown for comparison (a loss section accumulates gradients, not
activations; it also buffers the hidden states that arrive ahead of its plan).

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

    # Whole micro-batches of 8, so the teacher serves exactly global_batch / 8 of them: FIFO's
    # schedule (the wavefront may cut a teacher micro-batch short to feed a starving student
    # sooner, rules.Rules.prompt), padding not charged (no micro-batch is split into pieces).
    whole = {"schedule": "fifo", "sections.teacher.cost.padded": False, "sections.student.cost.padded": False}
    rows = run_pipeline(path, RunOptions(overrides={**whole, **sets, "global_batch": global_batch, "steps": steps},
                                         show_progress=False))
    out: dict[str, Any] = {"global_batch": global_batch, "steps": len(rows)}
    half = (len(rows) - 1) // 2
    for name in rows[0]["sections"]:
        rss = [r["sections"][name]["max_rss_mb"] for r in rows]
        out[name] = {"max_rss_mb": max(rss), "first_step_rss_mb": rss[0],
                     "growth_second_half_mb": rss[-1] - rss[half],
                     "micro_batches_per_step": rows[-1]["sections"][name]["micro_batches"]}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.teacher_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size (global batches 8 and 16, 32 samples)")
    ap.add_argument("--batches", type=str, help="comma-separated global batch sizes (default 16,64; tiny 8,16)")
    ap.add_argument("--samples", type=int, help="samples per run, a multiple of every batch (default 768, tiny 32)")
    ap.add_argument("--pipeline", default=repo_path("pipelines", "distill.py"), help="pipeline file")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="pipeline override, as `maestro run --set` (repeatable)")
    args = ap.parse_args(argv)

    from maestro_flow.overrides import parse_set

    batches = [int(b) for b in (args.batches or ("8,16" if args.tiny else "16,64")).split(",")]
    samples = args.samples or (32 if args.tiny else 768)
    if any(samples % gb for gb in batches):
        ap.error(f"--samples {samples} must be a multiple of every global batch {batches}")
    sets = parse_set(args.sets)
    runs = [run_one(args.pipeline, gb, samples // gb, sets) for gb in batches]

    sections = [k for k in runs[0] if isinstance(runs[0][k], dict)]
    rows = [[r["global_batch"], r["steps"], name, r[name]["micro_batches_per_step"], r[name]["first_step_rss_mb"],
             r[name]["max_rss_mb"], r[name]["growth_second_half_mb"]] for r in runs for name in sections]
    print(f"Peak RSS per section, {samples} samples per run, section mode")
    print(table(["global batch", "steps", "section", "micro-batches/step (all replicas)", "after step 0 MiB",
                 "peak MiB", "growth, 2nd half MiB"], rows))
    ratios = {name: runs[-1][name]["max_rss_mb"] / runs[0][name]["max_rss_mb"] for name in sections}
    for name, ratio in ratios.items():
        print(f"{name}: peak at global batch {batches[-1]} / peak at {batches[0]} = {ratio:.3f}")
    teacher = ratios.get("teacher")
    if teacher is not None:
        print(f"teacher ratio {teacher:.3f} (goal: close to 1, here < {RATIO_GOAL})")
    return {"runs": runs, "ratios": ratios, "teacher_ratio": teacher,
            "goal_met": teacher is not None and teacher < RATIO_GOAL,
            "config": {"batches": batches, "samples": samples, "overrides": sets, "pipeline": args.pipeline}}


if __name__ == "__main__":
    main()
