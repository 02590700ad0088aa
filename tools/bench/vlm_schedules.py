"""Real step time of pipelines/vlm.py with the wavefront schedule against FIFO, side by side.

Runs the VLM demo in section mode (real worker processes, DALI decode, gloo transfers) with
`schedule=wavefront` and `schedule=fifo` alternately, several rounds, so that machine noise hits
both alike; every run uses the same seed, data and steps. Reports, per schedule, the median step
time (the first steps are dropped: process warm-up and cost-model fitting) and the LLM section's
idle fraction (idle_s / (idle_s + busy_s), summed over its replicas), and the ratio of medians.

Knows nothing of the runtime's internals: it reads the metrics rows (DESIGN 5.4).
Run from the repository root: python -m tools.bench.vlm_schedules [--tiny] [--rounds N] [--steps N]
"""

from __future__ import annotations

from typing import Any

from tools.bench.common import median, pipeline_bench_args, repo_path, table, turns

SCHEDULES = ("wavefront", "fifo")


def run_one(schedule: str, steps: int, sets: dict[str, Any]) -> list[dict[str, Any]]:
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    return run_pipeline(str(repo_path("pipelines", "vlm.py")),
                        RunOptions(overrides={**sets, "schedule": schedule, "steps": steps}, show_progress=False))


def main(argv: list[str] | None = None) -> dict:
    args, rounds, steps, warmup, sets = pipeline_bench_args(argv, "tools.bench.vlm_schedules", __doc__, rounds=3,
                                                            steps=20, warmup=4, tiny_steps=4)
    if args.tiny:
        sets.setdefault("global_batch", 8)
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    idle: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for r in range(rounds):
        for schedule in turns(SCHEDULES, r):
            for row in run_one(schedule, steps, sets)[warmup:]:
                times[schedule].append(row["step_time_s"])
                llm = row["sections"]["llm"]
                idle[schedule].append(llm["idle_s"] / max(llm["idle_s"] + llm["busy_s"], 1e-12))
    out = {s: {"median_step_s": median(times[s]), "llm_idle_fraction": median(idle[s]), "steps": len(times[s])}
           for s in SCHEDULES}
    out["wavefront_over_fifo"] = out["wavefront"]["median_step_s"] / out["fifo"]["median_step_s"]
    out["config"] = {"rounds": rounds, "steps": steps, "warmup_steps": warmup, "sets": sets}
    print(f"pipelines/vlm.py, section mode, {rounds} alternating runs per schedule of {steps} steps "
          f"(first {warmup} left out), medians")
    print(table(["schedule", "step time s", "LLM idle fraction", "steps measured"],
                [[s, f"{out[s]['median_step_s']:.4f}", f"{out[s]['llm_idle_fraction']:.3f}", out[s]["steps"]]
                 for s in SCHEDULES]))
    print(f"wavefront / FIFO step time: {out['wavefront_over_fifo']:.3f}")
    return out


if __name__ == "__main__":
    main()
