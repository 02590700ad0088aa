"""The coordinator: the `maestro run` process in section mode, where planning meets I/O.

Owns the control socket (ROUTER), the rendezvous store for torch.distributed and the worker
processes. Startup is a handshake under one deadline (hello -> init -> ready); then for each
step it asks the planner for a plan, sends each replica its part (up to `lookahead_steps`
ahead, so forward-only sections can run ahead), turns loss reports into the global loss
denominator for trainable sections upstream of a loss (`finalize`; the loss section sums its own
with its gradients), norm reports into the global clip coefficient (`clip`, with grad_clip),
and done reports into metrics. At a checkpoint boundary it holds back the next plans, asks every
worker to save its part (`checkpoint` -> `saved`) and lets the Checkpointer write the manifest; a
resumed run starts at the checkpoint's step, with the workers loading their part at setup.
After a SIGTERM taken by --checkpoint-on-term (runtime/stops.py) no further plan goes out: the
steps already planned finish, the last one is saved, and the run stops as an interrupt.
Whether the planner's search runs for a step depends on the step and the configuration alone
(`_train`), never on when its plan is made, so with fixed costs (adapt_costs=false) checkpoints
and resuming do not change the plans (DESIGN 4b).
Any error report, dead worker, silent worker or timeout ends the run: everything is shut down
and the error is raised.

Nothing from a socket is trusted until authenticated (protocol/auth.py): every frame is sealed
under this attempt's key, a connection becomes a rank only by that rank's sealed hello, and a
report counts once per rank and step (runtime/ledger.py). Anything else is dropped and logged,
never fatal. The control socket and the store listen on `host` only (loopback unless the run
says otherwise; off loopback the control socket is a CurveZMQ server, transport/zmq_link.py); the
status endpoint always on loopback (runtime/status.py). Sending, receiving and watching the workers:
runtime/coordinator_io.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from maestro_flow.checkpoint.checkpointer import Checkpointer, CheckpointOptions
from maestro_flow.checkpoint.manifest import Manifest, rng_file
from maestro_flow.config import Pipeline
from maestro_flow.errors import Diverged, SystemFailure, Terminated, TimeoutFailure
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import make_planner
from maestro_flow.planner.plan import Placement, Plan
from maestro_flow.protocol.auth import DropLog, Opener, Rejected, Sealer, derive_key, new_nonce, new_secret
from maestro_flow.protocol.messages import PROTOCOL_VERSION, make
from maestro_flow.runtime import attempts
from maestro_flow.runtime.build import resolve_device
from maestro_flow.runtime.coordinator_io import CoordinatorIO
from maestro_flow.runtime.cpus import CoordinatorCores
from maestro_flow.runtime.launcher import Launcher
from maestro_flow.runtime.ledger import PlanMessages, StepLedger, carry_counters
from maestro_flow.runtime.liveness import Liveness
from maestro_flow.runtime.nodes import WAIT_NOTE_S, Nodes, listening_store
from maestro_flow.runtime.observe import RunObserver, timed_plan
from maestro_flow.runtime.report import RunReport
from maestro_flow.runtime.sampler import EpochSampler
from maestro_flow.runtime.status import StatusServer
from maestro_flow.runtime.topology import ipc_channels, ipc_enabled, shm_channels, shm_enabled
from maestro_flow.runtime.worker import worker_main
from maestro_flow.timeouts import Timeouts
from maestro_flow.transport import host as shm_host
from maestro_flow.transport import zmq_link


def placement_for(graph: SectionGraph) -> Placement:
    """Every rank of every section (dp x tp of them) on a device: CUDA sections take the node's
    GPUs round robin (cuda:<local index>), in rank order."""
    devices: dict[str, list[str]] = {}
    cuda_index = 0
    for name in graph.order:
        section = graph.sections[name]
        devices[name] = []
        for _ in range(section.dp * section.tp):
            device = resolve_device(section, cuda_index)
            cuda_index += device.startswith("cuda")
            devices[name].append(device)
    return Placement.build(graph.order, {n: graph.sections[n].dp for n in graph.order}, devices,
                           tp={n: graph.sections[n].tp for n in graph.order})


class Coordinator(CoordinatorIO):
    def __init__(self, pipeline: Pipeline, graph: SectionGraph, sampler: EpochSampler, report: RunReport, *,
                 paths: list[str], timeouts: Timeouts | None = None, save_dir: str | None = None,
                 worker_entry: Callable[[dict], None] = worker_main, observer: RunObserver | None = None,
                 run_dir: str | None = None, record: dict | None = None,
                 checkpointer: Checkpointer | None = None, resume: tuple[str, Manifest] | None = None,
                 restarts: int = 0, carried_restarts: int = 0, secret: bytes | None = None, host: str = zmq_link.LOOPBACK,
                 interface: str | None = None, nodes: Nodes | None = None, rdzv: Any = None,
                 rdzv_key: bytes | None = None, files: dict | None = None, pin_cpus: bool = False,
                 given: tuple[str, ...] = ()) -> None:
        self.pipeline, self.graph, self.sampler, self.report = pipeline, graph, sampler, report
        self.paths, self.save_dir = paths, save_dir
        self.timeouts = timeouts or Timeouts.from_env()
        self.nodes = nodes or Nodes()
        self.placement = placement_for(graph)
        self.node_of = self.nodes.assign(self.placement)  # rank -> node (node 0 runs this coordinator)
        self.rdzv = rdzv  # the job's rendezvous store (several nodes), hosted by this node
        self.files = files  # this node's code, data and versions, for the others to compare (runtime/fingerprint.py)
        self.store_addr: list = []
        self.launcher = Launcher(worker_entry)
        self.pin_cpus = pin_cpus  # each CPU worker on its own cores (runtime/cpus.py)
        self.given = given  # run.node0_given: published for the other nodes to compare theirs with
        self.observer = observer or RunObserver()
        self.zctx = zmq.Context()
        self.router: zmq.Socket | None = None
        self.store: Any = None
        self.training = False
        self.said_bye: set[int] = set()  # ranks that left normally (at the end): never a failure's cause
        self.system_errors: dict[int, dict] = {}  # rank -> the first system error it reported (_note_reports)
        self.awaited_step = resume[1].step if resume else 0  # found in QA: top said step 0 while a restart started
        self.status: StatusServer | None = None
        self.run_dir = run_dir
        self.record = record  # {"dir", "section", "steps"}: what a section records for replay
        self.replica_busy: dict[int, float] = {}  # rank -> busy share of its last step
        self._cpu_mark = 0.0  # each step's row: this process's CPU since the last one (or since _train began)
        self.last_row: dict | None = None
        self.checkpointer = checkpointer or Checkpointer(CheckpointOptions())
        self.resume = resume  # (checkpoint folder, its manifest): start there
        self.restarts = restarts  # automatic restarts before this attempt (recorded in checkpoints)
        self.carried_restarts = carried_restarts  # those the --resume checkpoint carried (an earlier run's)
        # The control plane: sealed frames under a key of this attempt (protocol/auth.py).
        self.host, self.interface = host, interface  # where the control plane, store and gloo listen
        self.secret = secret or new_secret()
        self.session = new_nonce()
        self._owner: shm_host.SlotOwner | None = None  # marks this attempt's slots on this host as alive
        self.key = derive_key(self.secret, self.session)
        self.store_key = rdzv_key  # seals this node's values in the rendezvous store (runtime/sealing.py)
        self.opener = Opener(self.key, "coordinator", zmq_link.CONTROL_MAX_BYTES)
        self.sealers: dict[int, Sealer] = {}
        self.identity_rank: dict[bytes, int] = {}  # bound by each rank's authenticated hello
        self.rank_identity: dict[int, bytes] = {}
        self.drops = DropLog("the coordinator")
        self._next_tick = 0.0
        self.address: str | None = None  # the control socket's endpoint, once bound
        self.peers: dict[int, str] = {}  # every worker's tensor-header endpoint, after the hellos
        self.liveness = Liveness(self.placement, self.node_of, self.timeouts, self._label)
        self.startup_s: float | None = None
        self.last_sent: dict[int, float] = {}  # rank -> when the coordinator last sent it a frame
        self._listened_at = time.monotonic()  # when _recv last looked at its socket
        self.startup_parts: dict[str, float] = {}  # setup part -> the slowest worker's seconds in it
        self.cores: CoordinatorCores | None = None  # where this process runs (_train; moves with --pin-cpus)

    # -- public ----------------------------------------------------------------------------

    def run(self) -> None:
        outcome = "failed"
        started = time.perf_counter()
        try:
            self._owner = shm_host.claim(self.session)  # shared-memory slots of this attempt (transport/host.py)
            self._start()
            self.startup_s = time.perf_counter() - started
            self._train()
            self._stop()
            outcome = "done"
        finally:
            try:
                if self.rdzv is not None:  # other nodes stop this attempt's workers
                    attempts.end_attempt(self.rdzv, self.store_key, self.session, outcome)
            finally:  # this node's workers stop, and this process gets its cores back, even where that failed
                self.close()

    def close(self) -> None:
        """Idempotent; never waits longer than the shutdown grace periods."""
        self.checkpointer.training = False  # a SIGTERM while stopping stops at once
        # After a normal stop the workers have exited already; after a failure the others may
        # sit in a transfer with the dead one, so they get a short grace, then SIGTERM, then SIGKILL.
        try:
            self.launcher.shutdown(0.5, self.timeouts.kill_grace_s)
            if self.status is not None:
                self.status.close()
                self.status = None
            if self.router is not None:
                self.router.close(linger=0)
                self.router = None
            zmq_link.term(self.zctx)
            self.store = None
        finally:
            if self.cores is not None:  # this process may go on (a test, a benchmark): all its cores back
                self.cores.restore()
            if self._owner is not None:  # sweeps the slots a killed worker could not remove
                self._owner.close()
                self._owner = None

    # -- startup ---------------------------------------------------------------------------

    def _start(self) -> None:

        self.router, addr = zmq_link.bind(self.zctx, zmq.ROUTER, self.host, key=self.key)
        self.address = addr
        self.status = StatusServer(self.run_dir)  # on loopback whatever self.host is (runtime/status.py)
        if self.rdzv is None:  # one node: a store of this attempt, for torch.distributed only
            self.store = listening_store(self.host)
            self.store_addr = [self.host, self.store.port, ""]
        else:  # the job's rendezvous store, this attempt's keys under its session
            self.store = self.rdzv
            self.store_addr = [self.nodes.endpoint[0], self.nodes.endpoint[1], f"{self.session}/"]
        boot = {"coordinator": addr, "parent_pid": os.getpid(), "timeouts": self.timeouts.to_dict(),
                "secret": self.secret.hex(), "session": self.session, "host": self.host, "interface": self.interface,
                "keep_on_term": self.checkpointer.options.on_term}
        pinned = self._pinned()
        for rank in range(self.placement.world_size):
            if self.node_of[rank] != 0:
                continue  # its node's agent starts it
            section, replica = self.placement.who(rank)
            self.launcher.start(rank, section, replica, {
                **boot, "rank": rank, "label": self.placement.worker_name(rank, "/"),
                "log": self.observer.worker_log(self.placement.worker_name(rank)), **pinned.get(rank, {})})
        if self.rdzv is not None:
            attempts.publish_attempt(self.rdzv, self.store_key, self.session, {
                "address": addr, "timeouts": self.timeouts.to_dict(), "node_of": self.node_of,
                "workers": {r: [*self.placement.who(r), self.placement.worker_name(r), self.placement.worker_name(r, "/")]
                            for r in range(self.placement.world_size)},
                "devices": list(self.placement.devices), "pin_cpus": self.pin_cpus, "nnodes": self.nodes.nnodes,
                "attempt": self.restarts, "restarts": self.restarts - self.carried_restarts, "given": list(self.given),
                "pipeline": attempts.canonical(self.pipeline.to_dict()), "files": self.files})
        self.observer.start(self.placement)
        began = self.startup_began = time.monotonic()
        deadline = began + self.timeouts.startup_s
        hellos: dict[int, dict] = {}
        self.awaiting, self.join_note_at = ("said hello", hellos), began + WAIT_NOTE_S
        while len(hellos) < self.placement.world_size:
            rank, msg = self._recv(deadline, lambda: f"every worker's hello (missing {self._missing(hellos)})",
                                   "MAESTRO_STARTUP_S", since=began)
            if msg["t"] == "hello":
                if msg["version"] != PROTOCOL_VERSION:
                    raise SystemFailure(f"worker rank {rank} speaks protocol version {msg['version']}, "
                                        f"the coordinator {PROTOCOL_VERSION}: reinstall maestro_flow consistently")
                hellos[rank] = msg
        peers = self.peers = {r: h["data_addr"] for r, h in hellos.items()}
        hosts = {r: h.get("host_key") for r, h in hellos.items()}
        shm = [list(ch) for ch in shm_channels(self.graph, self.placement, hosts)] if shm_enabled() else []
        ipc = [list(ch) for ch in ipc_channels(self.graph, self.placement, hosts)] if ipc_enabled() else []
        pipeline_dict, placement_dict = self.pipeline.to_dict(), self.placement.to_dict()
        here = shm_host.host_key()
        for rank in hellos:
            # A worker on this host reads the same wall clock (no offset to estimate); another
            # host's worker aligns its trace by this reading (off by the message's latency).
            same_clock = here is not None and hellos[rank].get("host_key") == here
            self._send(rank, make("init", rank=rank, pipeline=pipeline_dict, placement=placement_dict,
                                  store=self.store_addr, peers=peers, timeouts=self.timeouts.to_dict(), paths=self.paths,
                                  epoch=self.observer.tracer.epoch, now=None if same_clock else time.time(),
                                  trace=self.observer.tracing, record=self.record, shm=shm,
                                  # absolute here: another node's workers would read a relative path in
                                  # their own folder (found in review: a restart failed, or loaded a
                                  # stale checkpoint that sat at the same relative path there)
                                  resume=os.path.abspath(self.resume[0]) if self.resume else None,
                                  ipc=ipc))
            # Silence counts from here: before its init a worker sends nothing (it may wait long
            # for another node's workers to say hello, and that is the startup deadline's to judge).
            self.liveness.seen(rank, time.monotonic())
        ready: set[int] = set()
        self.awaiting = ("ready", ready)
        what = "every worker to be ready (stage built, process groups formed"
        if self.resume is not None:  # loading the checkpoint is part of getting ready
            deadline += self.timeouts.checkpoint_s
            what += f", {self.resume[0]} loaded"
        while len(ready) < self.placement.world_size:
            rank, msg = self._recv(deadline, lambda: f"{what}; not ready: {self._missing(ready)})",
                                   "MAESTRO_STARTUP_S and MAESTRO_CHECKPOINT_S" if self.resume is not None
                                   else "MAESTRO_STARTUP_S", since=began)
            if msg["t"] == "ready":
                ready.add(rank)
                for part, seconds in msg.get("setup", {}).items():  # the slowest worker's, per part
                    if isinstance(seconds, (int, float)) and isinstance(part, str):
                        self.startup_parts[part] = max(self.startup_parts.get(part, 0.0), float(seconds))
        self.awaiting = None

    def _plan_search(self) -> float:
        """Pipeline.plan_search where the planner's search costs training nothing (cpus.search_share)."""
        from maestro_flow.runtime.cpus import pipeline_search

        here = sum(1 for r in range(self.placement.world_size) if self.node_of[r] == 0)
        return pipeline_search(self.pipeline, here, len(os.sched_getaffinity(0)))

    def _pinned(self) -> dict[int, dict[str, Any]]:
        """With --pin-cpus: each CPU worker of this node's cores and torch threads (boot fields)."""
        if not self.pin_cpus:
            return {}
        from maestro_flow.runtime.cpus import pinned

        return pinned([r for r in range(self.placement.world_size)
                       if self.node_of[r] == 0 and self.placement.devices[r] == "cpu"], os.sched_getaffinity(0))

    # -- steps -----------------------------------------------------------------------------

    def _train(self) -> None:
        p = self.pipeline
        self._cpu_mark = time.process_time()  # the first step's CPU leaves the startup out
        search = self._plan_search()
        planner = make_planner(p.schedule, self.graph, search=search)
        sampler = self.sampler
        ledger = StepLedger(self.graph, self.placement, adapt_costs=p.adapt_costs)
        self.cores = cores = CoordinatorCores.of(self._pinned(), self.placement, self.report.note)  # --pin-cpus
        first = 0
        if self.resume is not None:
            first = self.resume[1].step
            if ledger.fitter is not None:
                ledger.fitter.load(self.resume[1].costs)
        next_plan = first

        def send_plans(upto: int, completed: int) -> None:
            """Make and send the plans up to step `upto`, none past the next checkpoint boundary
            (plan_limit: no sample in flight while the workers save): those are made after the
            checkpoint, with the cost model a resumed run loads from it (CostFitter.state)."""
            nonlocal next_plan
            limit = self.checkpointer.plan_limit(completed)
            if limit is not None:
                upto = min(upto, limit - 1)
            while next_plan <= min(upto, p.steps - 1) and not self.checkpointer.term_asked:  # (--checkpoint-on-term)
                planner.costs = ledger.costs()  # refined from the timings measured so far
                if search:  # every step but step 0 (which every run's workers wait for, and no run resumes
                    # at), whenever it is planned: a resumed run plans as the uninterrupted one (DESIGN 4b)
                    planner.search = search if next_plan > 0 else 0.0  # type: ignore[attr-defined]
                began = time.perf_counter()  # the workers wait from here for a plan not made ahead
                self._send_plan(timed_plan(planner, next_plan, sampler.batch(next_plan), self.observer), began,
                                ledger)
                next_plan += 1

        send_plans(first + p.lookahead_steps, first)
        self.training = self.checkpointer.training = True  # a SIGTERM from here may end with a checkpoint
        self.liveness.progress(time.monotonic())
        for step in range(first, p.steps):
            self.awaited_step = step
            deadline = time.monotonic() + self.timeouts.step_s
            row = None
            while row is None:
                rank, msg = self._recv(deadline, f"step {step + 1} to finish", "MAESTRO_STEP_S", hang=True)
                try:
                    row = self._report(ledger, rank, msg)
                except Rejected as exc:  # a repeated or misplaced report never changes training
                    self.drops.drop(self._label(rank), str(exc))
            cores.step(row["sections"])
            row["restarts"] = self.restarts
            carry_counters(row, self.resume[1].counters if self.resume else {})
            if step == first:  # how long this attempt took to start (spawn to every worker ready), and where
                row["startup_s"] = self.startup_s
                row["startup"] = dict(self.startup_parts)
            self.liveness.step_time(row["step_time_s"])
            diverged = self.report.stops_at(row)  # --stop-on-nan: no checkpoint of the diverged weights
            # --checkpoint-on-term: no plan goes out after a SIGTERM; the last planned step saves (the last ends as usual)
            last = self.checkpointer.term_asked and step + 1 == next_plan < p.steps and not diverged
            if last:
                self._say_term(f"saving a checkpoint after step {step + 1} (the last one planned), then stopping")
            owed = not diverged and (self.checkpointer.due(step + 1, p.steps) or last)
            try:
                if owed:
                    t0 = time.perf_counter()
                    saved = self._checkpoint(step + 1, ledger, row)
                    # No step can finish while the workers save: the hang clock starts after it.
                    self.liveness.progress(time.monotonic())
                    if saved:
                        row["checkpoint_s"] = time.perf_counter() - t0
            finally:  # the step is done even when its checkpoint failed
                self.last_row = row
                try:
                    self.report.step(row)
                except Diverged as exc:  # and where to go on from
                    newest = self.checkpointer.previous() if self.checkpointer.options.dir else \
                        f"; this run resumed from {self.resume[0]}" if self.resume else ""  # (review)
                    raise Diverged(f"{exc}{newest}") from None
            if self.checkpointer.term_asked and step + 1 == next_plan < p.steps:  # (planned steps run before)
                if not last:  # the SIGTERM came while this step's checkpoint was decided on, or written
                    self._say_term(f"stopping after step {step + 1} (the last one planned), with its checkpoint")
                    if not owed:
                        self._checkpoint(step + 1, ledger, row)
                self.save_dir = None  # the run did not end: no --save-dir; the workers exit as at the end
                self._stop()
                raise Terminated
            send_plans(step + 1 + p.lookahead_steps, step + 1)
        if self.checkpointer.term_asked:  # review: said nothing
            self._say_term("the last step had been planned already, so the run ends as usual")
        self.checkpointer.training = False

    def _say_term(self, what: str) -> None:
        self.report.note(f"SIGTERM (--checkpoint-on-term): {what}; a second SIGTERM stops the run at once")

    def _send_plan(self, plan: Plan, started: float, ledger: StepLedger) -> None:
        """Each replica its part of `plan`; the step's time counts from `started` (perf_counter)."""
        ledger.planned(plan, started)
        messages = PlanMessages(plan, self.graph)
        for name, leaders in self.placement.ranks.items():
            for replica, leader in enumerate(leaders):
                msg = messages.of(name, replica)  # a tensor-parallel replica's ranks share it
                for rank in self.placement.group(leader):
                    io = self.cores.io_cpus(name, rank) if self.cores is not None else None  # --pin-cpus
                    self._send(rank, msg if io is None else {**msg, "io_cpus": io})  # (cpus.IoThreads)

    def _report(self, ledger: StepLedger, rank: int, msg: dict) -> dict | None:
        """A step report into the ledger; the step's metrics row once every replica is done."""
        if msg["t"] == "loss":
            for ranks, denominator in ledger.on_loss(rank, msg["step"], msg["loss_sum"], msg["denominator"]):
                for r in ranks:
                    self._send(r, make("finalize", step=msg["step"], denominator=denominator))
        elif msg["t"] == "norm":
            clip = ledger.on_norm(rank, msg["step"], msg["sq"])
            if clip is not None:
                for r in clip[0]:
                    self._send(r, make("clip", step=msg["step"], coef=clip[1]))
        elif msg["t"] == "done":
            stats = msg["stats"]
            ledger.check_done(rank, msg["step"])  # a report that does not count reaches no one
            # The trace events go first: the ledger holds every rank's stats until the step is done.
            self.observer.done(rank, stats)
            row = ledger.on_done(rank, msg["step"], stats, time.perf_counter())
            if row is not None:  # this process's CPU (all its threads) since the last step ended
                cpu = time.process_time()
                row["coordinator_cpu_s"] = cpu - self._cpu_mark
                self._cpu_mark = cpu
            self.liveness.done(rank, msg["step"], time.monotonic())
            self.replica_busy[rank] = stats.get("busy_s", 0.0) / max(stats.get("wall_s", 0.0), 1e-12)
            return row
        return None

    def _checkpoint(self, step: int, ledger: StepLedger, row: dict) -> bool:
        """Every worker is between steps (plans for `step` on are held back): each saves its part,
        then the manifest is written. A failed save is the Checkpointer's to report (it raises, or
        returns False with `--checkpoint-errors continue`)."""
        folder = self.checkpointer.begin(step)
        if folder is None:
            return False
        for rank in range(self.placement.world_size):
            self._send(rank, make("checkpoint", step=step, path=os.path.abspath(folder)))
        deadline = time.monotonic() + self.timeouts.checkpoint_s
        infos: dict[int, dict] = {}
        errors: dict[str, str] = {}
        while len(infos) + len(errors) < self.placement.world_size:
            try:
                rank, msg = self._recv(deadline, f"every worker to save its part of the checkpoint at step {step}",
                                       "MAESTRO_CHECKPOINT_S")
            except TimeoutFailure:
                # A save too slow for the limit (a slow filesystem, mostly) is a failed checkpoint,
                # not a hung worker: restarting would train up to here and time out again.
                for rank in range(self.placement.world_size):
                    if rank not in infos and self._label(rank) not in errors:
                        errors[self._label(rank)] = (f"did not finish saving within {self.timeouts.checkpoint_s:g}s "
                                                     "(raise MAESTRO_CHECKPOINT_S if saves take that long)")
                break
            if msg["t"] != "saved":
                continue
            if msg["step"] != step or rank in infos or self._label(rank) in errors:
                self.drops.drop(self._label(rank), f"a 'saved' report for step {msg['step']} (asked: {step}), or repeated")
                continue
            if msg["error"] is None:
                infos[rank] = msg["info"]
            else:
                log = self.observer.worker_log(self.placement.worker_name(rank))
                errors[self._label(rank)] = msg["error"] + (f" (traceback: {log})" if log else "")
        missing = self._not_written(folder, infos)
        if missing and not errors:
            errors["the coordinator"] = (f"{len(missing)} files the workers wrote are not in {folder} as it sees it, "
                                         f"e.g. {missing[0]}: --checkpoint-dir must be on a filesystem every node shares")
        if errors:
            self.checkpointer.failed(step, errors)
            return False
        sections = {}
        for name in self.graph.order:
            section = self.graph.sections[name]
            if section.trainable:
                sections[name] = {"stage": section.stage, "dp": section.dp, "optimizer": dict(section.optimizer),
                                  "params": infos[self.placement.rank(name, 0)].get("params", {})}
        return self.checkpointer.commit(step, Manifest(
            step=step, pipeline=self.pipeline.to_dict(), sections=sections, sampler=self.sampler.position(step),
            costs=ledger.fitter.state() if ledger.fitter is not None else [], restarts=self.restarts,
            counters={name: dict(sec["stage"]) for name, sec in row["sections"].items() if sec.get("stage")},
            files={path: sums for info in infos.values() for path, sums in info.get("files", {}).items()}))

    def _not_written(self, folder: str, infos: dict[int, dict]) -> list[str]:
        """What the workers reported saving but this process cannot see (another node's local disk,
        not a shared one): each rank's RNG states, and the DCP metadata of each section with
        training state (its first replica's report lists its parameters)."""
        expected = [os.path.join(folder, name, ".metadata") for name in self.graph.order
                    if infos.get(self.placement.rank(name, 0), {}).get("params")]
        for rank in range(self.placement.world_size):
            section, replica = self.placement.who(rank)
            expected.append(rng_file(folder, section, replica, self.placement.tp_index(rank)))
        return [path for path in expected if not os.path.exists(path)]

    def _stop(self) -> None:
        if self.save_dir:
            from maestro_flow.checkpoint.savedir import begin_save

            begin_save(self.save_dir, self.pipeline.to_dict())
        if self.rdzv is not None:
            attempts.stopping(self.rdzv, self.store_key, self.session)  # other nodes' agents: exits with code 0 are normal now
        for rank in range(self.placement.world_size):
            self._send(rank, make("stop", save_dir=os.path.abspath(self.save_dir) if self.save_dir else None))
        deadline = time.monotonic() + self.timeouts.shutdown_grace_s + (60.0 if self.save_dir else 0.0)
        bye = self.said_bye
        while len(bye) < self.placement.world_size:
            rank, msg = self._recv(deadline, "workers to save and exit", "MAESTRO_SHUTDOWN_GRACE_S",
                                   allow_exit=bye)
            if msg["t"] == "bye":
                bye.add(rank)
                self.liveness.forget(rank)  # it has left: its silence is no one's loss
        self.launcher.join(self.timeouts.shutdown_grace_s)
