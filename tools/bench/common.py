"""Shared pieces of the benchmarks: spawning bounded helper processes, statistics, tables.

Runs in the benchmark's own (parent) process. `run_spawned` starts one process per rank with
multiprocessing's spawn, collects one result (or one error, formatted as text in the child)
per rank under a single deadline, and always terminates/joins what it started, also on error.
Nothing here knows what the children measure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

MiB = 1 << 20
GiB = 1 << 30

# Benchmarks run the repository's own pipelines, so paths resolve from the repository root
# whatever the current directory is.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def repo_path(*parts: str) -> str:
    return os.path.join(REPO_ROOT, *parts)


def turns(items: Sequence[Any], round_index: int) -> list[Any]:
    """The variants of an alternating benchmark in round `round_index`'s order: as given, then
    reversed, and so on, so that going first (a cold cache, a host that speeds up or slows down
    over a round) does not always fall on the same variant."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]


def _child_entry(target: Callable[..., Any], rank: int, args: tuple, results: Any) -> None:
    try:
        out = target(rank, *args)
        results.put(("ok", rank, out))
    except BaseException:  # noqa: BLE001 - the parent must hear about every failure, as text
        results.put(("error", rank, traceback.format_exc()))


def run_spawned(target: Callable[..., Any], args_per_rank: Sequence[tuple], timeout_s: float) -> list[Any]:
    """Run `target(rank, *args)` in one spawned process per rank; return their results by rank.

    Raises RuntimeError with the child's traceback text if a child raised, died, or the deadline
    passed. Every started process is terminated (then killed) and joined before returning.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child_entry, args=(target, rank, args, results), daemon=True,
                         name=f"bench-{getattr(target, '__name__', 'worker')}-{rank}")
             for rank, args in enumerate(args_per_rank)]
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(out) < len(procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(len(procs))) - set(out))
                raise RuntimeError(f"benchmark ranks {missing} gave no result within {timeout_s:.0f}s")
            try:
                status, rank, body = results.get(timeout=min(0.5, remaining))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead:
                    # A result put just before exiting may still be in the pipe: one last look.
                    try:
                        status, rank, body = results.get(timeout=1.0)
                    except queue.Empty:
                        raise RuntimeError(f"benchmark rank {dead[0]} exited with code "
                                           f"{procs[dead[0]].exitcode} without a result") from None
                else:
                    continue
            if status == "error":
                raise RuntimeError(f"benchmark rank {rank} failed:\n{body}")
            out[rank] = body
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        return [out[r] for r in range(len(procs))]
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.join(0.5)
            if p.exitcode is None and p.pid is not None:
                p.terminate()
                p.join(2.0)
            if p.exitcode is None and p.pid is not None:
                p.kill()
                p.join(2.0)
        results.close()
        results.join_thread()


def pair_world(rank: int, port: int, timeout_s: float) -> tuple[Any, Any, dict[int, str], Any]:
    """In a spawned rank of a two-rank transfer benchmark: join the gloo world through the TCPStore
    on 127.0.0.1:`port`, bind this rank's tensor-header socket and learn the peer's, as a worker
    does. Returns (ZeroMQ context, its PULL socket, header address by rank, the default timeout);
    the caller destroys the context and the process group."""
    from datetime import timedelta

    import torch.distributed as dist
    import zmq

    from maestro_flow.transport import zmq_link

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(zmq_link.LOOPBACK, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    zctx = zmq.Context()
    pull, addr = zmq_link.bind(zctx, zmq.PULL)
    store.set(f"bench/data_addr/{rank}", addr)
    return zctx, pull, {r: store.get(f"bench/data_addr/{r}").decode() for r in (0, 1)}, timeout


def pipeline_bench_args(argv: list[str] | None, prog: str, doc: str, *, rounds: int, steps: int, warmup: int,
                        tiny_steps: int, add: Callable[[argparse.ArgumentParser], None] | None = None
                        ) -> tuple[argparse.Namespace, int, int, int, dict[str, Any]]:
    """The options every benchmark that runs a demo pipeline in alternating rounds takes: --tiny,
    --rounds, --steps, --warmup-steps, --set. Returns (args, rounds, steps, warmup, overrides)."""
    from maestro_flow.overrides import parse_set

    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size")
    ap.add_argument("--rounds", type=int, help=f"runs per variant, alternating (default {rounds}, tiny 1)")
    ap.add_argument("--steps", type=int, help=f"steps per run (default {steps}, tiny {tiny_steps})")
    ap.add_argument("--warmup-steps", type=int, help=f"first steps of each run left out (default {warmup}, tiny 1)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="pipeline overrides, as for maestro run --set")
    if add is not None:
        add(ap)
    args = ap.parse_args(argv)
    tiny = args.tiny
    rounds = args.rounds if args.rounds is not None else 1 if tiny else rounds
    steps = args.steps if args.steps is not None else tiny_steps if tiny else steps
    warmup = args.warmup_steps if args.warmup_steps is not None else 1 if tiny else warmup
    # Found in QA: --steps 1 (or 0) ran a whole round, then failed on the median of no steps.
    if rounds < 1:
        ap.error(f"--rounds must be at least 1, got {rounds}")
    if warmup < 0:
        ap.error(f"--warmup-steps must be 0 or more, got {warmup}")
    if steps <= warmup:
        ap.error(f"--steps ({steps}) must be more than the --warmup-steps ({warmup}) left out of each run")
    return args, rounds, steps, warmup, parse_set(args.sets)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """(25th, 75th) percentile; the value itself when there is a single sample."""
    if len(values) < 2:
        return float(values[0]), float(values[0])
    q = statistics.quantiles(values, n=4, method="inclusive")
    return float(q[0]), float(q[2])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def size_label(num_bytes: int) -> str:
    if num_bytes >= MiB and num_bytes % MiB == 0:
        return f"{num_bytes // MiB} MiB"
    return f"{num_bytes // 1024} KiB"
