"""Which host cores each CPU worker may run on (`maestro run --pin-cpus`), and whether the
coordinator has one to spare for the planner's search (`search_share`).

Pure (standard library only). The cores are those the `maestro run` process may use (so
`taskset -c 0-7 maestro run ...` gives the job eight cores). With at most as many CPU workers
as cores, each worker gets its own contiguous block of cores (blocks differ by at most one core
in size); with more workers than cores, a core cannot be anyone's own, so every worker may run
on all of them and the kernel shares them. A pinned worker runs as many torch threads as it has
cores of its own (`threads`). `env_threads` reads MAESTRO_WORKER_THREADS, which overrides it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

THREADS_ENV = "MAESTRO_WORKER_THREADS"  # torch threads of every CPU worker (0 or unset: the default)


def env_threads() -> int:
    """MAESTRO_WORKER_THREADS, checked (ValueError naming it): 0 where unset."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw and not (raw.isascii() and raw.isdigit()):  # "²" is a digit to str.isdigit, not to int()
        raise ValueError(f"{THREADS_ENV} must be a whole number of torch threads per worker (0 or unset: the "
                         f"default), got {raw!r}")
    return int(raw or 0)


def cpu_shares(num_workers: int, cores: Sequence[int]) -> list[tuple[int, ...]]:
    """One tuple of cores per CPU worker, in worker order."""
    cores = sorted(cores)
    if num_workers <= 0:
        return []
    if num_workers > len(cores):
        return [tuple(cores)] * num_workers
    return [tuple(cores[i * len(cores) // num_workers:(i + 1) * len(cores) // num_workers])
            for i in range(num_workers)]


def threads(num_workers: int, cores: Sequence[int], share: Sequence[int] | None = None) -> int:
    """torch threads of a pinned worker: the cores of its own `share` (cpu_shares'; blocks may differ
    by one core), or, with more workers than cores (or no share given), its part of the cores
    they all share."""
    if share is not None and num_workers <= len(cores):
        return max(1, len(share))
    return max(1, len(cores) // max(1, num_workers))


def search_share(plan_search: float, lookahead_steps: int, workers: int, cores: int) -> float:
    """The share of each step the planner's search may take in a run (Pipeline.plan_search,
    planner/refine.py): the pipeline's, or 0 where it would take time from training — plans not
    made ahead of their step (lookahead_steps=0), or `workers` on the coordinator's node (each
    keeps a core busy, a GPU worker too) that fill its `cores` (the coordinator would search on a
    worker's core). The coordinator also plans step 0, which the workers wait for, with the rules
    alone."""
    if lookahead_steps == 0 or workers >= cores:
        return 0.0
    return plan_search


def pipeline_search(pipeline, workers: int, cores: int) -> float:
    """search_share of a pipeline (its `plan_search`, for the wavefront only), `workers` of it on
    the coordinator's node: what a run plans with (the coordinator) and what `maestro plan` shows."""
    return search_share(pipeline.plan_search if pipeline.schedule == "wavefront" else 0.0,
                        pipeline.lookahead_steps, workers, cores)


def pinned(cpu_ranks: Sequence[int], cores: Sequence[int]) -> dict[int, dict[str, object]]:
    """The boot fields of each of one node's CPU workers under --pin-cpus: its cores and torch
    threads (node 0's coordinator and the other nodes' agents each for their own ranks)."""
    cores = sorted(cores)
    return {r: {"cpus": list(share), "threads": threads(len(cpu_ranks), cores, share)}
            for r, share in zip(cpu_ranks, cpu_shares(len(cpu_ranks), cores), strict=True)}
