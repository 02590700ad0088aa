"""CUDA IPC between two workers on one GPU (transport/cuda_ipc.py) against a device-to-device copy
of the same bytes, and against the path it replaces (gloo, staged through host memory).

Two spawned processes on cuda:0 (a gloo world of 2 for barriers, rendezvous through a TCPStore
on 127.0.0.1 port 0). Rank 0 sends, rank 1 receives. Every repetition runs every size in every
mode back to back, rotating which mode goes first:

  copy    no transfer: rank 0 copies the burst's messages with copy_ into preallocated device
          destinations (one per message, as slots are) and synchronizes -- one copy of the bytes;
  ipc     the real TensorComm on a CUDA IPC channel (0, 1, "fwd"), one `send()` per message;
          timed until rank 1's deliver callback ran for the last one and its stream is past the
          sender's copy (torch.cuda.current_stream().synchronize()); the receiver waits on the
          device (its stream waits for the sender's event: the default);
  ipc-host  the same, the receiver's header thread waiting for the sender's event on the host
          instead (MAESTRO_CUDA_IPC_WAIT=host), so no work of its CUDA context waits on the
          sender's: whether two contexts taking turns on one GPU cost the ~100 µs a message;
  staged  the same TensorComm on a gloo channel (0, 1, "bwd") with CUDA tensors: what ranks
          sharing a GPU used before CUDA IPC (device -> pinned host -> gloo -> host -> device).

A measurement is a burst of back-to-back messages (about --burst-bytes, 4 to 16 messages or --max-messages),
timed from the sender's first send to the receiver's end on the shared monotonic clock. Goal
(issue 8): ipc >= 0.8x copy from 16 MiB (median of the per-repetition ratios; the better of the
two waits). Where an IPC burst's time goes (a second table): the sender's own time per message
(its Python, the copy's launch, sealing and sending the header), when the first message was
delivered, how far the last delivery trailed the sender's last send, and how long the receiver's
stream took after the last delivery (the device catching up). With --profile, the sender's
sends of the last repetition's ipc bursts (device wait) run under cProfile and the functions
taking most of their time are printed, per send over every size measured (give one --sizes to
see one size): where the sender's own time per message goes (that
repetition's ipc figures then carry the profiler's cost; the tables' medians hardly move).
NCCL against raw NCCL needs two GPUs; this benchmark does not measure it.

Without CUDA it prints that and returns {"skipped": ...}. Run from the repository root:
python -m tools.bench.cuda_ipc [--tiny] [--reps N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import queue
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from tools.bench.common import GiB, MiB, median, pair_world, run_spawned, size_label, table

FULL_SIZES = (MiB, 16 * MiB, 64 * MiB, 256 * MiB)
TINY_SIZES = (MiB,)
MODES = ("copy", "ipc", "ipc-host", "staged")
GOAL, GOAL_FROM = 0.8, 16 * MiB


def _rank_main(rank: int, port: int, sizes: list[int], burst_bytes: int, max_msgs: int,
               schedule: list[tuple[int, int, str]], timeout_s: float, profile_rep: int = -1) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from maestro_flow.protocol.auth import derive_key
    from maestro_flow.transport.tensor_comm import TensorComm

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    zctx, pull, peers, timeout = pair_world(rank, port, timeout_s)
    comm = None
    try:
        groups = {(0, 1, kind): dist.new_group([0, 1], timeout=timeout) for kind in ("fwd", "bwd")}
        delivered: queue.Queue = queue.Queue()

        errors: list[str] = []

        def on_error(text: str) -> None:
            errors.append(text)
            delivered.put((None, text))

        comm = TensorComm(zctx=zctx, rank=rank, pull=pull, key=derive_key(b"bench", "cuda-ipc"), peers=peers,
                          groups=groups, device=device, deliver=lambda *a: delivered.put((time.perf_counter(), a[-1])),
                          on_error=on_error, ipc=[(0, 1, "fwd")])
        n_msgs = {s: max(4, min(max_msgs, burst_bytes // s)) for s in sizes}
        src = {s: torch.full((s // 4,), float(i + 1), device=device) for i, s in enumerate(sizes)}
        dsts = {s: [torch.empty_like(src[s]) for _ in range(n_msgs[s])] for s in sizes} if rank == 0 else {}
        stamps: list[float] = []
        prof = cProfile.Profile() if rank == 0 and profile_rep >= 0 else None
        profiled_sends = 0
        for rep, i, mode in schedule:
            size = sizes[i]
            if rank == 1:  # before the barrier: the header thread reads it for the burst's first message
                comm._ipc_mapped.wait = "host" if mode == "ipc-host" else "device"
            torch.cuda.synchronize()
            dist.barrier()
            if rank == 0:
                stamps.append(time.perf_counter())
                if mode == "copy":
                    for d in dsts[size]:
                        d.copy_(src[size])
                    torch.cuda.synchronize()
                    stamps.append(time.perf_counter())
                else:
                    profiled = prof is not None and rep == profile_rep and mode == "ipc"
                    if profiled:
                        prof.enable()
                    for m in range(n_msgs[size]):
                        comm.send(1, "bwd" if mode == "staged" else "fwd", 0, m, [(m, "x", src[size])])
                    if profiled:
                        prof.disable()
                        profiled_sends += n_msgs[size]
                    stamps.append(time.perf_counter())  # the sender's part; the receiver's end stands for the burst
            else:
                if mode == "copy":
                    continue
                items, got_at = None, []
                for _ in range(n_msgs[size]):
                    t_end, items = delivered.get(timeout=timeout_s)
                    if t_end is None:
                        raise RuntimeError(f"tensor channel failed:\n{items}")
                    got_at.append(t_end)
                torch.cuda.current_stream().synchronize()  # the bytes are there, not only the header
                # first and last delivery (the deliver callback, on the header thread), then the end
                stamps.extend((got_at[0], got_at[-1], time.perf_counter()))
                got = items[0][2]
                if got[0].item() != float(i + 1) or got[-1].item() != float(i + 1):
                    raise RuntimeError(f"{mode} {size_label(size)}: received wrong data")
                del items, got
                comm.reap()  # the slots go back now (views gone, stream past them), before the next burst
        dist.barrier()
        if errors:
            raise RuntimeError(f"rank {rank}'s tensor channel failed:\n{errors[0]}")
        made = comm._ipc_slots._count if rank == 0 else 0  # device slots the sender made in all
        return {"stamps": stamps, "n_msgs": n_msgs, "slots_made": made,
                "profile": _top(prof, profiled_sends) if prof else None}
    finally:
        if comm is not None:
            comm.close(timeout_s=2.0)
        zctx.destroy(linger=0)
        dist.destroy_process_group()


def _top(prof: cProfile.Profile, sends: int, lines: int = 25) -> str:
    """The profiled functions, the heaviest own time first, in µs per send (pstats rounds to
    milliseconds, too coarse for a send of tens of µs)."""
    stats = pstats.Stats(prof, stream=io.StringIO()).stats  # (file, line, name) -> (calls, calls, own, total, _)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:lines]
    out = [f"{sends} sends; µs per send (own, with callees); calls per send; function"]
    for (file, line, name), (_cc, calls, own, total, _callers) in rows:
        where = name if file == "~" else f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})"
        out.append(f"{own / sends * 1e6:8.2f} {total / sends * 1e6:8.2f} {calls / sends:5.1f}  {where}")
    return "\n".join(out)


def schedule_for(n_sizes: int, reps: int, warmup: int) -> list[tuple[int, int, str]]:
    """(repetition, size index, mode) in the order run: every size in every mode back to back,
    the first mode rotating with the repetition."""
    schedule = []
    for rep in range(warmup + reps):
        k = rep % len(MODES)
        for i in range(n_sizes):
            for mode in MODES[k:] + MODES[:k]:
                schedule.append((rep, i, mode))
    return schedule


def measure(sizes: tuple[int, ...], reps: int, warmup: int, burst_bytes: int, timeout_s: float,
            max_msgs: int = 16, profile: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    schedule = schedule_for(len(sizes), reps, warmup)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    profile_rep = warmup + reps - 1 if profile else -1
    sender, receiver = run_spawned(_rank_main, [(store.port, list(sizes), burst_bytes, max_msgs, schedule, timeout_s,
                                                 profile_rep)] * 2, timeout_s)
    out = summarize(sizes, schedule, warmup, sender, receiver)
    out["profile"] = sender.get("profile")
    return out


def summarize(sizes: Sequence[int], schedule: list[tuple[int, int, str]], warmup: int, sender: dict[str, Any],
              receiver: dict[str, Any]) -> dict[str, Any]:
    """Bandwidths and ratios per size and mode from the two ranks' stamps (medians over the
    measured repetitions), and where an IPC burst's time goes, in µs: the sender's own time per
    message, the first delivery after the first send, the last delivery after the sender's last
    send returned, and the device wait after the last delivery (the receiver's stream catching up)."""
    recv = iter(receiver["stamps"])
    send = iter(sender["stamps"])
    per: dict[tuple[int, str], list[float]] = {}
    parts: dict[tuple[int, str], dict[str, list[float]]] = {}
    for rep, i, mode in schedule:
        t0, t_sent = next(send), next(send)
        first = last = t1 = t_sent
        if mode != "copy":
            first, last, t1 = next(recv), next(recv), next(recv)
        if rep >= warmup:
            n = sender["n_msgs"][sizes[i]]
            per.setdefault((i, mode), []).append(n * sizes[i] / GiB / max(t1 - t0, 1e-9))
            got = parts.setdefault((i, mode), {"send_us": [], "first_us": [], "behind_us": [], "device_us": []})
            for key, value in (("send_us", (t_sent - t0) / n), ("first_us", first - t0), ("behind_us", last - t_sent),
                               ("device_us", t1 - last)):
                got[key].append(value * 1e6)
    out = []
    for i, size in enumerate(sizes):
        copy, staged = per[(i, "copy")], per[(i, "staged")]
        case = {"bytes": size, "copy_gibps": median(copy), "staged_gibps": median(staged)}
        for mode in ("ipc", "ipc-host"):
            key = mode.replace("-", "_")
            got = per[(i, mode)]
            case[f"{key}_gibps"] = median(got)
            case[f"{key}_over_copy"] = median([a / b for a, b in zip(got, copy, strict=True)])
            case[f"{key}_over_staged"] = median([a / b for a, b in zip(got, staged, strict=True)])
            for part, values in parts[(i, mode)].items():
                case[f"{key}_{part}"] = median(values)
        out.append(case)
    return {"cases": out, "slots_made": sender["slots_made"]}


def report(out: dict[str, Any], device: str, reps: int) -> None:
    """Print the tables and the goal's verdict (sets out["goal_met"])."""
    rows = [[size_label(c["bytes"]), c["copy_gibps"], c["ipc_gibps"], c["ipc_host_gibps"], c["staged_gibps"],
             c["ipc_over_copy"], c["ipc_host_over_copy"], c["ipc_over_staged"]] for c in out["cases"]]
    where = [[size_label(c["bytes"]), wait] + [c[f"{key}_{part}"] for part in ("send_us", "first_us", "behind_us",
                                                                              "device_us")]
             for c in out["cases"] for wait, key in (("device", "ipc"), ("host", "ipc_host"))]
    print(f"{device}; {reps} repetitions; medians; the sender made {out['slots_made']} "
          f"device slots in all (reused after the first burst of each size when releases keep up)")
    print(table(["message", "copy GiB/s", "ipc GiB/s", "ipc-host GiB/s", "staged GiB/s", "ipc/copy",
                 "ipc-host/copy", "ipc/staged"], rows))
    print("Where an IPC burst's time goes (µs, medians): the sender's own time per message; the first "
          "delivery after the first send; the last delivery after the sender's last send returned; the "
          "receiver's stream after the last delivery")
    print(table(["message", "receiver waits on", "send per msg", "first delivered", "last behind sender",
                 "device after last"], where))
    if out.get("profile"):
        print("The sender's sends in the last repetition's ipc bursts (device wait), under cProfile, by own time:")
        print(out["profile"])
    judged = [c for c in out["cases"] if c["bytes"] >= GOAL_FROM]
    out["goal_met"] = bool(judged) and all(max(c["ipc_over_copy"], c["ipc_host_over_copy"]) >= GOAL for c in judged)
    if judged:
        print(f"goal ipc >= {GOAL}x copy from {size_label(GOAL_FROM)} (the better wait): "
              f"{'met' if out['goal_met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.cuda_ipc", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="smoke size (1 MiB, few repetitions)")
    ap.add_argument("--reps", type=int, help="measured repetitions (default 20, tiny 3)")
    ap.add_argument("--burst-bytes", type=int, default=256 * MiB,
                    help="bytes per measurement (4 to --max-messages messages)")
    ap.add_argument("--max-messages", type=int, default=16, choices=range(4, 1025), metavar="4..1024",
                    help="most messages per measurement (default 16; more measures a longer steady run of sends)")
    ap.add_argument("--sizes", help="comma-separated message sizes in MiB (default 1,16,64,256)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--profile", action="store_true",
                    help="profile the sender's sends of the last repetition's ipc bursts (cProfile; prints the top)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("cuda_ipc: skipped, no CUDA device here (the CUDA IPC path needs one GPU)")
        return {"skipped": "no CUDA device"}
    sizes = TINY_SIZES if args.tiny else FULL_SIZES
    if args.sizes:
        sizes = tuple(int(float(x) * MiB) for x in args.sizes.split(","))
    reps = args.reps or (3 if args.tiny else 20)
    out = measure(sizes, reps, 1, MiB * 4 if args.tiny else args.burst_bytes, args.timeout_s, args.max_messages,
                  args.profile)
    report(out, torch.cuda.get_device_name(0), reps)
    return out


if __name__ == "__main__":
    main()
