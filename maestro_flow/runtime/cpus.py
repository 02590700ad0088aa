"""Which host cores each CPU worker may run on (`maestro run --pin-cpus`), which ones the
coordinator (`CoordinatorCores`, in the coordinator's process) and a busiest section's message
threads (`IoThreads`, in each worker) run on then, and whether the coordinator has one to spare
for the planner's search (`search_share`).

Standard library only. The cores are those the `maestro run` process may use (so
`taskset -c 0-7 maestro run ...` gives the job eight cores). With at most as many CPU workers
as cores, each worker gets its own contiguous block of cores (blocks differ by at most one core
in size); with more workers than cores, a core cannot be anyone's own, so every worker may run
on all of them and the kernel shares them. A pinned worker runs as many torch threads as it has
cores of its own (`threads`). `env_threads` reads MAESTRO_WORKER_THREADS, which overrides it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maestro_flow.planner.plan import Placement

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


SPARE_BELOW = 0.9  # a section whose replicas were busy under this share of the busiest one's leaves its cores spare
STAY_BELOW = 0.8  # ... or under this share, where it was near the busiest the step before (hysteresis)


def near_busiest(busy: Mapping[str, float], stay: Collection[str] = ()) -> set[str]:
    """The sections busy (`busy`: seconds per replica) at least SPARE_BELOW of the busiest one's in
    a step, or at least STAY_BELOW for those in `stay` (near it the step before: a section that
    hovers about the line does not move the cores every step); none where nothing was busy."""
    top = max(busy.values(), default=0.0)
    if top <= 0.0:
        return set()
    return {n for n, b in busy.items() if b >= (STAY_BELOW if n in stay else SPARE_BELOW) * top}


def spare_cores(busy: Mapping[str, float], cores_of: Mapping[str, Collection[int]],
                stay: Collection[str] = ()) -> tuple[int, ...]:
    """The cores of the sections that were not near the busiest in a step (near_busiest, `stay`
    passed on; `cores_of`: the cores of each section's pinned workers), less any that a
    near-busiest section's workers also use; () where there are none."""
    return _left_over(near_busiest(busy, stay), busy, cores_of)


def _left_over(near: Collection[str], sections: Collection[str],
               cores_of: Mapping[str, Collection[int]]) -> tuple[int, ...]:
    """The cores of `sections` not in `near`, less those of `near`'s (spare_cores' rule)."""
    if not near:
        return ()
    taken = {c for n in near for c in cores_of.get(n, ())}
    return tuple(sorted({c for n in sections if n not in near for c in cores_of.get(n, ())} - taken))


def move_threads(cores: Sequence[int], which: Callable[[int, str], bool] = lambda tid, name: True) -> list[str]:
    """Every thread of this process that `which` (thread id, name) picks, on `cores` (threads
    started later inherit their starter's). A thread that ends meanwhile is passed over; one that
    cannot be moved (cores outside this process's cpuset, no permission) is returned, with why."""
    failed = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if which(int(tid), name):
                os.sched_setaffinity(int(tid), cores)
        except (FileNotFoundError, ProcessLookupError):  # it ended
            pass
        except OSError as exc:
            failed.append(f"thread {tid}: {exc.strerror or exc}")
    return failed


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def say_unmoved(failed: list[str], cores: Sequence[int], said: bool, say: Callable[[str], None] = _to_stderr) -> bool:
    """A failure to move threads (move_threads'), said with `say` unless one was `said` before by
    the same mover (an IoThreads, a CoordinatorCores); whether one has been said now. The run goes
    on, with those threads where they were."""
    if failed and not said:
        say(f"--pin-cpus: could not move {len(failed)} thread(s) to cores {list(cores)} ({failed[0]}; cores outside "
            f"this process's cpuset?); they stay where they were, and later failures are not reported")
    return said or bool(failed)


class CoordinatorCores:
    """Runs in the coordinator, on its main thread, with `maestro run --pin-cpus`: the
    coordinator's process (its planning, its message handling, every thread) kept off the cores of
    the step's busiest section, on those of the sections with time to spare (spare_cores, chosen
    again after every step from its busy times, with hysteresis: near_busiest's `stay`); on all
    the run's cores where no section has any. The first step it is given (an attempt's first, with
    its one-time costs) moves nothing, nor does a step with no work. It also names those spare
    cores in the plans of the busiest section's CPU workers on this node, for their message
    threads (IoThreads); plans made ahead (lookahead_steps) carry the choice of the step before
    they were made. Without --pin-cpus (`pinned` empty) nothing moves. `say` tells the user where
    threads could not be moved (once per attempt)."""

    def __init__(self, cores_of: Mapping[str, Collection[int]], replicas: Mapping[str, int],
                 pinned: Collection[int] = (), say: Callable[[str], None] | None = None) -> None:
        self.cores_of, self.replicas, self.pinned = cores_of, replicas, frozenset(pinned)
        self.everywhere = self.now = tuple(sorted(os.sched_getaffinity(0)))
        self.spare: tuple[int, ...] = ()
        self.near: set[str] = set()  # near the busiest in the last step (hysteresis)
        self.busiest: set[str] = set()
        self.steps = 0
        self.said = False
        self.say = say or _to_stderr

    @classmethod
    def of(cls, pinned: Mapping[int, Mapping[str, Any]], placement: Placement,
           say: Callable[[str], None] | None = None) -> CoordinatorCores:
        """From `pinned`'s boot fields (rank -> its cores) and the run's Placement."""
        cores_of: dict[str, set[int]] = {n: set() for n in placement.ranks}
        for rank, boot in pinned.items():
            cores_of[placement.who(rank)[0]].update(boot["cpus"])
        return cls(cores_of, {n: len(ranks) for n, ranks in placement.ranks.items()}, pinned.keys(), say)

    def step(self, sections: Mapping[str, Mapping[str, float]]) -> None:
        """Re-place after a step, from its metrics row's `sections`."""
        self.steps += 1
        if self.steps == 1 or not self.pinned:
            return
        busy = {n: sections[n]["busy_s"] / self.replicas[n] for n in self.cores_of}
        if not any(busy.values()):  # a step with no work tells nothing: everything stays as it is
            return
        self.near = near_busiest(busy, self.near)  # (the last step's memory in, this one's out)
        self.spare = _left_over(self.near, busy, self.cores_of)
        self.busiest = self.near if self.spare else set()
        self._place(self.spare or self.everywhere)

    def io_cpus(self, section: str, rank: int) -> list[int] | None:
        """Where worker `rank` of `section` runs its message threads (IoThreads), for its plans: on
        the spare cores where its section was among the busiest in the last step and it is one of
        the pinned workers (this node's CPU workers: another node's cores are not these), else
        (None) on its own."""
        return list(self.spare) if section in self.busiest and rank in self.pinned else None

    def restore(self) -> None:
        """Every thread back on the cores this process had when it was made."""
        self._place(self.everywhere)

    def _place(self, cores: tuple[int, ...]) -> None:
        if cores != self.now:
            self.said = say_unmoved(move_threads(cores), cores, self.said, self.say)
            self.now = cores


class IoThreads:
    """Runs in each worker, on its compute thread. The worker's message threads, by name
    (`PYTHON`: its control, output and watchdog threads, its tensor channels' header and
    send/receive threads, the runtime's `maestro-*` threads; `NATIVE`: ZeroMQ's background
    threads), on the cores its plans name (`io_cpus`: CoordinatorCores.io_cpus) or, where they
    name none, on the worker's own. Not its compute thread, torch's threads (gloo's, which run
    collectives a step waits on, and OpenMP's), a tensor-parallel relay's threads, nor a stage's
    own (unless it names them with one of those prefixes). A busiest
    section's worker so leaves its own cores to its compute: in the VLM at 33% images, the LLM's
    compute spans lost 1.3-1.6 ms a step off its core to its own message handling, 0.4-0.7 ms
    with those threads on the encoder's core, where its inputs can reach it later (RESULTS
    11.2, vlm_gap)."""

    PYTHON = ("control", "output", "parent-watchdog", "headers-in", "send-wait-", "recv-wait-", "maestro-")
    NATIVE = ("ZMQbg",)  # the names (comm) of ZeroMQ's background threads (I/O, reaper)

    def __init__(self) -> None:
        self.own = self.now = tuple(sorted(os.sched_getaffinity(0)))
        self.said = False

    def place(self, cores: Sequence[int] | None) -> None:
        """Where the plan just received (its `io_cpus`) puts them; a failure to move is said once in
        the worker's log."""
        want = tuple(sorted(cores)) if cores else self.own
        if want == self.now:
            return
        python = {t.native_id for t in threading.enumerate() if t.name.startswith(self.PYTHON)}
        self.said = say_unmoved(move_threads(want, lambda tid, name: tid in python or name.startswith(self.NATIVE)),
                                want, self.said)
        self.now = want
