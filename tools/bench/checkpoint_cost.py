"""What a checkpoint costs the distill demo: the time a save adds, amortised per step, beside runs
without checkpoints.

Runs pipelines/distill.py in section mode without checkpoints and with `--checkpoint-every K`
alternately, several rounds (same seed, data and steps). A checkpoint is synchronous: the
coordinator holds back the next plans, every worker saves its part (DCP for the trainable
student, RNG states for everyone), then the manifest is written; `checkpoint_s` in the metrics
row is that whole pause. Reports the median step time of both runs (steps other than the first
few), the median checkpoint pause, its size on disk, and the overhead: the pause per K steps as a
share of K steps' time. Then what the checksums cost (checkpoint/digest.py: each worker reads
back the files it wrote, and --resume reads them all): `digest.of` of a file of --digest-mib MiB
against a plain read of the same file, alternately (both from the page cache), in GiB/s.
Run from the repository root:
    python -m tools.bench.checkpoint_cost [--tiny] [--rounds N] [--steps N] [--every K] [--digest-mib M]
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from tools.bench.common import median, pipeline_bench_args, quartiles, repo_path, table, turns


def run_one(steps: int, every: int | None, sets: dict[str, Any], folder: str | None) -> list[dict[str, Any]]:
    from maestro_flow.checkpoint.checkpointer import CheckpointOptions
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    checkpoint = CheckpointOptions(dir=folder, every=every, keep_last=1) if every else CheckpointOptions()
    return run_pipeline(repo_path("pipelines", "distill.py"),
                        RunOptions(overrides={**sets, "steps": steps}, show_progress=False, checkpoint=checkpoint))


def folder_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def checksum_rates(mib: int, repeats: int) -> dict[str, float]:
    """Median GiB/s of digest.of and of a plain read of one file of `mib` MiB, alternately."""
    import time

    from maestro_flow.checkpoint import digest

    def plain(path: str) -> None:
        with open(path, "rb") as f:
            while f.read(digest.CHUNK):
                pass

    rates: dict[str, list[float]] = {"checksum": [], "read": []}
    with tempfile.TemporaryDirectory(prefix="maestro-digest-bench-") as folder:
        path = os.path.join(folder, "shard.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(mib << 20))
        for r in range(repeats):
            for name in turns(("checksum", "read"), r):
                start = time.perf_counter()
                if name == "checksum":
                    digest.of(path)
                else:
                    plain(path)
                rates[name].append(mib / 1024 / (time.perf_counter() - start))
    return {name: median(values) for name, values in rates.items()}


def _options(ap: Any) -> None:
    ap.add_argument("--every", type=int, help="checkpoint every K steps (default 5, tiny 2)")
    ap.add_argument("--digest-mib", type=int, help="size of the file the checksum pass reads (default 256, tiny 8)")


def main(argv: list[str] | None = None) -> dict:
    args, rounds, steps, warmup, sets = pipeline_bench_args(
        argv, "tools.bench.checkpoint_cost", __doc__, rounds=3, steps=30, warmup=3, tiny_steps=4, add=_options)
    every = args.every or (2 if args.tiny else 5)
    plain: list[float] = []
    with_ckpt: list[float] = []
    pauses: list[float] = []
    size = 0
    for r in range(rounds):
        for checkpoints in turns((False, True), r):
            if not checkpoints:
                plain += [row["step_time_s"] for row in run_one(steps, None, sets, None)[warmup:]]
                continue
            with tempfile.TemporaryDirectory(prefix="maestro-ckpt-bench-") as folder:
                rows = run_one(steps, every, sets, folder)
                size = folder_bytes(folder)  # keep_last=1: one checkpoint
            with_ckpt += [row["step_time_s"] for row in rows[warmup:]]
            pauses += [row["checkpoint_s"] for row in rows if "checkpoint_s" in row]
    step_s = median(plain)
    out = {"median_step_s": step_s, "median_step_s_with_checkpoints": median(with_ckpt),
           "median_checkpoint_s": median(pauses), "checkpoint_s_iqr": quartiles(pauses),
           "checkpoint_bytes": size, "checkpoints": len(pauses),
           "overhead_fraction": median(pauses) / (every * step_s),
           "config": {"rounds": rounds, "steps": steps, "every": every, "warmup_steps": warmup, "sets": sets}}
    print(f"pipelines/distill.py, section mode, {rounds} alternating runs of {steps} steps, checkpoint every {every}")
    print(table(["median step s (none)", "median step s (with)", "median checkpoint s", "checkpoint IQR s",
                 "checkpoint MiB", "overhead per step"],
                [[f"{step_s:.4f}", f"{out['median_step_s_with_checkpoints']:.4f}", f"{out['median_checkpoint_s']:.4f}",
                  "{:.4f}-{:.4f}".format(*out["checkpoint_s_iqr"]), f"{size / 2**20:.2f}",
                  f"{out['overhead_fraction']:.1%}"]]))
    mib = args.digest_mib or (8 if args.tiny else 256)
    out["checksum_gib_s"] = rates = checksum_rates(mib, 3 if args.tiny else 7)
    print(f"checksums (digest.of) of a {mib} MiB file against a plain read of it, alternately, medians")
    print(table(["checksum GiB/s", "plain read GiB/s", "checksum / read"],
                [[f"{rates['checksum']:.2f}", f"{rates['read']:.2f}", f"{rates['checksum'] / rates['read']:.2f}"]]))
    return out


if __name__ == "__main__":
    main()
