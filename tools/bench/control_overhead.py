"""Control-plane overhead per micro-batch: ZeroMQ + msgpack cost of the runtime's own messages.

Two parts, run one after the other in one invocation:

  (a) micro-benchmark between two spawned processes on loopback, with the runtime's own
      zmq_link/codec/auth (so `check()`, msgpack and the MAC are included) and its real messages: a "tensors"
      header for an 8-sample micro-batch (entries from p2p.pack), the largest "plan" message of
      the pipeline's first step (ledger.plan_message), and a "done" report. Per message type:
        push_pull   one-way latency PUSH -> PULL (encode, send, poll, recv, decode), one message
                    in flight; both processes read the same CLOCK_MONOTONIC, so no echo is timed;
        round_trip  DEALER -> ROUTER -> DEALER (worker to coordinator and back), halved = one way.
  (b) the real pipeline (pipelines/distill.py, section mode) for N steps via run_pipeline: the
      number of control messages per step is counted from the plans the coordinator sends
      (plan per rank; loss and finalize only where trainable sections upstream of a loss need
      its denominator; done per rank; one tensor header per (micro-batch, destination replica)
      and per gradient return; run-ahead progress messages; heartbeats per rank and interval), each is charged the slower of its two measured one-way costs, and the total
      is divided by the micro-batches of the step and by the median step time of the same run.

The overhead is an upper bound: it treats every control message as if it sat on the critical
path, serially. Knows nothing of tensor payload bytes (see p2p_bandwidth).
Run from the repository root: python -m tools.bench.control_overhead [--tiny] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tools.bench.common import median, repo_path, run_spawned, table

# Which measured message stands for each control message type (loss/finalize/heartbeat are
# smaller than a done report, so charging them the done cost overestimates a little).
CHARGED_AS = {"plan": "plan", "tensors": "tensors", "progress": "done", "loss": "done", "finalize": "done",
              "done": "done",
              "heartbeat": "done"}


# -- realistic messages ------------------------------------------------------------------------

def _tensors_message(num_samples: int = 8, d_model: int = 128) -> dict[str, Any]:
    """The header the teacher sends for one micro-batch: 8 hidden-state tensors of varied length."""
    import torch

    from maestro_flow.protocol.messages import make
    from maestro_flow.transport import p2p

    items = [(1000 + i, "hidden", torch.zeros(40 + 9 * i, d_model)) for i in range(num_samples)]
    entries, specs, _ = p2p.pack(items)
    return make("tensors", src=0, kind="fwd", edge=0, step=17, entries=entries, buffers=specs)


def _plan_messages(pipeline: Any, graph: Any, metadata: list[Any], steps: int) -> tuple[dict[str, Any], list[Any], Any]:
    """(largest plan message of step 0, the plans of every step, placement) as the coordinator makes them."""
    from maestro_flow.planner import make_planner
    from maestro_flow.protocol.codec import encode
    from maestro_flow.runtime.coordinator import placement_for
    from maestro_flow.runtime.ledger import plan_message
    from maestro_flow.runtime.sampler import EpochSampler

    placement = placement_for(graph)
    planner = make_planner(pipeline.schedule, graph, search=0.0)  # as the run on this host: workers fill its cores
    sampler = EpochSampler(metadata, pipeline.global_batch, pipeline.seed)
    plans = [planner.plan(s, sampler.batch(s)) for s in range(steps)]
    messages = [plan_message(plans[0], graph, *placement.who(r)) for r in range(placement.world_size)]
    return max(messages, key=lambda m: len(encode(m))), plans, placement


def _done_message() -> dict[str, Any]:
    from maestro_flow.protocol.messages import make

    stats = {"busy_s": 0.8123, "wall_s": 1.2345, "micro_batches": 8, "samples": 16, "tokens": 1103,
             "max_rss_kb": 371234, "bytes_sent": 662016, "bytes_received": 0, "send_s": 0.0123, "recv_s": 0.0}
    return make("done", rank=1, step=17, stats=stats)


# -- (a) the micro-benchmark, in two processes ---------------------------------------------------

def _micro_rank(rank: int, port: int, messages: dict[str, dict], reps: int, warmup: int,
                timeout_s: float) -> dict[str, Any]:
    """Rank 0 plays the worker (PUSH, DEALER), rank 1 the receiver/coordinator (PULL, ROUTER)."""
    from datetime import timedelta

    import torch.distributed as dist
    import zmq

    from maestro_flow.protocol.auth import Opener, Sealer, derive_key
    from maestro_flow.transport import zmq_link

    store = dist.TCPStore(zmq_link.LOOPBACK, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    zctx = zmq.Context()
    socks: list[zmq.Socket] = []
    wait_ms = int(timeout_s * 1000)

    def recv(sock: zmq.Socket) -> None:
        if not sock.poll(wait_ms):
            raise TimeoutError(f"no control message within {timeout_s:.0f}s")

    # Sealed as the runtime seals them (protocol/auth.py): each direction its own stream.
    key = derive_key(b"control-overhead bench", "session")
    me, peer = f"rank{rank}", f"rank{1 - rank}"
    push_seal, pull_open = Sealer(key, me, f"pull{1 - rank}"), Opener(key, f"pull{rank}", zmq_link.CONTROL_MAX_BYTES)
    dealer_seal, dealer_open = Sealer(key, me, "router"), Opener(key, me, zmq_link.CONTROL_MAX_BYTES)
    router_open, router_seal = Opener(key, "router", zmq_link.CONTROL_MAX_BYTES), Sealer(key, "router", peer)
    try:
        # Each side binds its receiving socket; the other connects (as workers and coordinator do).
        pull, pull_addr = zmq_link.bind(zctx, zmq.PULL)
        socks.append(pull)
        store.set(f"ctl/pull/{rank}", pull_addr)
        push = zmq_link.connect(zctx, zmq.PUSH, store.get(f"ctl/pull/{1 - rank}").decode())
        socks.append(push)
        if rank == 1:
            router, router_addr = zmq_link.bind(zctx, zmq.ROUTER)
            socks.append(router)
            store.set("ctl/router", router_addr)
        else:
            dealer = zmq_link.connect(zctx, zmq.DEALER, store.get("ctl/router").decode())
            socks.append(dealer)
            zmq_link.send_msg(dealer, {"t": "ready", "rank": 0}, sealer=dealer_seal)  # the ROUTER learns us
        if rank == 1:
            recv(router)
            identity, frame = router.recv_multipart()
            zmq_link.open_msg(router_open, frame)
        out: dict[str, Any] = {"push_pull": {}, "round_trip": {}}
        for name, msg in messages.items():
            sent, got, rtts = [], [], []
            for i in range(warmup + reps):
                # One-way PUSH -> PULL; the tiny ack only paces the loop, it is not timed.
                if rank == 0:
                    t0 = time.perf_counter()
                    zmq_link.send_msg(push, msg, sealer=push_seal)
                    recv(pull)
                    zmq_link.open_msg(pull_open, pull.recv())
                    if i >= warmup:
                        sent.append(t0)
                else:
                    recv(pull)
                    zmq_link.open_msg(pull_open, pull.recv())
                    if i >= warmup:
                        got.append(time.perf_counter())
                    zmq_link.send_msg(push, {"t": "ready", "rank": 1}, sealer=push_seal)
            for i in range(warmup + reps):
                # DEALER -> ROUTER -> DEALER, the ROUTER opening and re-sealing what it got.
                if rank == 0:
                    t0 = time.perf_counter()
                    zmq_link.send_msg(dealer, msg, sealer=dealer_seal)
                    recv(dealer)
                    zmq_link.open_msg(dealer_open, dealer.recv())
                    if i >= warmup:
                        rtts.append(time.perf_counter() - t0)
                else:
                    recv(router)
                    identity, frame = router.recv_multipart()
                    _, back = zmq_link.open_msg(router_open, frame)
                    zmq_link.send_msg(router, back, identity=identity, sealer=router_seal)
            out["push_pull"][name] = sent if rank == 0 else got
            out["round_trip"][name] = rtts
        return out
    finally:
        for s in socks:
            s.close(linger=0)
        zctx.term()


def mac_cost_us(messages: dict[str, dict], reps: int) -> dict[str, float]:
    """Sealing and opening one frame (HMAC-SHA256 both ways), in process: the MAC's share of the
    one-way costs above."""
    from maestro_flow.protocol.auth import Opener, Sealer, derive_key
    from maestro_flow.protocol.codec import encode

    key = derive_key(b"control-overhead bench", "mac")
    out = {}
    for name, msg in messages.items():
        payload = encode(msg)
        sealer, opener = Sealer(key, "a", "b"), Opener(key, "b", 1 << 30)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            opener.open(sealer.seal(payload))
            times.append((time.perf_counter() - t0) * 1e6)
        out[name] = median(times)
    return out


def micro_benchmark(messages: dict[str, dict], reps: int, warmup: int, timeout_s: float) -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist

    from maestro_flow.protocol.codec import encode

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    worker, receiver = run_spawned(_micro_rank, [(store.port, messages, reps, warmup, timeout_s)] * 2, timeout_s)
    out = {}
    for name in messages:
        one_way = [(t1 - t0) * 1e6 for t0, t1 in zip(worker["push_pull"][name], receiver["push_pull"][name],
                                                       strict=True)]
        rtt = [r * 1e6 for r in worker["round_trip"][name]]
        out[name] = {"bytes": len(encode(messages[name])), "push_pull_us": median(one_way),
                     "round_trip_us": median(rtt), "one_way_us": max(median(one_way), median(rtt) / 2)}
    return out


# -- (b) the pipeline --------------------------------------------------------------------------

def count_messages(plans: list[Any], graph: Any, placement: Any, heartbeat_interval_s: float,
                   step_time_s: float) -> dict[str, float]:
    """Control messages per step (averaged over the plans), by type, and micro-batches per step."""
    world = placement.world_size
    # A loss section sums its denominators with its gradients; it reports its loss to the
    # coordinator (which sends the denominator on) only when trainable sections upstream need it.
    upstream = {L: [n for n in graph.order if n != L and graph.sections[n].trainable
                    and graph.loss_sections_of(n) == [L]] for L in graph.loss_sections()}
    loss_replicas = sum(placement.dp(L) for L, ups in upstream.items() if ups)
    finalize = sum(placement.dp(n) for ups in upstream.values() for n in ups)
    headers = micro_batches = progress = 0
    for plan in plans:
        for name in graph.order:  # run-ahead credits: a gated producer hears of each consumer forward
            for r in range(placement.dp(name)):
                gated_by = {(c, ci) for mb in plan.gates_of(name, r) for c, ci, _ in mb}
                progress += sum(len(plan.micro_batches(c, ci)) for c, ci in gated_by)
        mod = {s.id: s.modalities for s in plan.samples}
        for name in graph.order:
            micro_batches += sum(len(plan.micro_batches(name, r)) for r in range(placement.dp(name)))
        for e in graph.edges:
            src, dst = graph.sections[e.edge.src], graph.sections[e.edge.dst]
            for p in range(e.src_dp):  # forward: one header per (micro-batch, consumer replica)
                for mb in plan.micro_batches(src.name, p):
                    headers += len({plan.routes[dst.name][s] for s in mb if dst.activates(mod[s])})
            if e.carries_grad:  # backward: one header per (consumer micro-batch, producer replica)
                for c in range(e.dst_dp):
                    for mb in plan.micro_batches(dst.name, c):
                        headers += len({plan.routes[src.name][s] for s in mb if src.activates(mod[s])})
    n = len(plans)
    return {"plan": world, "tensors": headers / n, "progress": progress / n, "loss": loss_replicas,
            "finalize": finalize, "done": world,
            "heartbeat": world * step_time_s / heartbeat_interval_s, "micro_batches": micro_batches / n}


def pipeline_overhead(path: str, overrides: dict[str, Any], costs_us: dict[str, float],
                      plans: list[Any], graph: Any, placement: Any) -> dict[str, Any]:
    from maestro_flow.runtime.run import RunOptions, run_pipeline
    from maestro_flow.timeouts import Timeouts

    t0 = time.monotonic()
    # Costs fixed (adapt_costs off): the run plans exactly the plans counted here.
    rows = run_pipeline(path, RunOptions(overrides={**overrides, "adapt_costs": False}, show_progress=False))
    wall_s = time.monotonic() - t0
    timed = rows[1:] if len(rows) > 2 else rows  # step 0 pays one-off warm-up (allocator, lazy init)
    step_time_s = median([r["step_time_s"] for r in timed])
    counts = count_messages(plans, graph, placement, Timeouts.from_env().heartbeat_interval_s, step_time_s)
    mbs = counts.pop("micro_batches")
    # A mean, as the counted figure is (plans may differ from step to step): equal where every
    # planned micro-batch ran.
    measured = [sum(s["micro_batches"] for s in r["sections"].values()) for r in rows]
    measured_mbs = sum(measured) / len(measured)
    cost = {t: c * costs_us[CHARGED_AS[t]] for t, c in counts.items()}
    per_step_us = sum(cost.values())
    return {"steps": len(rows), "run_wall_s": wall_s, "median_step_time_s": step_time_s,
            "micro_batches_per_step": mbs, "micro_batches_per_step_measured": measured_mbs,
            "messages_per_step": counts, "messages_per_step_total": sum(counts.values()),
            "messages_per_micro_batch": sum(counts.values()) / mbs,
            "overhead_per_step_us": per_step_us, "overhead_per_micro_batch_us": per_step_us / mbs,
            "overhead_fraction_of_step": per_step_us * 1e-6 / step_time_s}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.control_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size (3 steps, few repetitions)")
    ap.add_argument("--steps", type=int, help="pipeline steps (default 12, tiny 3)")
    ap.add_argument("--reps", type=int, help="micro-benchmark repetitions per message and pattern (default 2000, tiny 100)")
    ap.add_argument("--pipeline", default=repo_path("pipelines", "distill.py"), help="pipeline file")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="pipeline override, as `maestro run --set` (repeatable)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="bound on the micro-benchmark")
    args = ap.parse_args(argv)

    from maestro_flow.overrides import parse_set
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.checks import check_pipeline

    steps = args.steps or (3 if args.tiny else 12)
    reps = args.reps or (100 if args.tiny else 2000)
    overrides = {**parse_set(args.sets), "steps": steps}
    pipeline, _ = load_pipeline(args.pipeline, overrides)
    checked = check_pipeline(pipeline)
    graph = checked.graph
    plan_msg, plans, placement = _plan_messages(pipeline, graph, checked.metadata, steps)
    messages = {"tensors": _tensors_message(), "plan": plan_msg, "done": _done_message()}

    micro = micro_benchmark(messages, reps, warmup=max(10, reps // 20), timeout_s=args.timeout_s)
    mac = mac_cost_us(messages, reps)
    for name in micro:
        micro[name]["mac_us"] = mac[name]
    print(f"(a) control messages over ZeroMQ + msgpack, sealed (HMAC-SHA256) as the runtime sends them, two "
          f"processes on loopback, {reps} repetitions (medians)")
    print(table(["message", "bytes", "PUSH->PULL one-way us", "DEALER<->ROUTER round trip us", "charged one-way us",
                 "seal+open us"],
                [[k, v["bytes"], v["push_pull_us"], v["round_trip_us"], v["one_way_us"], v["mac_us"]]
                 for k, v in micro.items()]))

    costs = {k: v["one_way_us"] for k, v in micro.items()}
    pipe = pipeline_overhead(args.pipeline, overrides, costs, plans, graph, placement)
    print(f"\n(b) {pipeline.name}: {pipe['steps']} steps in section mode, median step {pipe['median_step_time_s']:.3f} s, "
          f"{pipe['micro_batches_per_step']:.1f} micro-batches per step (metrics rows: "
          f"{pipe['micro_batches_per_step_measured']:.1f})")
    per = pipe["messages_per_step"]
    print(table(["message", "per step", "charged us each", "us per step"],
                [[t, c, costs[CHARGED_AS[t]], c * costs[CHARGED_AS[t]]] for t, c in per.items()]))
    print(f"control messages per micro-batch: {pipe['messages_per_micro_batch']:.2f}")
    print(f"overhead per micro-batch: {pipe['overhead_per_micro_batch_us']:.0f} us (goal < 1000 us)")
    print(f"overhead per step: {pipe['overhead_per_step_us'] / 1000:.2f} ms = "
          f"{100 * pipe['overhead_fraction_of_step']:.3f}% of the median step time (goal < 2%)")
    return {"micro": micro, "pipeline": pipe,
            "goals": {"per_micro_batch_under_1ms": pipe["overhead_per_micro_batch_us"] < 1000,
                      "under_2pct_of_step": pipe["overhead_fraction_of_step"] < 0.02},
            "config": {"steps": steps, "reps": reps, "overrides": overrides, "pipeline": args.pipeline}}


if __name__ == "__main__":
    main()
