"""VLM at text-only speed: the LLM's throughput in pipelines/vlm.py against a text-only run of the
same LLM on the same token counts, at image shares 0 / 33 / 66 / 100%.

For each share, the demo image-text data is built with that share of image samples, and beside
it a text-only twin: row for row the same samples, each image sample replaced by a text-only
sample whose token list is as long as the LLM's sequence for the original (its text tokens
without the placeholder, plus one position per image patch), so the LLM runs on the same number
of positions, only without waiting for an encoder. Not quite the same work: the twin's LM head
and cross-entropy run on every position, the VLM's only on its text positions (image positions
predict nothing), so the twin does a little more (RESULTS 11.2, vlm_gap (a): the stage alone
0.98x as fast on the twin's micro-batches at 33% images), which flatters the ratio by up to a
few percent, more at higher shares. Both run the same pipeline
(vision dp 1 -> llm dp 1, wavefront schedule, `--pin-cpus`: the encoder's worker on one core, the
LLM's on another; in the twin the encoder's worker idles), alternately, several rounds, the
same seed and steps. Reported per share: the LLM's positions per second in each (positions per
step / median step time; both runs have the same positions per step), their ratio, and the
encoder's and the LLM's busy seconds per step in the VLM run (summed over a section's replicas:
one each at this layout; a --set of dp changes that): where the encoder's
is below the LLM's, its work can hide behind the LLM's. Goal: ratio >= 0.95 there.

Also per share, what the machine allows: the CPU seconds per step of every process of each run
(the workers' `sections.*.cpu_s`, every thread, plus the coordinator's `coordinator_cpu_s`),
and the ceiling they put on the ratio: no VLM step can be shorter than its CPU seconds over the
cores (the workers' and the coordinator's), so the ratio is at most text-only step x cores / VLM
CPU per step. Where that ceiling is below the goal, the goal is out of reach on this machine at
the runtime's present CPU cost, whatever the schedule.

The ratio is that of the medians over all rounds' steps. Beside it, each round's own ratio (its
twin's median step over its VLM's, the two run back to back) and their median: a host that
speeds up or slows down between rounds moves the pooled medians, less so a round's pair. The 0%
row is a control (the same data on both sides): how far it strays from 1 shows the hour's noise.

Run from the repository root: python -m tools.bench.vlm_text_only [--tiny] [--rounds N] [--steps N]
[--shares 0.33,1]
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

from tools.bench.common import median, pipeline_bench_args, repo_path, table, turns

SHARES = (0.0, 0.33, 0.66, 1.0)
GOAL = 0.95


def text_twin(vlm_path: Path, out: Path, seed: int = 0) -> Path:
    """The text-only twin of an image demo file (module docstring)."""
    import pyarrow as pa

    from loaders.demo import write_arrow

    table = pa.ipc.open_file(pa.memory_map(str(vlm_path))).read_all()
    rng = random.Random(seed)
    cols = table.to_pydict()
    for i, mods in enumerate(cols["modalities"]):
        tokens = cols["tokens"][i]
        if "image" in mods:
            n = len(tokens) - 1 + cols["num_patches"][i]
            cols["tokens"][i] = [rng.randrange(256) for _ in range(n)]
            cols["modalities"][i], cols["image"][i], cols["num_patches"][i] = ["text"], None, 0
    return write_arrow(pa.table(cols, schema=table.schema), out)


def parse_shares(text: str) -> tuple[float, ...]:
    """--shares: comma-separated image shares, each from 0 to 1 (a usage error otherwise)."""
    import argparse

    try:
        shares = tuple(float(part) for part in text.split(","))
    except ValueError:
        shares = ()
    if not shares or any(not 0.0 <= s <= 1.0 for s in shares):
        raise argparse.ArgumentTypeError(f"expected fractions from 0 to 1, comma-separated (0.33,1), got {text!r}")
    return shares


def run_one(data: Path, steps: int, sets: dict[str, Any], run_dir: str | None = None) -> list[dict[str, Any]]:
    """One pinned run; with `run_dir`, its plans, metrics and trace (run_dir/trace.json) kept there."""
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    overrides = {"sections.vision.dp": 1, "sections.llm.dp": 1, **sets, "data.path": str(data), "steps": steps}
    return run_pipeline(repo_path("pipelines", "vlm.py"), RunOptions(
        overrides=overrides, show_progress=False, pin_cpus=True, run_dir=run_dir, trace="" if run_dir else None))


def main(argv: list[str] | None = None) -> dict:
    args, rounds, steps, warmup, sets = pipeline_bench_args(
        argv, "tools.bench.vlm_text_only", __doc__, rounds=3, steps=24, warmup=6, tiny_steps=3,
        add=lambda ap: ap.add_argument("--shares", type=parse_shares, help="image shares to run, comma-separated "
                                       "fractions (default 0,0.33,0.66,1; tiny 0,0.66)"))
    from loaders.demo import build_image_demo

    num = 96 if args.tiny else 480
    out: dict[str, Any] = {"config": {"rounds": rounds, "steps": steps, "warmup": warmup, "sets": sets,
                                      "samples": num, "cores": sorted(os.sched_getaffinity(0))}}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for share in args.shares or ((SHARES[0], SHARES[2]) if args.tiny else SHARES):
            vlm = build_image_demo(Path(folder) / f"vlm{share}", num_samples=num, image_share=share)
            twin = text_twin(vlm, Path(folder) / f"text{share}" / "vlm.arrow")
            times: dict[str, list[float]] = {"vlm": [], "text": []}
            by_round: dict[str, list[float]] = {"vlm": [], "text": []}  # each run's median step
            cpu: dict[str, list[float]] = {"vlm": [], "text": []}
            busy: dict[str, list[float]] = {"vision": [], "llm": []}
            for r in range(rounds):
                for mode, data in turns((("vlm", vlm), ("text", twin)), r):
                    kept = run_one(data, steps, sets)[warmup:]
                    by_round[mode].append(median([row["step_time_s"] for row in kept]))
                    for row in kept:
                        times[mode].append(row["step_time_s"])
                        cpu[mode].append(row["coordinator_cpu_s"] + sum(s["cpu_s"] for s in row["sections"].values()))
                        if mode == "vlm":
                            for name in busy:
                                busy[name].append(row["sections"][name]["busy_s"])
            ratio = median(times["text"]) / median(times["vlm"])
            paired = [t / v for t, v in zip(by_round["text"], by_round["vlm"], strict=True)]
            enc, llm = median(busy["vision"]), median(busy["llm"])
            ceiling = median(times["text"]) * len(out["config"]["cores"]) / median(cpu["vlm"])
            out[str(share)] = {"vlm_step_s": median(times["vlm"]), "text_step_s": median(times["text"]),
                               "ratio": ratio, "round_ratios": paired, "paired_ratio": median(paired),
                               "encoder_busy_s": enc, "llm_busy_s": llm,
                               "encoder_below_llm": enc < llm, "vlm_cpu_s": median(cpu["vlm"]),
                               "text_cpu_s": median(cpu["text"]), "cpu_ceiling": ceiling}
            rows.append([f"{share:.0%}", f"{median(times['vlm']) * 1e3:.1f}", f"{median(times['text']) * 1e3:.1f}",
                         f"{ratio:.3f}", f"{median(paired):.3f} [{min(paired):.3f}-{max(paired):.3f}]",
                         f"{enc * 1e3:.1f}", f"{llm * 1e3:.1f}",
                         f"{median(cpu['vlm']) * 1e3:.1f}", f"{median(cpu['text']) * 1e3:.1f}", f"{ceiling:.3f}",
                         ("yes" if ratio >= GOAL else "NO") if enc < llm else "n/a (encoder-bound)"])
    print(f"pipelines/vlm.py, vision dp 1 -> llm dp 1, --pin-cpus, {rounds} alternating rounds of {steps} steps "
          f"(first {warmup} dropped), medians; the twin has the same LLM positions per step")
    print(table(["images", "VLM step ms", "text-only step ms", "LLM throughput VLM / text-only",
                 "per-round ratios: median [range]",
                 "encoder busy ms/step", "LLM busy ms/step", "VLM CPU ms/step", "text-only CPU ms/step",
                 f"ceiling on {len(out['config']['cores'])} cores", f">= {GOAL}"], rows))
    return out


if __name__ == "__main__":
    main()
