"""How the control plane scales: the coordinator's per-step work with 1024 simulated workers,
and startup time against world size.

(a) Per-step handling (`--workers`, default 1024). The real Coordinator (runtime/coordinator.py)
    runs a VLM-shaped job — a trainable encoder section (a quarter of the ranks) feeding an LLM
    section (the rest), so every step has plans, loss reports, `finalize` answers and done
    reports — but its launcher starts no processes: every rank is simulated in one other
    process, one DEALER socket per rank, speaking the real protocol (sealed hello, ready,
    heartbeats every interval, loss and done reports with realistic timings and memory figures,
    bye) and answering each message as soon as it arrives. At every metrics row the CPU time of
    the coordinator's thread (its own work: planning, sealing and sending plans, reading and
    checking reports, the ledger, metrics) and of its whole process (plus ZeroMQ's I/O thread,
    which moves the bytes, and the status thread) is read, never the simulator's; planning is
    timed apart (planner.plan alone), so "handling" = the thread's CPU per step - planning.
    Goal: handling < 50 ms per step at 1024 workers.
(b) Startup (`--startup-sizes`, default 2 4 8 16 32): real runs of a two-section pipeline of tiny
    stages (tests/integration/assets/plain.py: 1 embed replica -> N-1 head replicas), one step;
    the time from `maestro run`'s start until every worker is ready (metrics `startup_s`), with
    same-host channels through shared memory (no channel group) and with MAESTRO_SHM=0 (one gloo
    group per edge and direction); and (c) the creation of the channel groups alone, timed in a
    world of N spawned ranks: one two-rank group per channel and direction (the scheme before
    this one) against the runtime's process_groups (one group per edge and direction, and the
    section groups), every group a world-collective new_group.

Run from the repository root: python -m tools.bench.coordinator_scale [--tiny] [--workers N] [--steps N]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import resource
import time
from typing import Any

from tools.bench.common import median, repo_path, table

GOAL_MS = 50.0


def _simulated_workers(boots: Any, ready: Any, num: int, seed: int) -> None:
    """Every rank of the run in this one process: one DEALER socket each, answering at once."""
    import random

    import zmq

    from maestro_flow.protocol.auth import Opener, Sealer, derive_key
    from maestro_flow.protocol.messages import PROTOCOL_VERSION, make
    from maestro_flow.transport import zmq_link

    rng = random.Random(seed)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, num + 64)
    socks, links, meta = {}, {}, {}
    for _ in range(num):
        boot = boots.get(timeout=60)
        r = boot["rank"]
        key = derive_key(bytes.fromhex(boot["secret"]), boot["session"])
        socks[r] = zmq_link.connect(ctx, zmq.DEALER, boot["coordinator"])
        links[r] = (Sealer(key, f"rank{r}", "coordinator"), Opener(key, f"rank{r}", zmq_link.CONTROL_MAX_BYTES))
        meta[r] = boot
    for r, s in socks.items():
        zmq_link.send_msg(s, make("hello", version=PROTOCOL_VERSION, rank=r, pid=os.getpid(),
                                  data_addr="tcp://127.0.0.1:9", host_key=None), sealer=links[r][0])
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    by_sock = {s: r for r, s in socks.items()}
    loss_ranks: set[int] = set()
    interval = 0.5
    next_beat = time.monotonic() + interval
    ready.put("up")
    left = set(socks)
    while left:
        for sock, _ in poller.poll(50):
            r = by_sock[sock]
            _, msg = zmq_link.open_msg(links[r][1], sock.recv())
            t, send = msg["t"], (lambda m, r=r: zmq_link.send_msg(socks[r], m, sealer=links[r][0]))
            if t == "init":
                section = next(n for n, ranks in msg["placement"]["ranks"].items() if r in ranks)
                if section == "llm":
                    loss_ranks.add(r)
                send(make("ready", rank=r))
            elif t == "plan":
                mbs = msg["micro_batches"]
                tokens = {s[0]: s[3] for s in msg["samples"]}
                timings = [["forward+backward" if r in loss_ranks else "forward", len(mb),
                            sum(tokens[i] for i in mb), 0, 0, 1e-3 * len(mb)] for mb in mbs]
                n = sum(len(mb) for mb in mbs)
                if r in loss_ranks:
                    send(make("loss", rank=r, step=msg["step"], loss_sum=rng.random() * n, denominator=float(n)))
                stats = {"busy_s": 0.01, "wall_s": 0.02, "stage": {}, "micro_batches": len(mbs), "samples": n,
                         "tokens": sum(tokens.values()), "timings": timings, "grad_sq": 1e-3, "lr": 1e-3,
                         "max_rss_kb": 300_000, "memory": {"step_params": 1 << 20, "step_grads": 1 << 20,
                                                           "rest_params": 1 << 20, "rest_grads": 1 << 20,
                                                           "optimizer": 2 << 20, "peak_mb": None},
                         "bytes_sent": 1 << 16, "bytes_received": 1 << 16, "send_s": 1e-4, "recv_s": 1e-4}
                if r not in loss_ranks:  # the encoder waits for the LLM's denominator (finalize) in a real run
                    stats["busy_s"] = 0.005
                send(make("done", rank=r, step=msg["step"], stats=stats))
            elif t == "stop":
                send(make("bye", rank=r))
                left.discard(r)
        now = time.monotonic()
        if now >= next_beat:
            for r in left:
                zmq_link.send_msg(socks[r], make("heartbeat", rank=r), sealer=links[r][0])
            next_beat = now + interval
    for s in socks.values():
        s.close(linger=1000)
    ctx.term()


class _FakeLauncher:
    """The coordinator's launcher, starting nothing: each boot goes to the simulator."""

    def __init__(self, boots: Any) -> None:
        self.boots = boots

    def start(self, rank: int, section: str, replica: int, boot: dict) -> None:
        self.boots.put(boot)

    def dead(self) -> list:
        return []

    def join(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, grace_s: float, kill_grace_s: float) -> None:
        return None


