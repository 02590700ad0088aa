"""The agent of a node other than node 0: starts and watches that node's workers.

Runs as `maestro run PIPE --nnodes N --node-rank I --rdzv-endpoint HOST:PORT` on node I > 0.
Node 0's coordinator hosts the rendezvous store (a torch.distributed TCPStore) and publishes in
it each attempt of the run, under the keys runtime/attempts.py lists, sealed under a key of this
run that an agent learns by asking node 0 first (runtime/sealing.py). The agents keep, for
themselves:

    maestro/node/<node>    the agent that runs that node (the first to claim it, for the whole run)
    maestro/beat/<agent>   a counter each agent's beat thread raises every sealing.POLL_S while it lives
    maestro/in/<node>      the last attempt that node's agent started workers for

A second agent started with a node rank that a live agent holds stops with an error before it
does anything else (the run goes on); one that finds the node held by an agent whose beat stands
still for BEAT_WAIT_S (killed: node 0 finds its workers gone) takes the node over and joins the
first attempt after the one the killed agent was in. An agent checks its hold at every poll: one
whose beat stood still while it ran on (cut off from node 0's store for a while) and whose node
was taken over stops its workers and ends.

Before starting any worker an agent checks that its own pipeline (after --set), code and data
(runtime/fingerprint.py) are node 0's and that its secret is (node 0's answer opens with it), so
a mismatch fails at once, naming what differs, instead of as a missing node after the startup
timeout. An agent starts its node's workers of each attempt (the same worker processes node 0
starts, with the secret from its own MAESTRO_SECRET / --secret-file: the store carries nothing that
lets anyone into the control plane), reports a dead worker, stops its workers when the attempt
ends, and follows the next attempt. It ends with the run, or when node 0 is gone (the store no
longer answers), stopping its workers first.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any

from maestro_flow.errors import PipelineError, SystemFailure, Terminated, first_line
from maestro_flow.runtime import fingerprint, sealing
from maestro_flow.runtime.attempts import REFUSED, STOPPED, canonical, comparable, differences, file_name
from maestro_flow.runtime.launcher import Launcher, cause
from maestro_flow.runtime.meeting import REFUSED_RUN
from maestro_flow.runtime.nodes import ABANDONED, NoAnswer, Nodes, bounded, node_ranks, rendezvous
from maestro_flow.runtime.sealing import DIFFERS, NONCE, printable, read_answer, run_key, sealed, store_key, unsealed
from maestro_flow.timeouts import Timeouts
from maestro_flow.transport.host import SlotOwner, claim

BEAT_WAIT_S = 3.0  # how long an agent watches another one's beat before it takes it as gone
BEAT_STORE_S = 2.0  # the beat's store connection: its connect and each call give up after this
BEAT_JOIN_S = 2 * BEAT_STORE_S + 1  # how long an ending agent waits for its beat thread's last store call
INTERRUPT_STORE_S = 2.0  # how long an interrupted agent tries to tell node 0 (each of two store calls)


class Agent:
    def __init__(self, nodes: Nodes, *, secret: bytes, host: str, interface: str | None, timeouts: Timeouts,
                 worker_log: Any, log: Any = None, entry: Any = None, pipeline: dict[str, Any] | None = None,
                 files: dict[str, Any] | None = None, given: tuple[str, ...] = ()) -> None:
        from maestro_flow.runtime.worker import worker_main

        self.nodes, self.secret, self.host, self.interface = nodes, secret, host, interface
        # What node 0's pipeline must match (None: not checked), through the JSON node 0's travels in.
        self.pipeline = comparable(json.loads(canonical(pipeline))) if pipeline is not None else None
        self.files = files  # this node's code, data and versions (runtime/fingerprint.py; None: not compared)
        self.given = list(given)  # run.node0_given of this node's options: node 0 must have them too
        self.timeouts, self.worker_log = timeouts, worker_log
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.entry = entry or worker_main
        self.where = f"{nodes.endpoint[0]}:{nodes.endpoint[1]}" if nodes.endpoint else "?"
        self.node0_ranks: list[int] = []  # known once an attempt is published
        self.me = f"{socket.gethostname()} pid {os.getpid()} ({secrets.token_hex(4)})"  # this agent, in the store
        self.skey = store_key(secret)  # opens node 0's answer to this agent's challenge
        self.rkey: bytes | None = None  # this run's values: known once node 0 answered (_learn_run)
        self.differs = False  # node 0's answer does not open: its secret differs
        self.challenge = secrets.token_hex(16)
        self.attempt = -1  # the number of the newest attempt this agent joined (publish_attempt)
        self._ignored: set[str] = set()  # store keys whose unsealed value was said once

    def run(self) -> None:
        """Until the run is over. Raises SystemFailure when it failed or node 0 is gone."""
        store = rendezvous(self.nodes, self.timeouts.startup_s, lambda waited_s: self.log(
            f"node {self.nodes.node_rank}: waiting for node 0 at {self.where} (is `maestro run ... --node-rank 0` "
            f"running there?): {waited_s:.0f}s, which times out at {self.timeouts.startup_s:.0f}s (MAESTRO_STARTUP_S)"))
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(stop,), daemon=True, name="maestro-agent-beat")
        beat.start()
        try:
            session, joined = None, f"maestro/in/{self.nodes.node_rank}"
            if self._claim(store) and self._ask(store.check, [joined]):
                # Taken over from a killed agent: the attempt it ran workers for is lost (node 0
                # ends it when it finds them gone); this node joins any later one.
                session = self._ask(store.get, joined).decode()
            self._ask(store.set, sealing.ask_name(self.nodes.node_rank), self.challenge)  # which run is this?
            while True:
                session = self._next_attempt(store, session)
                if session is None:
                    return  # the run is done
                self._attempt(store, session, self._record(store, session))
        finally:
            # Joined, not left to die with the interpreter: a daemon thread inside a TCPStore
            # call at exit aborts the process ("terminate called without an active exception").
            stop.set()
            beat.join(BEAT_JOIN_S)
            if beat.is_alive():  # inside a store call to a node 0 that does not answer: see nodes.bounded
                ABANDONED.set()

    def _beat(self, stop: threading.Event) -> None:
        """Raise this agent's beat every sealing.POLL_S until `stop`, over a store connection of its own
        (nothing this agent waits on, a worker's shutdown included, holds it up). A connection
        that fails is made again: a beat that stood still would let another agent take the node
        over (which this one then finds out, `_check_hold`); node 0 gone, the main thread says so."""
        store = None
        while not stop.is_set():
            try:
                store = store or rendezvous(self.nodes, BEAT_STORE_S)
                store.add(f"maestro/beat/{self.me}", 1)
            except Exception:  # noqa: BLE001 (torch raises several types for a lost connection)
                store = None
            stop.wait(sealing.POLL_S)

    def _claim(self, store: Any) -> bool:
        """Hold this node for the run; True where it was taken over. Raises PipelineError where
        a live agent (its beat moves) holds it: a second agent with this node rank, which stops
        here, having done nothing, and the run goes on. A holder whose beat stands still is
        gone: this agent takes over."""
        node, key = self.nodes.node_rank, f"maestro/node/{self.nodes.node_rank}"
        holder = self._ask(store.compare_set, key, "", self.me).decode()
        taken = holder != self.me
        while holder != self.me:
            beat = f"maestro/beat/{holder}"
            first = self._ask(store.add, beat, 0)
            deadline = time.monotonic() + BEAT_WAIT_S
            while time.monotonic() < deadline:
                time.sleep(sealing.POLL_S)
                if self._ask(store.add, beat, 0) != first:
                    raise PipelineError(f"node {node} of this run already has an agent ({holder}): give each node "
                                        f"its own --node-rank (0 to {self.nodes.nnodes - 1}); this one stops, the "
                                        f"run goes on")
            self.log(f"node {node}: the agent that ran this node before ({holder}) is gone; this one takes over")
            holder = self._ask(store.compare_set, key, holder, self.me).decode()
        return taken

    def _check_hold(self, store: Any) -> None:
        """Raises SystemFailure where another agent took this node over (it found this one's
        beat standing still: this host lost node 0's store for a while, or stood still itself)."""
        holder = self._ask(store.get, f"maestro/node/{self.nodes.node_rank}").decode()
        if holder != self.me:
            raise SystemFailure(f"node {self.nodes.node_rank} was taken over by another agent ({holder}): this "
                                f"one's beat did not reach node 0's store for {BEAT_WAIT_S:.0f}s; this one stops "
                                "its workers and ends, the other runs the node")

    def _ask(self, fn: Any, *args: Any) -> Any:
        """A store call; node 0 gone shows as the store failing, or not answering within
        MAESTRO_COORDINATOR_TIMEOUT_S (frozen, or cut off without its connections closing)."""
        try:
            return bounded(fn, *args, timeout_s=self.timeouts.coordinator_timeout_s)
        except Exception as exc:  # noqa: BLE001 (torch raises several types for a lost connection)
            ranks = f", ranks {', '.join(map(str, self.node0_ranks))}" if self.node0_ranks else ""
            why = (f"its rendezvous store did not answer for {self.timeouts.coordinator_timeout_s:.0f}s"
                   if isinstance(exc, NoAnswer) else first_line(exc))
            raise SystemFailure(f"lost node 0 (the coordinator{ranks}; rendezvous {self.where}): {why}; this "
                                f"node's workers are stopped") from None

    def _learn_run(self, store: Any) -> bool:
        """Whether node 0 answered this agent's challenge (runtime/sealing.py): this run's key is
        known then, or that node 0's secret differs (`differs`)."""
        answer, node, port = sealing.answer_name(self.nodes.node_rank), self.nodes.node_rank, self.nodes.endpoint[1]
        if self.rkey is None and not self.differs and self._ask(store.check, [answer]):
            run = read_answer(self.skey, node, self.challenge, port, self._ask(store.get, answer))
            if run == DIFFERS:
                self.differs = True
            elif run is not None:
                self.rkey = run_key(self.skey, run, port)
        if self.rkey is None and not self.differs and self._ask(store.check, [sealing.NNODES]):
            nnodes = self._ask(store.get, sealing.NNODES).decode("utf-8", "replace")
            if nnodes.isdigit() and node >= int(nnodes):  # never answered (found in review: waited it out)
                raise PipelineError(f"node {node} was started with --nnodes {self.nodes.nnodes}, node 0 with "
                                    f"--nnodes {int(nnodes)} (so the rendezvous store says): give every node the "
                                    "same --nnodes")
        return self.rkey is not None or self.differs

    def _read(self, store: Any, name: str) -> str | None:
        """A sealed value of node 0's in this run; None where absent or not sealed with this
        node's secret for this run (said once per key: ignored, see the module docstring)."""
        if not self._ask(store.check, [name]):
            return None
        text = unsealed(self.rkey, name, self._ask(store.get, name))
        if text is None:
            self._ignore(name)
        return text

    def _ignore(self, name: str) -> None:
        """Say, once per key, that its value in the store is not acted on."""
        if name not in self._ignored:
            self._ignored.add(name)
            self.log(f"node {self.nodes.node_rank}: ignored {name} in the rendezvous store: not sealed with this "
                     "node's secret (node 0's secret differs, or another client of the store wrote it)")

    def _refuse(self, store: Any, session: str, problem: str) -> None:
        """Tell node 0 that this node cannot join (it stops at once), and stop here."""
        name = f"maestro/lost/{session}"
        self._ask(store.set, name, sealed(self.rkey or self.skey, name, REFUSED + problem))
        self._ask(store.set, f"maestro/bye/{self.nodes.node_rank}", "1")  # node 0 need not wait for this node
        raise PipelineError(problem)

    def _record(self, store: Any, session: str) -> dict[str, Any]:
        """The attempt's record, sealed by node 0, its worker names checked; refused otherwise."""
        name = f"maestro/attempt/{session}"
        text = unsealed(self.rkey, name, self._ask(store.get, name))
        node = self.nodes.node_rank
        if text is None:
            self._refuse(store, session, f"node {node}'s control-plane secret differs from node 0's (the run's "
                                         "attempt in the rendezvous store is not sealed with it, or something other "
                                         "than node 0 wrote it): give every node the same MAESTRO_SECRET (or "
                                         "--secret-file)")
        info = json.loads(text)
        for section, _, worker, label in info["workers"].values():  # node 0's own: checked all the same
            if not (file_name(worker) and str(label).isprintable() and str(section).isprintable()):
                self._refuse(store, session, f"node 0's attempt names a worker {printable(str(worker))!r}, which "
                                             "is not a file name")
        return info

    def _refusal(self, store: Any, session: str, info: dict[str, Any]) -> str | None:
        """Why this node cannot join the attempt (None: it can)."""
        node = self.nodes.node_rank
        if info.get("nnodes", self.nodes.nnodes) != self.nodes.nnodes:  # found in review: never compared
            return (f"node {node} was started with --nnodes {self.nodes.nnodes}, node 0 with --nnodes {info['nnodes']}: "
                    "give every node the same --nnodes")
        if self.pipeline is not None and "pipeline" in info:
            differ = differences(self.pipeline, comparable(json.loads(info["pipeline"])), f"on node {node}")
            if differ:
                return (f"node {node}'s pipeline differs from node 0's (give every node the same pipeline file "
                        f"and --set/--steps options): {'; '.join(differ[:5])}"
                        + (f"; {len(differ)} differences in all" if len(differ) > 5 else ""))
        missing = [flag for flag in self.given if flag not in info.get("given", ())]
        if missing:  # found in QA: dropped in silence (no checkpoint written, a run trained from scratch)
            return (f"node {node} was given {', '.join(missing)} and node 0 was not: node 0 runs the coordinator, "
                    "which writes the checkpoints and the --save-dir, resumes, records and stops on NaN; give every "
                    "node the same options")
        if self.files is not None and isinstance(info.get("files"), dict):
            differ = fingerprint.differences(self.files, info["files"], f"on node {node}")
            if differ:
                return (f"node {node}'s files differ from node 0's (install the same code and copy the same data to "
                        f"every node): {'; '.join(printable(d) for d in differ)}")
        return None

    def _next_attempt(self, store: Any, previous: str | None) -> str | None:
        wait_s = self.timeouts.startup_s + self.timeouts.checkpoint_s
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            self._check_hold(store)
            if self._learn_run(store):
                if self.differs and self._ask(store.check, ["maestro/job"]):  # found in review: "lost node 0"
                    self._ask(store.set, f"maestro/bye/{self.nodes.node_rank}", "1")  # node 0 need not wait
                    raise PipelineError(f"node {self.nodes.node_rank}'s control-plane secret differs from node 0's, "
                                        "which ended the run before any attempt (why is sealed with its secret: see "
                                        "node 0's output): give every node the same MAESTRO_SECRET (or --secret-file)")
                outcome = self._read(store, "maestro/job")
                if outcome is not None:
                    self._ask(store.set, f"maestro/bye/{self.nodes.node_rank}", "1")
                    if outcome == "done":
                        return None
                    why = printable(outcome.removeprefix("failed: "))
                    if why.startswith(REFUSED_RUN):  # found in QA: exit 2 on node 0, 1 here
                        raise PipelineError(f"node 0 says: {why}")
                    raise SystemFailure(f"the run failed (node 0 says: {why})")
                session = self._pointer(store)
                if session is not None and session != previous:
                    return session
            time.sleep(sealing.POLL_S)
        what = "started no attempt of the run" if self.rkey or self.differs else "did not answer this node's challenge"
        raise SystemFailure(f"node 0 {what} within {wait_s:.0f}s (rendezvous {self.where})")

    def _pointer(self, store: Any) -> str | None:
        """The current attempt's session. Where node 0's secret differs (its answer did not open),
        a pointer to a record that is there is taken all the same: this node then refuses it
        (`_record`) and node 0 shows why, rather than waiting for the startup timeout. Any other
        pointer that does not open (forged, or an earlier run's) is ignored."""
        if not self._ask(store.check, ["maestro/attempt"]):
            return None
        raw = self._ask(store.get, "maestro/attempt")
        text = unsealed(self.rkey, "maestro/attempt", raw)
        if text is not None:
            session, _, number = text.partition(" ")
            if (int(number) if number.isdigit() else 0) >= self.attempt:
                return session
            if "stale pointer" not in self._ignored:
                self._ignored.add("stale pointer")
                self.log(f"node {self.nodes.node_rank}: ignored maestro/attempt in the rendezvous store: an earlier "
                         f"attempt's ({number}), written back; this node is in attempt {self.attempt}")
            return None
        session = sealing.body(raw).split(" ")[0]
        if self.differs and NONCE.fullmatch(session) and self._ask(store.check, [f"maestro/attempt/{session}"]):
            return session
        self._ignore("maestro/attempt")
        return None

    def _attempt(self, store: Any, session: str, info: dict[str, Any]) -> None:
        node = self.nodes.node_rank
        node_of = {int(r): n for r, n in info["node_of"].items()}
        mine = node_ranks(node_of, node)
        self.node0_ranks = node_ranks(node_of, 0)
        self.attempt = max(self.attempt, int(info.get("attempt", 0)))
        if self._read(store, f"maestro/end/{session}") is not None:
            return  # over already (node 0 moved on while this node looked): nothing to start
        problem = self._refusal(store, session, info)
        if problem is not None:
            self._refuse(store, session, problem)
        self._ask(store.set, f"maestro/in/{node}", session)  # for an agent that takes this node over
        again = int(info.get("restarts", 0))  # this run's (found in QA: a restart read as a second start, unexplained)
        again = f"automatic restart {again} (node 0 says why): " if again else ""
        self.log(f"node {node}: {again}starting ranks {', '.join(map(str, mine))} (coordinator {info['address']})")
        launcher = Launcher(self.entry)
        owner: SlotOwner | None = None
        boot = {"coordinator": info["address"], "parent_pid": os.getpid(), "timeouts": info["timeouts"],
                "secret": self.secret.hex(), "session": session, "host": self.host, "interface": self.interface}
        pinned: dict[int, dict[str, Any]] = {}
        if info.get("pin_cpus"):  # node 0's --pin-cpus: this node's CPU workers on this node's cores
            from maestro_flow.runtime.cpus import pinned as pin

            pinned = pin([r for r in mine if info["devices"][r] == "cpu"], os.sched_getaffinity(0))
        quieted = os.environ.pop("MAESTRO_AGENT_QUIETED_TORCH", None) and os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        try:
            owner = claim(session)  # this attempt's slots on this node (transport/host.py)
            for rank in mine:
                section, replica, name, label = info["workers"][str(rank)]
                launcher.start(rank, section, replica, {**boot, "rank": rank, "label": label,
                                                        "log": self.worker_log(name), **pinned.get(rank, {})})
            if quieted:  # the workers started with torch's default log level; this process stays quiet
                os.environ["MAESTRO_AGENT_QUIETED_TORCH"], os.environ["TORCH_CPP_LOG_LEVEL"] = "1", quieted
            reported = False
            gone_since: float | None = None  # when the last of this node's workers ended
            while True:
                self._check_hold(store)
                outcome = self._read(store, f"maestro/end/{session}")
                if outcome is not None:
                    launcher.join(self.timeouts.shutdown_grace_s if outcome == "done" else 0.5)
                    return
                current = self._pointer(store)
                if current is not None and current != session:
                    return  # node 0 moved on to another attempt
                # Exit code 0 is a normal exit only once the workers were asked to stop; before,
                # it is a stage's os._exit(0) or sys.exit() in the middle of a step.
                dead = [w for w in launcher.dead() if w.process.exitcode != 0]
                if len(dead) < len(launcher.dead()) and self._read(store, f"maestro/stopping/{session}") is None:
                    dead = launcher.dead()
                if dead and not reported:
                    w = cause(dead)
                    self._ask(store.set, f"maestro/lost/{session}", sealed(
                        self.rkey, f"maestro/lost/{session}", f"worker {w.label} on node {node} {w.exit_description()}"))
                    reported = True
                if len(launcher.dead()) == len(mine):
                    gone_since = gone_since or time.monotonic()
                    waited = time.monotonic() - gone_since
                    if waited > self.timeouts.coordinator_timeout_s:
                        raise SystemFailure(f"node 0 neither ended attempt {session[:8]} nor started another "
                                            f"{waited:.0f}s after this node's workers ended (raise "
                                            f"MAESTRO_COORDINATOR_TIMEOUT_S if node 0 can be that slow)")
                time.sleep(sealing.POLL_S)
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM here: node 0 learns why at once
            # Ctrl-C is a person stopping the run: no restart (found in review: node 0 restarted and
            # waited out its startup for the node). SIGTERM is as likely a preemption or an eviction:
            # a lost node, which --max-restarts restarts once it is back.
            note = (f"node {node} was terminated (SIGTERM or SIGHUP there: preempted, evicted or stopped); its "
                    "workers are stopped" if isinstance(exc, Terminated) else
                    f"{STOPPED}node {node} was interrupted (Ctrl-C there); its workers are stopped")
            try:  # bounded: a node 0 that does not answer must not hold Ctrl-C up
                bounded(store.set, f"maestro/lost/{session}", sealed(self.rkey, f"maestro/lost/{session}", note),
                        timeout_s=INTERRUPT_STORE_S)
                bounded(store.set, f"maestro/bye/{node}", "1", timeout_s=INTERRUPT_STORE_S)  # node 0 need not wait
            except Exception:  # noqa: BLE001 (node 0 may be gone too)
                pass
            raise
        finally:
            try:
                launcher.shutdown(0.5, self.timeouts.kill_grace_s)
            finally:
                if owner is not None:  # sweeps the slots a killed worker of this node left
                    owner.close()
