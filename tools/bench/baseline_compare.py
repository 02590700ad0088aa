"""Section mode against the monolithic baseline, side by side on the same cores and data.

For each demo pipeline (pipelines/distill.py, pipelines/vlm.py) this runs, in alternating rounds,
every candidate of both modes, each with `--pin-cpus` (each worker pinned to its share of the
same C cores, C = the cores this process may use: its own core when there are no more workers
than cores, all of them shared otherwise), the same seed, data and steps:
  section     the pipeline as shipped, and layouts of as many workers as cores (the critical
              section at dp 1 beside the other at dp 1, at a few micro-batch sizes: LAYOUTS);
  monolithic  `--baseline monolithic --devices C` at micro-batches 2, 4, 8 and 16;
so each mode is compared at its best, as a user would run it (four candidates each, so that
picking the best of noisy runs favours neither). Reported per pipeline: each candidate's
samples/s (global batch / median step time, the first steps dropped), and best section /
best monolithic, the median over rounds of the ratio of the rounds' bests. With --predict,
`maestro profile` measures the sections first (in a worker process) and `maestro tune`'s
predicted step of every candidate is printed beside the measured one (runtime/tuning.predict).

Run from the repository root: python -m tools.bench.baseline_compare [--tiny] [--rounds N] [--steps N] [--predict]
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from tools.bench.common import median, pipeline_bench_args, repo_path, table, turns

PIPELINES = ("distill", "vlm")
# Section-mode candidates beside the shipped layout: as many workers as the 2 cores of the
# machine RESULTS.md was measured on, the critical section's micro-batch varied.
LAYOUTS = {
    "distill": [{"sections.student.dp": 1, "sections.student.micro_batch": m} for m in (2, 4, 8)],
    "vlm": [{"sections.llm.dp": 1, "sections.llm.micro_batch": m} for m in (4, 6, 8)],
}
MONOLITHIC_MBS = (2, 4, 8, 16)


def run_one(pipeline: str, steps: int, sets: dict[str, Any], **baseline: Any) -> list[dict[str, Any]]:
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    return run_pipeline(repo_path("pipelines", f"{pipeline}.py"),
                        RunOptions(overrides={**sets, "steps": steps}, show_progress=False, pin_cpus=True, **baseline))


def candidates(name: str, cores: int, tiny: bool, batch: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(label, overrides, run options) of every candidate of both modes; the baseline on one rank a
    core, at most one a sample of the global batch (found in review: refused past it, on a host of
    more cores than samples)."""
    out = [("section (shipped)", {}, {})]
    out += [("section " + " ".join(f"{k.split('.')[1]} {k.split('.')[2]}={v}" for k, v in layout.items()), layout, {})
            for layout in LAYOUTS[name][:1 if tiny else None]]
    out += [(f"monolithic mb {m}", {}, {"baseline": "monolithic", "devices": min(cores, batch), "micro_batch": m})
            for m in MONOLITHIC_MBS[:1 if tiny else None]]
    return out


def main(argv: list[str] | None = None) -> dict:
    args, rounds, steps, warmup, sets = pipeline_bench_args(
        argv, "tools.bench.baseline_compare", __doc__, rounds=3, steps=30, warmup=6, tiny_steps=3,
        add=lambda ap: (ap.add_argument("--pipelines", nargs="*", default=list(PIPELINES), choices=PIPELINES),
                        ap.add_argument("--predict", action="store_true",
                                        help="profile the sections and add maestro tune's predictions")))
    from maestro_flow.runtime.build import load_pipeline

    cores = len(os.sched_getaffinity(0))
    out: dict[str, Any] = {"cores": cores, "config": {"rounds": rounds, "steps": steps, "warmup": warmup,
                                                      "sets": sets}}
    for name in args.pipelines:
        batch = load_pipeline(repo_path("pipelines", f"{name}.py"), dict(sets))[0].global_batch
        cands = candidates(name, cores, args.tiny, batch)
        times: dict[str, list[float]] = {label: [] for label, _, _ in cands}
        ratios = []
        for r in range(rounds):
            this = {}
            for label, layout, options in turns(cands, r):
                steps_s = [r["step_time_s"] for r in run_one(name, steps, {**sets, **layout}, **options)[warmup:]]
                times[label] += steps_s
                this[label] = median(steps_s)
            best_mono = min(v for k, v in this.items() if k.startswith("monolithic"))
            best_section = min(v for k, v in this.items() if k.startswith("section"))
            ratios.append(best_mono / best_section)
        rates = {label: batch / median(t) for label, t in times.items()}
        result: dict[str, Any] = {"global_batch": batch, "samples_per_s": rates,
                                  "best_section": max((k for k in rates if k.startswith("section")), key=rates.get),
                                  "best_monolithic": max((k for k in rates if k.startswith("monolithic")),
                                                         key=rates.get),
                                  "section_over_monolithic": median(ratios)}
        if args.predict:
            result["predicted_step_s"] = _predict(name, sets, cores, cands)
        out[name] = result
        pred = result.get("predicted_step_s", {})
        print(f"\n{name}: samples/s on {cores} cores (--pin-cpus), {rounds} alternating rounds of {steps} steps "
              f"(first {warmup} dropped), medians")
        print(table(["candidate", "samples/s", "step ms", "predicted step ms (maestro tune)"],
                    [[label, f"{rates[label]:.0f}", f"{batch / rates[label] * 1e3:.1f}",
                      f"{pred[label] * 1e3:.1f}" if label in pred else "-"] for label, _, _ in cands]))
        print(f"{name}: best section ({result['best_section']}) / best monolithic ({result['best_monolithic']}): "
              f"{result['section_over_monolithic']:.2f}x the samples/s (median over rounds)")
    return out


def _predict(name: str, sets: dict[str, Any], cores: int, cands: list) -> dict[str, float]:
    """maestro tune's predicted step of every candidate, from a profile measured now."""
    from maestro_flow.runtime.profiling import ProfileOptions, profile_pipeline
    from maestro_flow.runtime.tuning import TuneOptions, predict

    path = repo_path("pipelines", f"{name}.py")
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        costs = os.path.join(folder, "costs.json")
        profile_pipeline(path, ProfileOptions(overrides=dict(sets), out=costs))
        for label, layout, options in cands:
            tune = TuneOptions(overrides={**sets, **layout}, devices=cores, costs=costs)
            own, mono = predict(path, tune, micro_batch=options.get("micro_batch"))
            out[label] = mono.step_s if options else own.step_s
    return out


if __name__ == "__main__":
    main()