def _pipeline(workers: int, samples_per_replica: int) -> Any:
    from maestro_flow.config import ArrowData, Cost, Edge, Pipeline, Section

    vision = max(1, workers // 4)
    llm = workers - vision
    while llm % vision:  # one dp divides the other (fan-out)
        vision -= 1
        llm = workers - vision
    return Pipeline(name="scale", data=ArrowData(path="unused.arrow"), global_batch=llm * samples_per_replica,
                    steps=1, seed=0, schedule="fifo", sections=[
                        Section(name="vision", stage="x:V", activates_on="image", dp=vision, micro_batch=8,
                                cost=Cost(per_sample_s=1e-3, per_patch_s=1e-5)),
                        Section(name="llm", stage="x:L", dp=llm, micro_batch=4, cost=Cost(per_token_s=1e-5))],
                    edges=[Edge(src="vision", dst="llm", tensors=("e",))])


def per_step(workers: int, steps: int, samples_per_replica: int) -> dict[str, Any]:
    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner import make_planner
    from maestro_flow.runtime.coordinator import Coordinator
    from maestro_flow.runtime.report import RunReport
    from maestro_flow.runtime.sampler import EpochSampler
    from maestro_flow.samples import SampleMeta
    from maestro_flow.timeouts import Timeouts

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * workers + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * workers + 256), hard))
    pipeline = _pipeline(workers, samples_per_replica).override(steps=steps)
    graph = SectionGraph(pipeline)
    text, image = frozenset({"text"}), frozenset({"text", "image"})
    metadata = [SampleMeta(id=i, row=i, modalities=image if i % 3 == 0 else text, num_tokens=200 + i % 300,
                           num_patches=64 if i % 3 == 0 else 0) for i in range(pipeline.global_batch * 4)]
    sampler = EpochSampler(metadata, pipeline.global_batch, 0)
    cpu: list[float] = []
    own: list[float] = []

    class Report(RunReport):
        def step(self, row: dict) -> None:
            cpu.append(time.process_time())
            own.append(time.thread_time())
            super().step(row)

    report = Report(total_steps=steps, metrics_out=None, show_progress=False)
    ctx = mp.get_context("spawn")
    boots, ready = ctx.Queue(), ctx.Queue()
    sim = ctx.Process(target=_simulated_workers, args=(boots, ready, workers, 0), daemon=True)
    sim.start()
    try:
        coordinator = Coordinator(pipeline, graph, sampler, report, paths=[repo_path()],
                                  timeouts=Timeouts(startup_s=300, step_s=300))
        coordinator.launcher = _FakeLauncher(boots)
        t0 = time.perf_counter()
        coordinator.run()
        total_s = time.perf_counter() - t0
        sim.join(30)
    finally:
        if sim.is_alive():
            sim.kill()
            sim.join(5)
    planner = make_planner(pipeline.schedule, graph, search=0.0)  # 1024 workers leave no core for a search
    plan_s = []
    for step in range(min(steps, 5)):
        p0 = time.process_time()
        planner.plan(step, sampler.batch(step))
        plan_s.append(time.process_time() - p0)
    cpu_steps = [b - a for a, b in zip(cpu, cpu[1:], strict=False)][1:]  # steady state: not the first two rows
    own_steps = [b - a for a, b in zip(own, own[1:], strict=False)][1:]
    walls = [r["step_time_s"] for r in report.rows][2:]
    plan_ms = median(plan_s) * 1e3
    return {"workers": workers, "steps": steps, "global_batch": pipeline.global_batch,
            "sections": {s.name: s.dp for s in pipeline.sections}, "cpu_ms_per_step": median(cpu_steps) * 1e3,
            "cpu_ms_p90": sorted(cpu_steps)[max(0, math.ceil(0.9 * len(cpu_steps)) - 1)] * 1e3 if cpu_steps else None,
            "thread_ms_per_step": median(own_steps) * 1e3, "plan_ms": plan_ms,
            "handling_ms": median(own_steps) * 1e3 - plan_ms,
            "wall_ms_per_step": median(walls) * 1e3 if walls else None, "run_s": total_s}


