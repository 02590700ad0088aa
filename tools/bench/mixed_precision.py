"""The distill demo in float32 and in bf16 mixed precision, side by side: loss curves, step time,
bytes sent between sections.

Runs pipelines/distill.py in section mode (real workers, gloo transfers) with
`mixed_precision=None` and `"bf16"` alternately, several rounds, same seed, data and steps, so
machine noise hits both alike. Reports each mode's loss at every step (first round), its median
step time (first steps left out: warm-up), the ratio bf16 / fp32, and the bytes the teacher sends
per step (its hidden states cross in bf16: half the bytes). Plans depend on the data alone
(adapt_costs=false), so both modes run the same micro-batches. Reads the metrics rows (DESIGN 5.4)
only. Run from the repository root:
    python -m tools.bench.mixed_precision [--tiny] [--rounds N] [--steps N]
"""

from __future__ import annotations

from typing import Any

from tools.bench.common import median, pipeline_bench_args, quartiles, repo_path, table, turns

MODES = {"fp32": None, "bf16": "bf16"}


def run_one(mode: str, steps: int, sets: dict[str, Any]) -> list[dict[str, Any]]:
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    # Plans from the data alone: both modes run the same micro-batches and send the same tensors.
    overrides = {"adapt_costs": False, **sets, "steps": steps, "mixed_precision": MODES[mode]}
    return run_pipeline(repo_path("pipelines", "distill.py"), RunOptions(overrides=overrides, show_progress=False))


def main(argv: list[str] | None = None) -> dict:
    _, rounds, steps, warmup, sets = pipeline_bench_args(argv, "tools.bench.mixed_precision", __doc__, rounds=3,
                                                         steps=30, warmup=3, tiny_steps=3)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    curves: dict[str, list[float]] = {}
    sent: dict[str, list[int]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in turns(MODES, r):
            rows = run_one(mode, steps, sets)
            curves.setdefault(mode, [r["loss"] for r in rows])
            times[mode] += [r["step_time_s"] for r in rows[warmup:]]
            sent[mode].append(sum(r["sections"]["teacher"]["bytes_sent"] for r in rows) / steps)
    out: dict[str, Any] = {m: {"median_step_s": median(times[m]), "step_s_iqr": quartiles(times[m]),
                               "loss": curves[m], "final_loss": curves[m][-1],
                               "teacher_bytes_per_step": median(sent[m])} for m in MODES}
    out["bf16_over_fp32_step_time"] = out["bf16"]["median_step_s"] / out["fp32"]["median_step_s"]
    out["bf16_over_fp32_bytes"] = out["bf16"]["teacher_bytes_per_step"] / max(out["fp32"]["teacher_bytes_per_step"], 1)
    out["config"] = {"rounds": rounds, "steps": steps, "warmup_steps": warmup, "sets": sets}
    print(f"pipelines/distill.py, section mode, {rounds} alternating runs per mode of {steps} steps")
    every = max(1, steps // 10)
    print(table(["step", "fp32 loss", "bf16 loss"],
                [[s, f"{curves['fp32'][s]:.4f}", f"{curves['bf16'][s]:.4f}"]
                 for s in sorted(set(range(0, steps, every)) | {steps - 1})]))
    print(table(["mode", "median step s", "step s IQR", "teacher bytes/step"],
                [[m, f"{out[m]['median_step_s']:.4f}", "{:.4f}-{:.4f}".format(*out[m]["step_s_iqr"]),
                  int(out[m]["teacher_bytes_per_step"])] for m in MODES]))
    print(f"bf16 / fp32: step time {out['bf16_over_fp32_step_time']:.3f}, bytes {out['bf16_over_fp32_bytes']:.3f}")
    return out


if __name__ == "__main__":
    main()
