"""P2P bandwidth: the runtime's tensor paths (TensorComm over gloo, and over shared memory)
against raw torch.distributed isend/irecv and against memcpy.

Two spawned processes (gloo, world size 2, rendezvous through a TCPStore on 127.0.0.1 port 0).
Rank 0 sends, rank 1 receives. Every repetition runs every case in every mode back to back,
rotating which mode goes first, so machine noise hits all modes alike:

  raw        dist.isend/irecv of preallocated float32 tensors on the default group, then wait;
  raw_fresh  the same, but the receiver allocates new tensors for every message, as the runtime's
             receiver does (p2p.allocate) -- it separates allocation cost from framing cost;
  runtime    the real TensorComm, built as maestro_flow/runtime/worker.py builds it (PULL socket
             from zmq_link.bind, peers' header addresses exchanged through the store, a two-rank
             group from dist.new_group keyed (0, 1, "fwd"), a deliver callback that queues), one
             `send()` per message, measured until the receiver's deliver callback has run;
  shm        the same TensorComm on its shared-memory channel (0, 1, "bwd"), as the runtime uses
             between CPU workers of one host (transport/shm.py): the sender copies each message
             into a reused slot, the receiver is handed views; until the deliver callback ran;
  memcpy     no transfer: the sender copies the burst's messages with torch's copy_ into
             preallocated destinations (one per message, as slots are), single-threaded -- the
             bandwidth one copy of the same bytes has on this machine.

Cases: "one" sends one tensor of SIZE per message; "many" sends 64 per-sample tensors of 16 KiB
per message (the runtime coalesces them into one buffer; raw posts 64 isends). A measurement is a
burst of back-to-back messages (about --burst-bytes in all, 4 to 16 messages: a step's
transfers are streams of messages, so this is the bandwidth that matters), timed from
the sender's first send to the receiver's last completion. Both ends read the same clock
(time.perf_counter is CLOCK_MONOTONIC on Linux, shared by all processes), so no acknowledgement
latency is added to any mode. A barrier on the default group separates measurements. The
runtime/raw ratio is the median of per-repetition ratios (pairs measured side by side).

Knows nothing of sections or plans. Run: python -m tools.bench.p2p_bandwidth [--tiny] [--thp]
"""

from __future__ import annotations

import argparse
import queue
import time
from datetime import timedelta
from typing import Any

from tools.bench.common import GiB, MiB, median, pair_world, quartiles, run_spawned, size_label, table