def _groups_rank(rank: int, world: int, port: int) -> dict[str, float]:
    """One rank: join the world, then time creating the channel groups one per channel and
    direction (the scheme before: two ranks each) and as the runtime creates them
    (runtime/topology.process_groups: per edge and direction, plus the section groups)."""
    from datetime import timedelta

    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # as the runtime's workers (runtime/worker.py)
    import torch.distributed as dist

    from maestro_flow.config import ArrowData, Edge, Pipeline, Section
    from maestro_flow.graph import SectionGraph
    from maestro_flow.runtime.coordinator import placement_for
    from maestro_flow.runtime.topology import channels, process_groups

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    pipeline = Pipeline(name="g", data=ArrowData(path="x"), sections=[
        Section(name="embed", stage="x:E", dp=max(1, world // 4)),
        Section(name="head", stage="x:H", dp=world - max(1, world // 4))],
        edges=[Edge(src="embed", dst="head", tensors=("f",))])
    graph = SectionGraph(pipeline)
    placement = placement_for(graph)
    dist.barrier()
    t0 = time.perf_counter()
    for ch in channels(graph, placement):
        dist.new_group(sorted(ch[:2]))
    dist.barrier()
    t1 = time.perf_counter()
    process_groups(graph, placement, rank, 300.0)
    dist.barrier()
    t2 = time.perf_counter()
    dist.destroy_process_group()
    return {"per_channel_s": t1 - t0, "per_edge_s": t2 - t1, "channels": len(channels(graph, placement))}


def groups(sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from tools.bench.common import run_spawned

    out = []
    for world in sizes:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        got = run_spawned(_groups_rank, [(world, store.port)] * world, 600)
        out.append({"world": world, "channels": got[0]["channels"],
                    "per_channel_s": max(g["per_channel_s"] for g in got),
                    "per_edge_s": max(g["per_edge_s"] for g in got)})
    return out


def startup(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    from maestro_flow.runtime.run import RunOptions, run_pipeline
    from tools.bench.common import repo_path as rp

    data = rp("data", "demo", "text.arrow")
    out = []
    for world in sizes:
        for shm in ("1", "0"):
            times = []
            for _ in range(repeats):
                os.environ["MAESTRO_SHM"] = shm
                try:
                    rows = run_pipeline(str(rp("tests", "integration", "assets", "plain.py")), RunOptions(
                        overrides={"steps": 1, "global_batch": 2 * world, "data.path": data,
                                   "sections.head.dp": world - 1}, show_progress=False))
                finally:
                    os.environ.pop("MAESTRO_SHM", None)
                times.append(rows[0]["startup_s"])
            out.append({"world": world, "shm": shm == "1", "startup_s": median(times), "min_s": min(times)})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.coordinator_scale", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size")
    ap.add_argument("--workers", type=int, help="simulated workers (default 1024, tiny 16)")
    ap.add_argument("--steps", type=int, help="steps (default 12, tiny 4)")
    ap.add_argument("--samples-per-replica", type=int, default=4, help="LLM samples per replica per step")
    ap.add_argument("--startup-sizes", type=int, nargs="*", help="world sizes for (b) and (c) (default 2 4 8 16 32, tiny 2)")
    ap.add_argument("--startup-repeats", type=int, help="runs per size and mode (default 2, tiny 1)")
    ap.add_argument("--skip-startup", action="store_true")
    args = ap.parse_args(argv)
    workers = args.workers or (16 if args.tiny else 1024)
    steps = args.steps or (4 if args.tiny else 12)
    out: dict[str, Any] = {"per_step": per_step(workers, steps, args.samples_per_replica)}
    p = out["per_step"]
    print(f"(a) coordinator per step, {workers} simulated workers ({p['sections']}), global batch "
          f"{p['global_batch']}, {steps} steps (medians of the steady state)")
    print(table(["coordinator thread CPU ms/step", "of which planning ms", "handling ms",
                 "process CPU ms/step (+ ZeroMQ I/O)", "p90", "wall ms/step"],
                [[p["thread_ms_per_step"], p["plan_ms"], p["handling_ms"], p["cpu_ms_per_step"], p["cpu_ms_p90"],
                  p["wall_ms_per_step"]]]))
    print(f"handling: {p['handling_ms']:.1f} ms per step (goal < {GOAL_MS:.0f} ms)")
    if not args.skip_startup:
        sizes = tuple(args.startup_sizes or ((2,) if args.tiny else (2, 4, 8, 16, 32)))
        rows = startup(sizes, args.startup_repeats or (1 if args.tiny else 2))
        out["startup"] = rows
        print("\n(b) startup (maestro run until every worker is ready), tests/integration/assets/plain.py, 1 embed "
              "-> N-1 head replicas")
        print(table(["world", "channels via", "startup s (median)", "min s"],
                    [[r["world"], "shared memory" if r["shm"] else "gloo (a group per edge)", r["startup_s"],
                      r["min_s"]] for r in rows]))
        made = groups(sizes)
        out["groups"] = made
        print("\n(c) creating the channel groups alone (world-collective new_group calls; embed dp N/4 -> head, "
              "gradients both ways), the slowest rank")
        print(table(["world", "channels", "a group per channel and direction s", "per edge and direction s (runtime)"],
                    [[g["world"], g["channels"], g["per_channel_s"], g["per_edge_s"]] for g in made]))
    return out


if __name__ == "__main__":
    main()
