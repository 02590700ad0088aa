"""The coordinator's messaging: sealing and sending, accepting (authenticating) frames, the
receive loop with its deadlines, and what it learns of its workers on the way (liveness, hangs,
deaths, and how to name them).

A mixin of runtime/coordinator.py's Coordinator (its socket, sealer and opener, liveness, the
launcher's workers), kept apart to keep each module to one concern; it runs in the
coordinator's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from maestro_flow.errors import MaestroError, PipelineError, StageError, SystemFailure, TimeoutFailure, WorkerLost
from maestro_flow.protocol.auth import Rejected, Sealer
from maestro_flow.protocol.messages import make
from maestro_flow.runtime import attempts
from maestro_flow.runtime.launcher import blame_order, cause
from maestro_flow.runtime.nodes import WAIT_NOTE_EVERY_S
from maestro_flow.transport import zmq_link

AWAY_S = 1.0  # a gap this long between two looks at the socket means the coordinator stalled
STOOD_STILL = 0.8  # a stall this share of the workers' coordinator timeout may have made them give up
STOOD_STILL_SHOWN_S = 10.0  # a worker's death found this soon after such a stall is put down to it


class CoordinatorIO:
    def _seal_and_send(self, rank: int, msg: dict) -> None:
        zmq_link.send_msg(self.router, msg, identity=self.rank_identity[rank], sealer=self.sealers[rank])
        self.last_sent[rank] = time.monotonic()

    def _send(self, rank: int, msg: dict) -> None:
        try:
            self._seal_and_send(rank, msg)
        except zmq.ZMQError as exc:
            raise self._unreachable(rank, exc) from None

    def _unreachable(self, rank: int, exc: zmq.ZMQError) -> MaestroError:
        """Why `rank`'s connection is gone (raised, or returned for the caller to raise): a report
        it or a peer sent just before, else a dead worker, else, with several nodes, its node
        found lost within a heartbeat timeout (_raise_dead_peer). Found by CI: a worker of a
        killed node was awaited as if it could still report, and the run ended "timed out after
        1.9s waiting for the error report of a worker that left" instead of naming the node."""
        self._note_reports(set(), 1.0)  # a stage's exception reported meanwhile is raised here
        if not self.system_errors:
            for w in self.launcher.dead():
                if w.rank == rank and rank not in self.said_bye:
                    return self._death(w)
        self._raise_dead_peer()  # a rank that reported is not the cause (found in review: a second one was)
        first = next(iter(self.system_errors), None)  # the first report, read before or during the grace
        if first is not None:
            return self._system_failure(first, self.system_errors[first])
        return SystemFailure(f"cannot reach {self._label(rank)}: {exc}")

    def _accept(self, frames: list[bytes]) -> tuple[int, dict] | None:
        """(rank, message) of an authentic frame from the connection its rank said hello on;
        anything else is dropped and logged (None). Never trusts the socket identity: a
        connection is bound to a rank by its authenticated hello, once."""
        if len(frames) != 2:
            self.drops.drop("a connection", f"{len(frames)} frames, not [identity, message]")
            return None
        identity, frame = frames
        rank = self.identity_rank.get(identity)

        def origin() -> str:  # named only for a drop (this runs for every message)
            return self._label(rank) if rank is not None else f"connection {identity.hex()}"

        try:
            sender, msg = zmq_link.open_msg(self.opener, frame)
        except Rejected as exc:
            self.drops.drop(origin(), str(exc))
            return None
        claimed = msg.get("rank")
        if sender != f"rank{claimed}" or not isinstance(claimed, int) or not 0 <= claimed < self.placement.world_size:
            self.drops.drop(origin(), f"sender {sender!r} claims rank {claimed!r}")
            return None
        if rank is None:
            if msg["t"] != "hello":
                self.drops.drop(origin(), f"a {msg['t']!r} message before this connection's hello")
                return None
            if claimed in self.rank_identity:
                self.drops.drop(origin(), f"hello as rank {claimed}, which is connected already")
                return None
            self.identity_rank[identity], self.rank_identity[claimed] = claimed, identity
            self.sealers[claimed] = Sealer(self.key, "coordinator", f"rank{claimed}")
            rank = claimed
        elif claimed != rank or msg["t"] == "hello":
            self.drops.drop(origin(), f"a {msg['t']!r} message claiming rank {claimed}")
            return None
        if msg["t"] != "hello":  # a worker is silent until its init (liveness counts from there)
            self.liveness.seen(rank, time.monotonic())
        return rank, msg

    def _tick(self, now: float) -> None:
        """Pings to the workers (they exit when their coordinator goes silent) and the status
        endpoint's snapshot, each at most every heartbeat interval."""
        if now < self._next_tick:
            return
        self._next_tick = now + self.timeouts.heartbeat_interval_s
        # Any frame tells a worker its coordinator is alive: ping only those sent nothing for a
        # while (during training the plans go to everyone every step; pings to a thousand
        # workers every interval would cost the coordinator more than its steps).
        quiet = now - min(self.timeouts.coordinator_timeout_s / 6, 5.0)
        for rank in list(self.rank_identity):
            if self.last_sent.get(rank, 0.0) > quiet:
                continue
            try:
                self._seal_and_send(rank, make("ping"))
            except zmq.ZMQError:
                pass  # a worker that left: _check_workers names it
        if self.status is not None:
            self.status.publish(self._snapshot())
        self._say_who_is_awaited(now)
        if self.rdzv is not None:
            lost = self._lost()
            if lost is not None:
                self._raise_own_report(lost)
                raise lost

    def _raise_own_report(self, lost: MaestroError) -> None:
        """A worker of another node that its agent reports dead may have reported its error
        before it exited (by ZeroMQ; the agent's note comes by the store): that report, with its
        traceback, is the cause (found in QA: node 0 said only "exited with code 1", the
        traceback was in node 1's worker log alone), unless a peer died without a word (as for a
        report read first: _recv)."""
        rank = getattr(lost, "rank", None)
        if rank is not None:
            self._note_reports(set(), 0.5)
            if rank in self.system_errors:
                self._raise_dead_peer(exclude=rank)  # a peer dead without a word is the cause (found in review)
                raise self._system_failure(rank, self.system_errors[rank])

    def _snapshot(self) -> dict:
        """What `maestro top` shows (read-only: built from what the coordinator already knows)."""
        row = self.last_row or {}
        now = time.monotonic()
        workers = []
        for rank in range(self.placement.world_size):
            section, replica = self.placement.who(rank)
            busy = min(1.0, self.replica_busy[rank]) if rank in self.replica_busy else None
            # a tensor-parallel rank by its index too (found in QA: a replica's tp ranks were identical rows)
            tp = f".{self.placement.tp_index(rank)}" if self.placement.tp(section) > 1 else ""
            workers.append({"name": f"{section}[{replica}]{tp}", "rank": rank, "busy_fraction": busy,
                            "seen_s": now - self.liveness.last_seen.get(rank, now),
                            "status_s": now - self.liveness.reported[rank] if rank in self.liveness.reported else None,
                            **self.liveness.status.get(rank, {})})
        return {"pipeline": self.pipeline.name, "step": self.awaited_step, "steps": self.pipeline.steps,
                "loss": row.get("loss"), "step_time_s": row.get("step_time_s"), "workers": workers,
                # This run's own: top said "after 1 automatic restart" of a run resumed from a checkpoint
                # written after an earlier run's restart, though it never restarted (found in QA).
                "restarts": self.restarts - self.carried_restarts,
                **({"phase": self._startup_phase()} if self.awaiting is not None else {})}

    awaiting: tuple[str, dict | set] | None = None  # during startup: what the workers are awaited for, who has
    join_note_at = float("inf")  # when node 0 next says which nodes it waits for (monotonic; set at startup)

    def _startup_phase(self) -> str:
        """What `maestro top` says while the workers start (found in QA: only "?" per worker, no
        hint that node 0 waited for node 1)."""
        word, have = self.awaiting
        waiting = self._awaited_nodes()
        return f"starting: {len(have)} of {self.placement.world_size} workers {word}" + (f"; {waiting}" if waiting else "")

    def _awaited_nodes(self) -> str:
        """"waiting for node N (is ... running there?)" for the other nodes none of whose workers
        said hello yet, during startup; "" when there are none."""
        if self.awaiting is None or self.awaiting[0] != "said hello" or not self.nodes.multi:
            return ""
        world, have = self.placement.world_size, self.awaiting[1]
        silent = sorted({self.node_of[r] for r in range(world)} - {self.node_of[r] for r in have} - {0})
        return "waiting for " + ", ".join(f"node {n} (is `maestro run ... --node-rank {n}` running there?)"
                                          for n in silent) if silent else ""

    def _say_who_is_awaited(self, now: float) -> None:
        """Node 0 says which nodes have not joined, WAIT_NOTE_S into startup and every
        WAIT_NOTE_EVERY_S after (found in QA: it said nothing until MAESTRO_STARTUP_S ran out,
        minutes later, with or without a terminal)."""
        if now < self.join_note_at:
            return
        self.join_note_at = now + WAIT_NOTE_EVERY_S
        waiting = self._awaited_nodes()
        if waiting:
            self.report.note(f"{waiting}: {now - self.startup_began:.0f}s into startup, which times out at "
                             f"{self.timeouts.startup_s:.0f}s (MAESTRO_STARTUP_S)")

    stood_still: tuple[float, float] | None = None  # the last long gap in _recv's looks: (seconds, its end)

    def _death(self, w) -> WorkerLost:
        when = "during startup" if not self.training else self._progress(w.rank)
        return WorkerLost(f"worker {w.label} {w.exit_description()} {when}{self._stood_still()}")

    def _stood_still(self) -> str:
        """Why workers and other nodes took this coordinator as gone, when it stood still that long
        (found in QA: node 0 stopped by SIGSTOP and continued blamed its worker's exit, code 5)."""
        if self.stood_still is None or time.monotonic() - self.stood_still[1] > STOOD_STILL_SHOWN_S:
            return ""  # none, or long before (found in review: an old stall was blamed for a later death)
        return (f"; this coordinator (the `maestro run` process) had just stood still for {self.stood_still[0]:.0f}s "
                f"(stopped by SIGSTOP or Ctrl-Z, or starved of CPU), about as long as or longer than the "
                f"{self.timeouts.coordinator_timeout_s:.0f}s its workers wait for it (MAESTRO_COORDINATOR_TIMEOUT_S)")

    def _progress(self, rank: int) -> str:
        last = self.liveness.last_done.get(rank)
        # What it reported: a step it finished may have been on its way (lost with the process).
        # Counted from 1, as the progress line and the checkpoint folders count (found in review:
        # "step 74 done" beside a checkpoint step-00000075 read as a resume ahead of the run).
        reported = "before reporting any step done" if last is None else f"after reporting step {last + 1} done"
        return f"{reported}, while the run was at step {self.awaited_step + 1} of {self.pipeline.steps}"

    def _lost(self) -> MaestroError | None:
        """What another node's agent reported (runtime/attempts.py), a dead worker's with how far it
        got, as a worker of this node is named (found in review: without)."""
        lost = attempts.lost_error(self.rdzv, self.store_key, self.session)
        rank = getattr(lost, "rank", None)
        if rank is not None and self.training and rank < self.placement.world_size:
            lost = WorkerLost(f"{lost} {self._progress(rank)}")
            lost.rank = rank
        return lost

    def _raise_dead_peer(self, exclude: int | None = None) -> None:
        """A system error is often a peer's death seen from the other end (a closed connection):
        name the dead peer instead, when one shows within a grace period. A peer that died after
        reporting an error of its own is not that cause: it is as likely collateral of the first
        report (the rank that failed first closed its connections), so the first report stands.
        With several nodes the grace lasts a heartbeat timeout, the time a lost node takes to
        show as silent. `exclude`: a rank whose report was read elsewhere than _note_reports
        (whose reports are in system_errors, excluded too)."""
        grace_s = self.timeouts.heartbeat_timeout_s + 1.0 if self.nodes.multi else 1.0
        deadline = time.monotonic() + grace_s
        reported = set(self.system_errors) | (set() if exclude is None else {exclude})
        while time.monotonic() < deadline:
            self._note_reports(reported, 0.05)
            # A worker that said bye left normally: never the cause. One that exited with code 0
            # without it (os._exit(0) or sys.exit() in the middle of a step) is as dead as any.
            dead = [w for w in self.launcher.dead() if w.rank not in reported and w.rank not in self.said_bye]
            if dead:
                self._note_reports(reported, 0.2)  # a report it sent before exiting may still be on its way
                dead = [w for w in dead if w.rank not in reported]
                if dead:
                    raise self._death(cause(dead))
            if not self.nodes.multi:
                continue
            lost = self._lost()
            if lost is not None and getattr(lost, "rank", None) in reported:
                return  # a rank that reported an error, dead since: its report stands (found in QA)
            if lost is not None:
                raise lost
            lost = self.liveness.lost_node(time.monotonic())
            if lost is not None:
                raise lost

    def _raise_root_cause(self, rank: int, msg: dict) -> None:
        """An error report that is a cause by its kind: a stage's own exception, or bad input."""
        if msg["kind"] == "input":  # e.g. a checkpoint that does not fit the pipeline
            raise PipelineError(msg["traceback"])
        if msg["kind"] == "stage":
            section, replica = self.placement.who(rank)  # where the rank is, whatever it says
            raise StageError(section=section, replica=replica, rank=rank, step=msg["step"],
                             phase=msg["phase"], traceback=msg["traceback"])

    def _note_reports(self, reported: set[int], wait_s: float) -> None:
        """Read what arrives within `wait_s` (heartbeats too, so that only the lost fall silent),
        adding the ranks that report a system error to `reported`; a stage's exception or bad
        input reported meanwhile is the cause, and raised. The run is failing: nothing else read
        here is needed any more."""
        end = time.monotonic() + wait_s
        while self.router.poll(max(0, int((end - time.monotonic()) * 1000))):
            got = self._accept(self.router.recv_multipart())
            if got is not None and got[1]["t"] == "error":
                self._raise_root_cause(*got)
                reported.add(got[0])
                self.system_errors.setdefault(got[0], got[1])
            elif got is not None and got[1]["t"] == "bye":  # found by CI: a bye read here was dropped,
                self.said_bye.add(got[0])  # and a worker that left normally was blamed for the failure

    def _label(self, rank: int) -> str:
        section, replica = self.placement.who(rank)
        node = f", node {self.node_of[rank]}" if self.nodes.multi else ""
        return f"section {section!r} replica {replica} (rank {rank}{node})"

    def _missing(self, have: dict | set) -> str:
        """The ranks not heard from yet, by node (for startup timeouts)."""
        missing = [r for r in range(self.placement.world_size) if r not in have]

        def ranks(rs: list[int]) -> str:  # "ranks 2 (student-1), 3 (student-2)"
            return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(f"{r} ({self.placement.worker_name(r)})"
                                                                   for r in rs)

        if not self.nodes.multi:
            return ranks(missing)
        nodes = sorted({self.node_of[r] for r in missing})
        return "; ".join(f"node {n}: {ranks([r for r in missing if self.node_of[r] == n])}"
                         + (f" (is `maestro run ... --node-rank {n}` running there?)" if n else "") for n in nodes)

    def _recv(self, deadline: float, what: str | Callable[[], str], setting: str,
              allow_exit: set[int] | None = None, hang: bool = False, since: float | None = None) -> tuple[int, dict]:
        """Next message other than a heartbeat; raises on error reports, dead or silent workers.
        A timeout says what was awaited (`what`, or what it returns: made only then, as naming
        the missing ranks costs a pass over them) and how long since `since` (monotonic;
        default: this call)."""
        started = time.monotonic() if since is None else since
        while True:
            now = time.monotonic()
            if now - self._listened_at > AWAY_S:  # the coordinator itself stalled: not the workers' silence
                self.liveness.away(now - self._listened_at)
                if now - self._listened_at >= STOOD_STILL * self.timeouts.coordinator_timeout_s:
                    self.stood_still = (now - self._listened_at, now)
            self._listened_at = now
            if now > deadline:
                raise TimeoutFailure(what if isinstance(what, str) else what(), now - started, setting)
            self._tick(now)
            # Liveness is judged only once every queued message is read: a coordinator that was
            # paused or busy finds its workers' heartbeats waiting, not missing. A queued message
            # is taken without a poll (one system call per message, not two: with a thousand
            # workers the coordinator reads thousands of messages a step).
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                frames = None
            if frames is None:
                self._check_workers(now, allow_exit or set())
                hung = self.liveness.hang(self.awaited_step, now) if hang else None
                if hung is not None:
                    raise hung
                self.router.poll(100)
                continue
            got = self._accept(frames)
            if got is None:
                continue
            rank, msg = got
            if msg["t"] == "heartbeat":
                if "status" in msg:
                    self.liveness.note_status(rank, msg["status"], time.monotonic())
                continue
            if msg["t"] == "error":
                self._raise_root_cause(rank, msg)
                self._raise_dead_peer(exclude=rank)  # a peer's death is the cause, not the symptom
                raise self._system_failure(rank, msg)
            return rank, msg

    def _system_failure(self, rank: int, msg: dict) -> SystemFailure:
        return SystemFailure(f"system error in {self._label(rank)} during {msg['phase']}"
                             f"{'' if msg['step'] is None else ' at step ' + str(msg['step'] + 1)}:\n"
                             f"{msg['traceback'].rstrip()}")

    def _check_workers(self, now: float, allow_exit: set[int]) -> None:
        for w in sorted(self.launcher.dead(), key=blame_order):
            if w.rank in allow_exit:
                continue
            # A worker that reported an error exits right after; prefer its report if it is queued.
            if self.router.poll(0):
                return
            raise self._death(w)
        lost = self.liveness.silent(now)
        if lost is not None:
            raise lost
