"""A forward-only teacher's throughput and peak memory against its micro-batch size (issue 8, item 7).

The published system runs its teacher at larger micro-batches than the student, reporting up to
2.6x teacher throughput with almost flat memory. This measures that for a 1B-class GPT teacher
(stages.lm:CausalLM, role "teacher": vocab 32000, d_model 2048, 16 layers, 16 heads, d_ff 8192;
about 0.9B parameters) in bf16 mixed precision, as a section's worker runs it: the stage built by
runtime.build.build_stage (fp32 weights, frozen), each forward under torch.no_grad() and the
runtime's bf16 autocast (runtime.precision.compute), on micro-batches of 1, 2, 4, 8 and 16
sequences of --seq-len tokens. Per micro-batch size: the median of --reps timed forwards (after
--warmup), as samples/s and tokens/s, their ratio to micro-batch 1, and the CUDA allocator's
peak (torch.cuda.max_memory_allocated, reset before each size; weights included) and its ratio
to micro-batch 1's. One process, no transfers: the teacher's own compute.

On CUDA by default when there is a GPU; `--device cpu` (and `--tiny`: a 2-layer d_model 64 model,
float32, micro-batches 1 and 4) runs anywhere, without the peak column. Run from the repository
root: python -m tools.bench.teacher_throughput [--tiny] [--device cuda|cpu] [--seq-len N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tools.bench.common import median, table

ONE_B = {"role": "teacher", "vocab_size": 32000, "d_model": 2048, "n_layers": 16, "n_heads": 16, "d_ff": 8192,
         "init_seed": 0}
TINY = {"role": "teacher", "vocab_size": 260, "d_model": 64, "n_layers": 2, "n_heads": 4, "init_seed": 0}


def measure(config: dict[str, Any], device: str, micro_batches: list[int], seq_len: int, reps: int, warmup: int,
            mixed_precision: str | None) -> list[dict[str, Any]]:
    import torch

    from maestro_flow import ArrowData, MicroBatch, Pipeline, Section
    from maestro_flow.runtime.build import build_stage
    from maestro_flow.runtime.precision import compute

    config = {**config, "max_seq_len": max(seq_len, 16)}
    section = Section(name="teacher", stage="stages.lm:CausalLM", config=config, trainable=False, dp=1,
                      micro_batch=max(micro_batches), device=device)
    pipeline = Pipeline(name="teacher-throughput", data=ArrowData(path="unused.arrow"), sections=[section],
                        mixed_precision=mixed_precision)
    stage = build_stage(pipeline, section, 0, device)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for mb in micro_batches:
        tokens = [torch.randint(0, config["vocab_size"], (seq_len,), generator=gen) for _ in range(mb)]
        batch = MicroBatch(step=0, index=0, sample_ids=list(range(mb)), modalities=[frozenset({"text"})] * mb,
                           columns={"tokens": tokens})
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        times = []
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            with torch.no_grad(), compute(mixed_precision, dev):
                out = stage.forward(batch)
            if cuda:
                torch.cuda.synchronize(dev)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            del out
        t = median(times)
        rows.append({"micro_batch": mb, "forward_s": t, "samples_per_s": mb / t, "tokens_per_s": mb * seq_len / t,
                     "peak_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else None})
    base = rows[0]
    for r in rows:
        r["throughput_vs_mb1"] = r["samples_per_s"] / base["samples_per_s"]
        r["peak_vs_mb1"] = r["peak_mib"] / base["peak_mib"] if cuda else None
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.teacher_throughput", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model in float32, micro-batches 1 and 4 (any device)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when there is a GPU)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default 1024, tiny 32)")
    ap.add_argument("--micro-batches", help="comma-separated sizes (default 1,2,4,8,16; tiny 1,4)")
    ap.add_argument("--reps", type=int, help="timed forwards per size (default 10, tiny 3)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="untimed forwards per micro-batch size (default 5: after 2, micro-batch 1 on an H100 ran "
                    "slower than micro-batch 2, RESULTS 9.2)")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    config = TINY if args.tiny else ONE_B
    micro_batches = [int(x) for x in (args.micro_batches or ("1,4" if args.tiny else "1,2,4,8,16")).split(",")]
    seq_len = args.seq_len or (32 if args.tiny else 1024)
    reps = args.reps or (3 if args.tiny else 10)
    precision = None if args.tiny else "bf16"
    if not args.tiny and not device.startswith("cuda"):
        print("teacher_throughput: a 1B-class model on the CPU is slow; --tiny is the CPU smoke size")
    rows = measure(config, device, micro_batches, seq_len, reps, args.warmup, precision)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    print(f"teacher {'tiny' if args.tiny else '1B-class'} ({precision or 'float32'}) on {name}, {seq_len} tokens "
          f"per sequence, median of {reps} forwards")
    print(table(["micro-batch", "forward ms", "samples/s", "tokens/s", "vs mb 1", "peak MiB", "peak vs mb 1"],
                [[r["micro_batch"], r["forward_s"] * 1e3, r["samples_per_s"], r["tokens_per_s"],
                  r["throughput_vs_mb1"], r["peak_mib"] if r["peak_mib"] is not None else "-",
                  r["peak_vs_mb1"] if r["peak_vs_mb1"] is not None else "-"] for r in rows]))
    return {"device": name, "seq_len": seq_len, "precision": precision, "rows": rows}


if __name__ == "__main__":
    main()
