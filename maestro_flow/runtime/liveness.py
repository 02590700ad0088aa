"""What the coordinator knows of its workers' liveness, and the failures it names from it.

Runs in the coordinator. Fed with every authentic message (`seen`), every heartbeat's status
(`note_status`), every finished step (`done`), and when training goes on after a pause no step
could finish in (`progress`: the start, a checkpoint); asked whether a worker or a whole node has gone
silent (`silent`) and whether the run is hung (`hang`). Each returns the WorkerLost to raise, or
None: a silent worker names itself, a node whose workers are all silent is named as a lost node
with its ranks, and a hang names the replica the others wait on, with what its heartbeats say it
is stuck in. The clock is passed in (`now`, time.monotonic()).
"""

from __future__ import annotations

from collections.abc import Callable

from maestro_flow.errors import WorkerLost
from maestro_flow.planner.plan import Placement
from maestro_flow.runtime.nodes import node_ranks
from maestro_flow.timeouts import Timeouts

HANG_FACTOR = 5.0  # a step this many times slower than the slowest seen counts as hung
# Worker states (executor status) that wait on others: a hang is never blamed on them first.
WAITING = ("waiting", "idle", "reducing gradients")


class Liveness:
    def __init__(self, placement: Placement, node_of: dict[int, int], timeouts: Timeouts,
                 label: Callable[[int], str]) -> None:
        self.placement, self.node_of, self.timeouts, self.label = placement, node_of, timeouts, label
        self.last_seen: dict[int, float] = {}  # rank -> its last authentic message
        self.last_done: dict[int, int] = {}  # rank -> last step it finished
        self.status: dict[int, dict] = {}  # rank -> its last heartbeat's status
        self.since: dict[int, tuple[tuple, float]] = {}  # rank -> (state, step, mb), when it entered it
        self.reported: dict[int, float] = {}  # rank -> when its last heartbeat's status came
        self.progress_at = 0.0  # when a replica last finished a step (or training began, or went on)
        self.slowest_step_s = 0.0

    def seen(self, rank: int, now: float) -> None:
        self.last_seen[rank] = now

    def forget(self, rank: int) -> None:
        """A worker that said bye: no longer judged (it exits, and sends nothing more)."""
        self.last_seen.pop(rank, None)
        self.status.pop(rank, None)
        self.since.pop(rank, None)
        self.reported.pop(rank, None)

    def away(self, seconds: float) -> None:
        """The coordinator was not listening for `seconds` (paused, swapped out, busy elsewhere):
        that time is not its workers' silence. What they sent meanwhile may still sit in the
        kernel's buffers, out of reach of a non-blocking read, so it is credited to every one."""
        for times in (self.last_seen, self.reported):
            for rank in times:
                times[rank] += seconds
        self.progress_at += seconds

    def note_status(self, rank: int, status: dict, now: float) -> None:
        self.status[rank] = status
        self.reported[rank] = now
        key = (status.get("state"), status.get("step"), status.get("mb"))
        if self.since.get(rank, (None, 0.0))[0] != key:
            self.since[rank] = (key, now)

    def progress(self, now: float) -> None:
        """Training goes on from `now` after time in which no step could finish (training began,
        or the workers saved a checkpoint): the hang timeout counts from here."""
        self.progress_at = now

    def done(self, rank: int, step: int, now: float) -> None:
        self.last_done[rank] = max(step, self.last_done.get(rank, -1))
        self.progress_at = now

    def step_time(self, seconds: float) -> None:
        self.slowest_step_s = max(self.slowest_step_s, seconds)

    def hang_timeout(self) -> float:
        """How long a step may go without any replica finishing it: MAESTRO_HANG_S, or
        HANG_FACTOR times the slowest step seen when that is longer."""
        return max(self.timeouts.hang_s, HANG_FACTOR * self.slowest_step_s)

    def hang(self, step: int, now: float) -> WorkerLost | None:
        """No progress for the hang timeout: the replica the others wait on (the one busy in the
        same state longest, from its heartbeats), with what it is doing."""
        limit = self.hang_timeout()
        if now - self.progress_at <= limit:
            return None
        world = range(self.placement.world_size)
        pending = [r for r in world if self.last_done.get(r, -1) < step]
        busy = [r for r in pending if not str(self.status.get(r, {}).get("state", "")).startswith(WAITING)]

        def since(r: int) -> float:
            return self.since.get(r, (None, now))[1]

        stuck = min(busy or pending or world, key=since)
        others = [self.label(r) for r in pending if r != stuck]
        return WorkerLost(
            f"{self.label(stuck)} is hung: in {self.doing(stuck)} for "
            f"{now - since(stuck):.0f}s, and no replica finished step {step + 1} for {now - self.progress_at:.0f}s "
            f"(hang timeout {limit:.0f}s: MAESTRO_HANG_S, or {HANG_FACTOR:g}x the slowest step seen)"
            + (f"; waiting on it: {', '.join(others)}" if others else ""))

    def lost_node(self, now: float) -> WorkerLost | None:
        """A node other than 0 none of whose workers has been heard from for the heartbeat timeout."""
        for node in sorted(set(self.node_of.values()) - {0}):
            on_node = node_ranks(self.node_of, node)
            quiet = [now - self.last_seen.get(r, now) for r in on_node]
            if quiet and min(quiet) > self.timeouts.heartbeat_timeout_s:
                lost = WorkerLost(f"node {node} (ranks {', '.join(map(str, on_node))}) is lost: none of its workers "
                                  f"sent anything for {min(quiet):.1f}s (heartbeat timeout; raise "
                                  f"MAESTRO_HEARTBEAT_TIMEOUT_S if it is just slow)")
                lost.lost_nodes = {node}  # type: ignore[attr-defined]  # no goodbye to wait for (run.py)
                return lost
        return None

    def silent(self, now: float) -> WorkerLost | None:
        """A lost node, else the first worker silent for the heartbeat timeout."""
        lost = self.lost_node(now)
        if lost is not None:
            return lost
        for rank, seen in self.last_seen.items():
            if now - seen > self.timeouts.heartbeat_timeout_s:
                return WorkerLost(f"worker {self.label(rank)} sent nothing for {now - seen:.1f}s (heartbeat "
                                  "timeout; raise MAESTRO_HEARTBEAT_TIMEOUT_S if it is just busy)"  # QA: no step named
                                  + (f"; it was last in {self.doing(rank)}" if rank in self.status else ""))
        return None

    def doing(self, rank: int) -> str:
        """What `rank`'s last heartbeat said it was doing: its state, step (from 1, as the progress
        line counts) and micro-batch."""
        status = self.status.get(rank, {})
        where = "" if status.get("step") is None else f" of step {status['step'] + 1}"
        where += "" if status.get("mb") is None else f", micro-batch {status['mb']}"
        return f"{status.get('state', 'no status yet')}{where}"