FULL_SIZES = (64 * 1024, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
TINY_SIZES = (64 * 1024, MiB)
MANY_COUNT, MANY_BYTES = 64, 16 * 1024
MODES = ("raw", "raw_fresh", "runtime", "shm", "memcpy")
MIN_MSGS = 4


def _cases(sizes: tuple[int, ...], burst_bytes: int) -> list[dict[str, Any]]:
    """Every measured case; identical in both ranks (they must agree on the sequence of ops)."""
    cases = []
    for size in sizes:
        n = max(MIN_MSGS, min(16, burst_bytes // size))
        cases.append({"kind": "one", "msg_bytes": size, "tensors": 1, "tensor_bytes": size, "n_msgs": n})
    many = MANY_COUNT * MANY_BYTES
    cases.append({"kind": "many", "msg_bytes": many, "tensors": MANY_COUNT, "tensor_bytes": MANY_BYTES,
                  "n_msgs": max(MIN_MSGS, min(16, burst_bytes // many))})
    return cases


def _schedule(num_cases: int, warmup: int, reps: int) -> list[tuple[int, int, str]]:
    """(repetition, case index, mode); the order of the modes rotates every repetition."""
    out = []
    for rep in range(warmup + reps):
        k = rep % len(MODES)
        order = MODES[k:] + MODES[:k]
        for c in range(num_cases):
            for mode in order:
                out.append((rep, c, mode))
    return out


def _rank_main(rank: int, port: int, cases: list[dict[str, Any]], schedule: list[tuple[int, int, str]],
               timeout_s: float, thp: bool) -> dict[str, Any]:
    import os

    if thp:  # read once by torch's CPU allocator: large allocations get madvise(MADV_HUGEPAGE)
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    import torch
    import torch.distributed as dist

    from maestro_flow.protocol.auth import derive_key
    from maestro_flow.transport.tensor_comm import TensorComm

    torch.set_num_threads(1)  # two processes on a small machine: no intra-op threads fighting gloo
    zctx, pull, peers, timeout = pair_world(rank, port, timeout_s)
    comm = None
    try:
        groups = {(0, 1, "fwd"): dist.new_group([0, 1], timeout=timeout)}
        delivered: queue.Queue = queue.Queue()

        def deliver(kind: str, edge: int, step: int, src: int, items: list) -> None:
            delivered.put((time.perf_counter(), items))

        def on_error(text: str) -> None:
            delivered.put((None, text))

        comm = TensorComm(zctx=zctx, rank=rank, pull=pull, key=derive_key(b"bench", "p2p"), peers=peers, groups=groups,
                          device=torch.device("cpu"), deliver=deliver, on_error=on_error, shm=[(0, 1, "bwd")],
                          shm_prefix=f"maestro-bench-{port}-{rank}")

        # Sender tensors carry the case index (+1) so the receiver can check what it got.
        def fill(c: int, numel: int, j: int = 0) -> torch.Tensor:
            return torch.full((numel,), float(c + 1 + j), dtype=torch.float32)

        bufs: dict[int, list[torch.Tensor]] = {}
        copies: dict[int, list[list[torch.Tensor]]] = {}  # memcpy's destinations, one set per message
        for c, case in enumerate(cases):
            numel = case["tensor_bytes"] // 4
            bufs[c] = [fill(c, numel, j) if rank == 0 else torch.empty(numel) for j in range(case["tensors"])]
            if rank == 0:
                copies[c] = [[torch.zeros(numel) for _ in range(case["tensors"])] for _ in range(case["n_msgs"])]
        stamps: list[float] = []
        ends: list[float] = []  # memcpy's end, taken by the sender
        for _rep, c, mode in schedule:
            case, tensors = cases[c], bufs[c]
            dist.barrier()
            if rank == 0:
                stamps.append(time.perf_counter())
                if mode == "memcpy":
                    for dsts in copies[c]:
                        for d, t in zip(dsts, tensors, strict=True):
                            d.copy_(t)
                    ends.append(time.perf_counter())
                elif mode in ("runtime", "shm"):
                    kind = "fwd" if mode == "runtime" else "bwd"
                    for i in range(case["n_msgs"]):
                        comm.send(1, kind, 0, i, [(i * len(tensors) + j, "x", t) for j, t in enumerate(tensors)])
                else:
                    for _ in range(case["n_msgs"]):
                        works = [dist.isend(t, dst=1) for t in tensors]
                        for w in works:
                            w.wait()
            else:
                if mode == "memcpy":
                    stamps.append(0.0)  # the sender's own end stands
                    continue
                if mode not in ("runtime", "shm"):
                    got = tensors
                    for _ in range(case["n_msgs"]):
                        if mode == "raw_fresh":  # what the runtime's receiver does: new buffers each time
                            got = [torch.empty_like(t) for t in tensors]
                        works = [dist.irecv(t, src=0) for t in got]
                        for w in works:
                            w.wait()
                    stamps.append(time.perf_counter())
                else:
                    for _ in range(case["n_msgs"]):
                        t_end, items = delivered.get(timeout=timeout_s)
                        if t_end is None:
                            raise RuntimeError(f"tensor channel failed:\n{items}")
                    stamps.append(t_end)
                    got = [t for _, _, t in items]
                    del items  # shm: the slot goes back once the check below is done
                # Checked after the clock stopped: first and last element of first and last tensor.
                for j in (0, len(got) - 1):
                    want = float(c + 1 + j)
                    if got[j][0].item() != want or got[j][-1].item() != want:
                        raise RuntimeError(f"case {case} mode {mode}: received wrong data in tensor {j}")
                del got
        dist.barrier()
        return {"stamps": stamps, "ends": ends}
    finally:
        if comm is not None:
            comm.close(timeout_s=2.0)  # its threads close their sockets before the context ends
        zctx.destroy(linger=0)
        dist.destroy_process_group()


def measure(sizes: tuple[int, ...], reps: int, warmup: int, burst_bytes: int, timeout_s: float,
            thp: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    cases = _cases(sizes, burst_bytes)
    schedule = _schedule(len(cases), warmup, reps)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    sender, receiver = run_spawned(_rank_main, [(store.port, cases, schedule, timeout_s, thp)] * 2, timeout_s)
    per: dict[tuple[int, str], list[float]] = {}
    per_msg_us: dict[tuple[int, str], list[float]] = {}
    ends = iter(sender["ends"])
    for (rep, c, mode), t0, t1 in zip(schedule, sender["stamps"], receiver["stamps"], strict=True):
        if mode == "memcpy":
            t1 = next(ends)
        if rep < warmup:
            continue
        case, elapsed = cases[c], max(t1 - t0, 1e-9)
        per.setdefault((c, mode), []).append(case["n_msgs"] * case["msg_bytes"] / GiB / elapsed)
        per_msg_us.setdefault((c, mode), []).append(elapsed / case["n_msgs"] * 1e6)
    results = []
    for c, case in enumerate(cases):
        raw, fresh, rt = per[(c, "raw")], per[(c, "raw_fresh")], per[(c, "runtime")]
        shm, copy = per[(c, "shm")], per[(c, "memcpy")]
        paired = [r / w for r, w in zip(rt, raw, strict=True)]  # same repetition, measured side by side
        shm_copy = [a / b for a, b in zip(shm, copy, strict=True)]
        q1, q3 = quartiles(paired)
        s1, s3 = quartiles(shm_copy)
        results.append({**case, "raw_gibps": median(raw), "raw_fresh_gibps": median(fresh),
                        "shm_gibps": median(shm), "memcpy_gibps": median(copy), "shm_over_memcpy": median(shm_copy),
                        "shm_q1": s1, "shm_q3": s3,
                        "shm_over_raw": median([a / b for a, b in zip(shm, raw, strict=True)]),
                        "runtime_gibps": median(rt), "ratio": median(paired), "ratio_q1": q1, "ratio_q3": q3,
                        "fresh_ratio": median([f / w for f, w in zip(fresh, raw, strict=True)]),
                        "raw_us_per_msg": median(per_msg_us[(c, "raw")]),
                        "runtime_us_per_msg": median(per_msg_us[(c, "runtime")]), "reps": len(raw)})
    return {"cases": results}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.p2p_bandwidth", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size (64 KiB and 1 MiB, few reps)")
    ap.add_argument("--reps", type=int, help="measured repetitions per case and mode (default 40, tiny 5)")
    ap.add_argument("--warmup", type=int, help="repetitions discarded first (default 2, tiny 1)")
    ap.add_argument("--burst-bytes", type=int, default=16 * MiB,
                    help="bytes per measurement (4 to 16 messages)")
    ap.add_argument("--thp", action="store_true",
                    help="let torch's CPU allocator use transparent huge pages (THP_MEM_ALLOC_ENABLE=1) in both ranks")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="bound on the whole measurement")
    args = ap.parse_args(argv)
    sizes = TINY_SIZES if args.tiny else FULL_SIZES
    reps = args.reps or (5 if args.tiny else 40)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    out = measure(sizes, reps, warmup, args.burst_bytes, args.timeout_s, args.thp)
    out.update({"config": {"sizes": list(sizes), "reps": reps, "warmup": warmup, "burst_bytes": args.burst_bytes,
                           "thp": args.thp}})
    rows = []
    for r in out["cases"]:
        what = size_label(r["msg_bytes"]) if r["kind"] == "one" else \
            f"{r['tensors']} x {size_label(r['tensor_bytes'])}"
        rows.append([what, r["n_msgs"], r["raw_gibps"], r["raw_fresh_gibps"], r["runtime_gibps"], r["ratio"],
                     f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}", r["fresh_ratio"], r["raw_us_per_msg"],
                     r["runtime_us_per_msg"]])
    print(f"P2P bandwidth, gloo on loopback, {reps} interleaved repetitions (medians)"
          + (", THP on" if args.thp else ""))
    print(table(["message", "msgs/burst", "raw GiB/s", "raw_fresh GiB/s", "runtime GiB/s", "runtime/raw",
                 "ratio IQR", "raw_fresh/raw", "raw us/msg", "runtime us/msg"], rows))
    print("\nSame-host shared memory (the runtime's path between CPU workers of one host), side by side:")
    print(table(["message", "memcpy GiB/s", "shm GiB/s", "shm/memcpy", "IQR", "gloo raw GiB/s", "shm/gloo raw"],
                [[size_label(r["msg_bytes"]) if r["kind"] == "one" else f"{r['tensors']} x "
                  f"{size_label(r['tensor_bytes'])}", r["memcpy_gibps"], r["shm_gibps"], r["shm_over_memcpy"],
                  f"{r['shm_q1']:.2f}-{r['shm_q3']:.2f}", r["raw_gibps"], r["shm_over_raw"]] for r in out["cases"]]))
    big = [r["ratio"] for r in out["cases"] if r["kind"] == "one" and r["msg_bytes"] >= MiB]
    out["min_ratio_from_1mib"] = min(big) if big else None
    shm = [r["shm_over_memcpy"] for r in out["cases"] if r["kind"] == "one" and r["msg_bytes"] >= MiB]
    out["min_shm_over_memcpy_from_1mib"] = min(shm) if shm else None
    if big:
        print(f"lowest runtime/raw from 1 MiB up: {min(big):.2f} (goal >= 0.9); lowest shm/memcpy from 1 MiB up: "
              f"{min(shm):.2f} (goal >= 0.5)")
    return out


if __name__ == "__main__":
    main()
