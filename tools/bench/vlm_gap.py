"""Where the VLM's LLM loses against its text-only twin (tools/bench/vlm_text_only.py), at one
image share (default 33%).

(a) The stage: pipelines/vlm.py's LLM (stages.multimodal:MultimodalLM, one torch thread) runs
    forward and backward on micro-batches of 4 image samples (text tokens and 64 image rows that
    need gradients) and on their text twins (as many positions, all tokens), alternately. Equal
    times mean the stage does not mind where its positions come from.
(b) The runtime: the VLM and its twin (vision dp 1 -> llm dp 1, --pin-cpus, --trace),
    alternating rounds. From each run's trace, plans and data: the LLM's time per padded position
    in its forward and backward spans; its compute thread's CPU time over the spans' wall time, and the wall
    time lost per step (the thread runnable but off its core: other threads of its worker on
    that core); the padding (padded / real positions of its micro-batches) and micro-batches per
    step; and the time it waited for inputs per step. Medians over rounds.
(c) The cores: (a)'s text micro-batches timed on one core, alone and while the pipeline's vision
    encoder (its stage, its config) runs forward and backward on 8 images of 64 patches on the
    other core, alternately. The text-only twin's encoder core idles, the VLM's computes: where
    the two cores share a physical core's units or its memory path (a VM's vCPUs may), the LLM
    is slower beside a busy encoder, and that loss is the hardware's, not the schedule's. A ratio
    near 1 means the cores are independent. Needs two cores; skipped with fewer.

Run from the repository root: python -m tools.bench.vlm_gap [--tiny] [--rounds N] [--steps N] [--share F]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.bench.common import median, pipeline_bench_args, run_spawned, table, turns
from tools.bench.padding import plan_stats
from tools.bench.vlm_text_only import run_one, text_twin


def stage_times(draws: int, seed: int = 0) -> dict[str, float]:
    """Part (a), in a process of its own (one torch thread)."""
    return run_spawned(_stage_times, [(draws, seed)], timeout_s=600)[0]


def _llm_stage(seed: int) -> tuple[Any, Any]:
    """pipelines/vlm.py's LLM stage (one torch thread) and a draw of (image, text twin) micro-batches
    of 4 samples: text tokens and 64 image rows that need gradients, or as many text tokens."""
    import torch

    from maestro_flow.stage import MicroBatch, StageContext
    from pipelines.vlm import LLM
    from stages.multimodal import MultimodalLM

    torch.set_num_threads(1)
    stage = MultimodalLM(dict(LLM), StageContext(section="llm", trainable=True, placeholder_ids={"image": 259}))
    name = stage.input_names["image"]
    rng = random.Random(seed)

    def pair(n: int = 4, patches: int = 64) -> tuple[MicroBatch, MicroBatch]:
        lens = [rng.randrange(20, 120) for _ in range(n)]
        image = [torch.tensor([259] + [rng.randrange(256) for _ in range(k)]) for k in lens]
        text = [torch.tensor([rng.randrange(256) for _ in range(k + patches)]) for k in lens]
        rows = [torch.randn(patches, LLM["d_model"], requires_grad=True) for _ in lens]
        ids = list(range(n))
        return (MicroBatch(step=0, index=0, sample_ids=ids, modalities=[frozenset({"text", "image"})] * n,
                           columns={"tokens": image}, inputs={name: rows}),
                MicroBatch(step=0, index=0, sample_ids=ids, modalities=[frozenset({"text"})] * n,
                           columns={"tokens": text}, inputs={name: [None] * n}))

    return stage, pair


def _timed(stage: Any, batch: Any) -> float:
    t0 = time.perf_counter()
    stage.forward(batch)["loss"].backward()
    return time.perf_counter() - t0


def _stage_times(_rank: int, draws: int, seed: int) -> dict[str, float]:
    stage, pair = _llm_stage(seed)
    out: dict[str, list[float]] = {"image": [], "text": []}
    for i in range(draws + 3):
        image, text = pair()
        for kind, batch in ((("image", image), ("text", text)) if i % 2 else (("text", text), ("image", image))):
            t = _timed(stage, batch)
            if i >= 3:  # warm-up
                out[kind].append(t)
    return {k: statistics.median(v) for k, v in out.items()}


def core_times(rounds: int, per_turn: int, seed: int = 0) -> dict[str, float] | None:
    """Part (c): the LLM stage's forward + backward on one core, alone and beside the encoder on
    another; None with fewer than two cores."""
    import multiprocessing as mp

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    ctx = mp.get_context("spawn")
    events = tuple(ctx.Event() for _ in range(3))  # ready, busy, stop
    return run_spawned(_core_times, [(cores[0], events, rounds, per_turn, seed),
                                     (cores[1], events, rounds, per_turn, seed)], timeout_s=600)[1]


def _core_times(rank: int, core: int, events: tuple[Any, Any, Any], rounds: int, per_turn: int,
                seed: int) -> dict[str, float] | None:
    """Rank 0: the encoder, computing on its core while `busy` is set. Rank 1: the timer."""
    ready, busy, stop = events
    os.sched_setaffinity(0, {core})
    if rank == 0:
        _encoder_load(ready, busy, stop)
        return None
    stage, pair = _llm_stage(seed)
    batches = [pair()[1] for _ in range(per_turn)]
    out: dict[str, list[float]] = {"alone": [], "beside_encoder": []}
    try:
        for _ in range(2):  # warm-up: the first passes allocate
            _timed(stage, batches[0])
        if not ready.wait(300):  # (the encoder's stage built and warmed up: no turn runs beside nothing)
            raise RuntimeError("the encoder process did not get ready within 300 s")
        for r in range(rounds):
            for kind in turns(("alone", "beside_encoder"), r):
                if kind == "beside_encoder":
                    busy.set()
                else:
                    busy.clear()
                time.sleep(0.05)  # the encoder is in (or out of) its loop
                out[kind].append(sum(_timed(stage, batch) for batch in batches) / len(batches))
    finally:
        busy.clear()
        stop.set()
    return {k: statistics.median(v) for k, v in out.items()}


def _encoder_load(ready: Any, busy: Any, stop: Any) -> None:
    """pipelines/vlm.py's vision encoder stage, forward and backward on 8 decoded 64x64 images
    (64 patches each), while `busy` is set, until `stop`."""
    import torch

    from maestro_flow.stage import MicroBatch, StageContext
    from pipelines.vlm import VISION
    from stages.vision import VisionEncoder

    torch.set_num_threads(1)
    stage = VisionEncoder(dict(VISION), StageContext(section="vision", trainable=True))
    n = 8
    batch = MicroBatch(step=0, index=0, sample_ids=list(range(n)), modalities=[frozenset({"text", "image"})] * n,
                       columns={}, inputs={"pixels": [torch.rand(3, 64, 64) for _ in range(n)]})

    def forward_backward() -> None:
        sum(e.sum() for e in stage.forward(batch)["image_embeds"]).backward()

    forward_backward()  # warm-up
    ready.set()
    while not stop.is_set():
        if busy.wait(0.05):
            forward_backward()


def run_stats(run_dir: str, data: str, warmup: int) -> dict[str, float]:
    """Part (b) for one run: the LLM's figures from its trace, plans and data."""
    import pyarrow as pa

    t = pa.ipc.open_file(pa.memory_map(data)).read_all()
    size = {i: len(tok) + (p or 0) for i, tok, p in zip(t["id"].to_pylist(), t["tokens"].to_pylist(),
                                                         t["num_patches"].to_pylist(), strict=True)}
    with open(os.path.join(run_dir, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    llm = {e["pid"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
           and e["args"]["name"].startswith("llm[")}
    cpu, wall, waited, steps = 0.0, 0.0, 0.0, set()
    busy: dict[tuple, list] = {}  # (pid, step, mb) -> [microseconds, samples]: the LLM's forward + backward
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or e.get("pid") not in llm or args.get("step", 0) < warmup:
            continue
        steps.add(args["step"])
        if e["name"] in ("forward", "backward"):  # the loss section's backward follows its forward at once
            busy.setdefault((e["pid"], args["step"], args["mb"]), [0.0, args["samples"]])[0] += e["dur"]
            cpu += args["cpu"] * 1e6
            wall += e["dur"]
        elif e["name"] == "wait inputs":
            waited += e["dur"]
    per_pos = [us / (len(samples) * max(size[s] for s in samples)) for us, samples in busy.values()]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    plans = plan_stats(run_dir, rows, warmup, data)["llm"]
    n = max(1, len(steps))
    return {"us_per_position": median(per_pos), "cpu_over_wall": cpu / wall if wall else 1.0,
            "lost_ms": (wall - cpu) / 1e3 / n, "padding": plans["padding"], "micro_batches": plans["micro_batches"],
            "wait_inputs_ms": waited / 1e3 / n}


def main(argv: list[str] | None = None) -> dict:
    args, rounds, steps, warmup, sets = pipeline_bench_args(
        argv, "tools.bench.vlm_gap", __doc__, rounds=3, steps=24, warmup=6, tiny_steps=3,
        add=lambda ap: ap.add_argument("--share", type=float, default=0.33, help="image share (default 0.33)"))
    from loaders.demo import build_image_demo

    out: dict[str, Any] = {"stage": stage_times(3 if args.tiny else 55)}
    print("(a) the LLM stage, one thread, forward + backward of 4 samples: image rows against their text twin")
    print(table(["image ms", "text ms", "image / text"], [[f"{out['stage']['image'] * 1e3:.2f}",
                f"{out['stage']['text'] * 1e3:.2f}", f"{out['stage']['image'] / out['stage']['text']:.3f}"]]))
    num = 96 if args.tiny else 480
    stats: dict[str, list[dict[str, float]]] = {"vlm": [], "text": []}
    with tempfile.TemporaryDirectory() as folder:
        vlm = build_image_demo(Path(folder) / "vlm", num_samples=num, image_share=args.share)
        twin = text_twin(vlm, Path(folder) / "text" / "vlm.arrow")
        for r in range(rounds):
            for mode, data in turns((("vlm", vlm), ("text", twin)), r):
                run_dir = os.path.join(folder, f"{mode}-{r}")
                run_one(data, steps, sets, run_dir=run_dir)
                stats[mode].append(run_stats(run_dir, str(data), warmup))
    keys = ("us_per_position", "cpu_over_wall", "lost_ms", "padding", "micro_batches", "wait_inputs_ms")
    out.update({mode: {k: median([s[k] for s in v]) for k in keys} for mode, v in stats.items()})
    out["config"] = {"share": args.share, "rounds": rounds, "steps": steps, "warmup": warmup, "samples": num}
    labels = ["LLM µs per padded position", "compute thread CPU / wall in its spans", "wall ms lost per step",
              "padded / real positions", "micro-batches per step", "ms waiting for inputs per step"]
    print(f"\n(b) pipelines/vlm.py at {args.share:.0%} images and its text-only twin, vision dp 1 -> llm dp 1, "
          f"--pin-cpus, {rounds} alternating rounds of {steps} steps (first {warmup} dropped), medians")
    print(table(["LLM", "VLM", "text-only twin"],
                [[label, f"{out['vlm'][k]:.3f}", f"{out['text'][k]:.3f}"] for label, k in zip(labels, keys, strict=True)]))
    core_rounds = 2 if args.tiny else 15
    out["cores"] = core_times(core_rounds, 3 if args.tiny else 10)
    if out["cores"] is None:
        print("\n(c) skipped: it needs two cores")
    else:
        c = out["cores"]
        print(f"\n(c) the LLM stage's forward + backward (4 text samples) on one core, alone and while the vision "
              f"encoder computes on another, {core_rounds} alternating rounds, medians")
        print(table(["alone ms", "beside the encoder ms", "beside / alone"],
                    [[f"{c['alone'] * 1e3:.2f}", f"{c['beside_encoder'] * 1e3:.2f}",
                      f"{c['beside_encoder'] / c['alone']:.3f}"]]))
    return out


if __name__ == "__main__":
    main()
