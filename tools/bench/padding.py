"""What padding costs, and what planning for it gains (Cost.padded).

(a) The stage: the distill teacher (stages.lm:CausalLM, pipelines/distill.py's config, one torch
    thread) runs forward on micro-batches of 2, 8 and 16 demo texts drawn at random, and on
    micro-batches of as many texts that all have the random micro-batch's mean length (the same
    tokens, no padding). Reported: the median time ratio random / same-length against the median
    ratio of padded tokens (samples x longest) to real tokens. Equal ratios mean the stage's time
    follows the padded tokens, as `Cost(padded=True)` charges it.

(b) The runtime: pipelines/distill.py and pipelines/vlm.py as shipped (section mode, `--pin-cpus`),
    with `padded=True` on every section (the planner charges padding, compares its candidate
    orders on it and splits micro-batches where padding costs more than another micro-batch)
    and with `padded=False` (the linear cost model of before), alternately, several rounds.
    Reported per pipeline and variant: the median step time, each section's padding (padded over
    real positions of the planned micro-batches), micro-batches per step and busy time per step
    (summed over replicas), and the step-time ratio off / on.

Run from the repository root: python -m tools.bench.padding [--tiny] [--rounds N] [--steps N]
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from tools.bench.common import median, pipeline_bench_args, repo_path, run_spawned, table, turns

SIZES = (2, 8, 16)


def stage_ratios(draws: int, seed: int = 0) -> list[dict[str, Any]]:
    """Part (a), in a process of its own (it sets torch's thread count, which must not leak into
    the caller: a test process compares float sums computed at its own thread count)."""
    return run_spawned(_stage_ratios, [(draws, seed)], timeout_s=600)[0]


def _stage_ratios(_rank: int, draws: int, seed: int) -> list[dict[str, Any]]:
    """Per micro-batch size, time random / same-length and padded / real tokens."""
    import pyarrow as pa
    import torch

    from maestro_flow.stage import MicroBatch, StageContext
    from pipelines.distill import TEACHER
    from stages.lm import CausalLM

    torch.set_num_threads(1)
    table_ = pa.ipc.open_file(pa.memory_map(repo_path("data", "demo", "text.arrow"))).read_all()
    texts = [torch.tensor(t, dtype=torch.int64) for t in table_["tokens"].to_pylist()]
    by_length: dict[int, torch.Tensor] = {}
    for t in texts:
        by_length.setdefault(len(t), t)
    stage = CausalLM(dict(TEACHER), StageContext(section="teacher", trainable=False))

    def timed(tokens: list) -> float:
        batch = MicroBatch(step=0, index=0, sample_ids=list(range(len(tokens))),
                           modalities=[frozenset({"text"})] * len(tokens), columns={"tokens": tokens})
        with torch.no_grad():
            t0 = time.perf_counter()
            stage.forward(batch)
            return time.perf_counter() - t0

    rng = random.Random(seed)
    out = []
    for m in SIZES:
        times, pads = [], []
        timed(rng.sample(texts, m))  # warm-up
        for _ in range(draws):
            mb = rng.sample(texts, m)
            lengths = [len(t) for t in mb]
            mean = round(sum(lengths) / m)
            same = by_length[min(by_length, key=lambda n: abs(n - mean))]
            times.append(timed(mb) / timed([same] * m))
            pads.append(m * max(lengths) / sum(lengths))
        out.append({"micro_batch": m, "time_ratio": statistics.median(times), "padded_ratio": statistics.median(pads)})
    return out


def plan_stats(run_dir: str, rows: list[dict[str, Any]], warmup: int, data: str) -> dict[str, dict[str, float]]:
    """Per section: median padding, micro-batches and busy seconds per step over the run."""
    import json

    import pyarrow as pa

    t = pa.ipc.open_file(pa.memory_map(data)).read_all()
    patches = t["num_patches"].to_pylist() if "num_patches" in t.column_names else [0] * t.num_rows
    size = {i: (len(tok), p or 0) for i, tok, p in zip(t["id"].to_pylist(), t["tokens"].to_pylist(), patches,
                                                        strict=True)}
    with open(f"{run_dir}/plans.jsonl") as f:
        plans = [json.loads(line) for line in f][warmup:]
    out = {}
    for name in plans[0]["sections"]:
        pads, counts = [], []
        for plan in plans:
            real = padded = count = 0
            for rep in plan["sections"][name]["replicas"]:
                for mb in rep:
                    # What the section computes on: patches for the encoder, text + image rows for the LLM.
                    lengths = [size[i][1] if name == "vision" else size[i][0] + size[i][1] for i in mb]
                    real, padded, count = real + sum(lengths), padded + len(lengths) * max(lengths), count + 1
            pads.append(padded / real if real else 1.0)  # a section with no samples pads nothing
            counts.append(count)
        out[name] = {"padding": median(pads), "micro_batches": median(counts),
                     "busy_s": median([r["sections"][name]["busy_s"] for r in rows[warmup:]])}
    return out


def run_variant(pipeline: str, padded: bool, steps: int, warmup: int, sets: dict[str, Any], folder: str
                ) -> tuple[list[float], dict]:
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    path = repo_path("pipelines", pipeline)
    pipe, _ = load_pipeline(path, dict(sets))
    flags = {f"sections.{s.name}.cost.padded": padded for s in pipe.sections}
    rows = run_pipeline(path, RunOptions(overrides={**sets, **flags, "steps": steps}, show_progress=False,
                                         run_dir=folder, pin_cpus=True))
    return [r["step_time_s"] for r in rows[warmup:]], plan_stats(folder, rows, warmup, pipe.data.path)


def main(argv: list[str] | None = None) -> dict:
    import os
    import tempfile

    args, rounds, steps, warmup, sets = pipeline_bench_args(argv, "tools.bench.padding", __doc__, rounds=3,
                                                            steps=40, warmup=6, tiny_steps=3)
    out: dict[str, Any] = {"stage": stage_ratios(3 if args.tiny else 30)}
    print("(a) distill teacher forward, one thread: random micro-batches against micro-batches of their mean length")
    print(table(["micro-batch", "time random / same length", "padded / real tokens"],
                [[r["micro_batch"], f"{r['time_ratio']:.3f}", f"{r['padded_ratio']:.3f}"] for r in out["stage"]]))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for pipeline in ("distill.py", "vlm.py"):
            times: dict[bool, list[float]] = {True: [], False: []}
            stats: dict[bool, list[dict]] = {True: [], False: []}
            for r in range(rounds):
                for padded in turns((True, False), r):
                    run_dir = os.path.join(folder, f"{pipeline}-{padded}-{r}")
                    t, s = run_variant(pipeline, padded, steps, warmup, sets, run_dir)
                    times[padded].extend(t)
                    stats[padded].append(s)
            result = {"ratio_off_over_on": median(times[False]) / median(times[True])}
            for padded in (True, False):
                per = {n: {k: median([s[n][k] for s in stats[padded]]) for k in stats[padded][0][n]}
                       for n in stats[padded][0]}
                result["on" if padded else "off"] = {"step_s": median(times[padded]), "sections": per}
                for n, v in per.items():
                    rows.append([pipeline, "on" if padded else "off", n, f"{median(times[padded]) * 1e3:.1f}",
                                 f"{v['padding']:.3f}", f"{v['micro_batches']:g}", f"{v['busy_s'] * 1e3:.1f}"])
            out[pipeline] = result
    print(f"(b) section mode as shipped, --pin-cpus, {rounds} alternating rounds of {steps} steps (first {warmup} "
          "dropped), medians")
    print(table(["pipeline", "padded", "section", "step ms", "padding", "micro-batches/step", "busy ms/step"], rows))
    for pipeline in ("distill.py", "vlm.py"):
        print(f"{pipeline}: step time off / on = {out[pipeline]['ratio_off_over_on']:.3f}")
    return out


if __name__ == "__main__":
    main()
