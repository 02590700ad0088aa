"""Section mode against the monolithic baseline, side by side on the same cores and data.

For each demo pipeline (pipelines/distill.py, pipelines/vlm.py) this runs, alternately, several
rounds of:
  section     the pipeline as configured (its sections' own dp and micro-batch), section mode;
  monolithic  `--baseline monolithic --devices C`: C data-parallel ranks (C = the cores this
              process may use), each running every section on its share, at each of the
              micro-batch sizes given (--micro-batches; default: the loss section's own, and 8);
every run with `--pin-cpus` (each worker pinned to its share of the same C cores: its own core
when there are no more workers than cores, all of them shared otherwise), the same seed, data
and steps. Reported per pipeline: samples/s of each (global batch / median step time, the first
steps dropped), and section/monolithic as the median of per-round ratios against the best
monolithic micro-batch of that round. With --predict, `maestro profile` measures the sections
first (in worker processes) and `maestro tune`'s predictions of both modes are printed beside the
measurements (runtime/tuning.predict).

Run from the repository root: python -m tools.bench.baseline_compare [--tiny] [--rounds N] [--steps N] [--predict]
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from tools.bench.common import median, pipeline_bench_args, repo_path, table

PIPELINES = ("distill", "vlm")


def run_one(pipeline: str, steps: int, sets: dict[str, Any], **baseline: Any) -> list[dict[str, Any]]:
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    return run_pipeline(repo_path("pipelines", f"{pipeline}.py"),
                        RunOptions(overrides={**sets, "steps": steps}, show_progress=False, pin_cpus=True, **baseline))


def _add(ap) -> None:
    ap.add_argument("--pipelines", nargs="*", default=list(PIPELINES), choices=PIPELINES)
    ap.add_argument("--micro-batches", type=int, nargs="*", help="the baseline's micro-batch sizes to run "
                                                                 "(default: the loss section's, and 8)")
    ap.add_argument("--predict", action="store_true", help="profile the sections and add maestro tune's predictions")


def main(argv: list[str] | None = None) -> dict:
    args, rounds, steps, warmup, sets = pipeline_bench_args(argv, "tools.bench.baseline_compare", __doc__,
                                                            rounds=3, steps=30, warmup=5, tiny_steps=3, add=_add)
    from maestro_flow.runtime.build import load_pipeline

    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {"cores": cores, "config": {"rounds": rounds, "steps": steps, "warmup": warmup,
                                                      "sets": sets}}
    rows = []
    for name in args.pipelines:
        pipeline, _ = load_pipeline(repo_path("pipelines", f"{name}.py"), dict(sets))
        loss = [s for s in pipeline.sections if s.trainable][-1]
        mbs = sorted(set(args.micro_batches or [loss.micro_batch, 8]))
        batch = pipeline.global_batch
        times: dict[str, list[float]] = {"section": [], **{f"mono{m}": [] for m in mbs}}
        ratios: list[float] = []
        for _ in range(rounds):
            this: dict[str, float] = {}
            for mode in times:
                extra = {} if mode == "section" else {"baseline": "monolithic", "devices": cores,
                                                      "micro_batch": int(mode[4:])}
                steps_s = [r["step_time_s"] for r in run_one(name, steps, sets, **extra)[warmup:]]
                times[mode] += steps_s
                this[mode] = median(steps_s)
            ratios.append(min(this[f"mono{m}"] for m in mbs) / this["section"])
        result = {"global_batch": batch, "workers": sum(s.dp * s.tp for s in pipeline.sections),
                  "section_samples_s": batch / median(times["section"]),
                  "monolithic_samples_s": {m: batch / median(times[f"mono{m}"]) for m in mbs},
                  "section_over_monolithic": median(ratios)}
        if args.predict:
            result["predicted"] = _predict(name, sets, cores, mbs)
        out[name] = result
        best = max(result["monolithic_samples_s"], key=result["monolithic_samples_s"].get)
        pred = result.get("predicted", {})
        rows.append([name, result["workers"], f"{result['section_samples_s']:.0f}",
                     ", ".join(f"mb {m}: {v:.0f}" for m, v in result["monolithic_samples_s"].items()),
                     f"{result['section_over_monolithic']:.2f}",
                     f"{pred['section_over_monolithic']:.2f} (mb {pred['monolithic_micro_batch']})" if pred else "-"])
        out[name]["best_monolithic_micro_batch"] = best
    print(f"Section mode vs the monolithic baseline on {cores} cores (--pin-cpus), {rounds} alternating rounds of "
          f"{steps} steps (first {warmup} dropped), medians")
    print(table(["pipeline", "section workers", "section samples/s", f"monolithic ({cores} ranks) samples/s",
                 "section / monolithic", "predicted (maestro tune)"], rows))
    return out


def _predict(name: str, sets: dict[str, Any], cores: int, mbs: list[int]) -> dict[str, Any]:
    """maestro tune's predicted steps of both modes, from a profile measured now."""
    from maestro_flow.runtime.profiling import ProfileOptions, profile_pipeline
    from maestro_flow.runtime.tuning import TuneOptions, predict

    path = repo_path("pipelines", f"{name}.py")
    with tempfile.TemporaryDirectory() as folder:
        costs = os.path.join(folder, "costs.json")
        profile_pipeline(path, ProfileOptions(overrides=dict(sets), out=costs))
        options = TuneOptions(overrides=dict(sets), devices=cores, costs=costs)
        own, _ = predict(path, options)
        monos = {m: predict(path, options, micro_batch=m)[1] for m in mbs}
    best = min(monos, key=lambda m: monos[m].step_s)
    return {"section_step_s": own.step_s, "monolithic_step_s": {m: v.step_s for m, v in monos.items()},
            "monolithic_micro_batch": best, "section_over_monolithic": monos[best].step_s / own.step_s}


if __name__ == "__main__":
    main()
