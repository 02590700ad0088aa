"""The worker process: one replica of one section.

Entry point `worker_main`, started with multiprocessing's spawn by the launcher. Threads:
  * main (compute): handshake, then a loop that moves inbox items into the executor and polls
    it; the only thread that runs stage code and touches the executor;
  * control: owns the DEALER socket to the coordinator, forwards inbound messages to the inbox
    and outbound events from an inproc socket, sends heartbeats;
  * tensor channels (transport.tensor_comm): headers over ZeroMQ, bytes over torch.distributed;
  * parent watchdog: exits the process when the coordinator is gone;
  * output: the process's stdout and stderr into its log (runtime/worker_output.py).
Failures go back to the coordinator as data (`error` messages with the traceback as text):
kind "stage" when user code raised, kind "system" for anything else.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import zmq

from maestro_flow.errors import PipelineError
from maestro_flow.protocol.auth import DropLog, Opener, Rejected, Sealer, derive_key
from maestro_flow.protocol.messages import PROTOCOL_VERSION, make
from maestro_flow.runtime import cpus
from maestro_flow.runtime.launcher import GAVE_UP_EXIT, NO_INIT_EXIT
from maestro_flow.runtime.reaper import stop_children
from maestro_flow.runtime.worker_output import OutputCapture
from maestro_flow.timeouts import Timeouts
from maestro_flow.transport import zmq_link


def name_process(label: str) -> None:
    """Title this process `mf SECTION/REPLICA` (Linux keeps 15 bytes: a long section name is cut,
    not the replica) for ps, top and `pgrep mf`: found in QA, a worker showed as `python` (its
    command line is multiprocessing's spawn)."""
    section, _, replica = label.partition("/")
    keep = 15 - len(f"mf /{replica}".encode()) if replica else 12  # a long section name is cut, not the replica
    title = f"mf {section.encode()[:keep].decode(errors='ignore')}" + (f"/{replica}" if replica else "")
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(title.encode()[:15].decode(errors="ignore"))
    except OSError:
        pass


def die_with_parent(parent_pid: int) -> None:
    try:  # Linux: the kernel kills us when the parent thread dies.
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:
        os._exit(3)


class _Control:
    """Owns the coordinator socket after the handshake (see module docstring). Seals what it
    sends and opens what it receives (protocol/auth.py): frames that fail are dropped and logged;
    pings only say the coordinator is alive. When the coordinator stays silent for
    Timeouts.coordinator_timeout_s, `on_lost` is called (it ends the process)."""

    def __init__(self, zctx: zmq.Context, dealer: zmq.Socket, rank: int, inbox: queue.Queue,
                 timeouts: Timeouts, link: tuple[Sealer, Opener], drops: DropLog,
                 on_lost: Callable[[str], None]) -> None:
        self.zctx, self.dealer, self.rank, self.inbox, self.timeouts = zctx, dealer, rank, inbox, timeouts
        self.sealer, self.opener = link
        self.drops, self.on_lost = drops, on_lost
        self.addr = f"inproc://events-{rank}-{id(self)}"
        self.events = zctx.socket(zmq.PULL)
        self.events.bind(self.addr)
        self.stopped = threading.Event()
        self.status: Any = lambda: None  # set to the executor's status once it exists
        self.heard = time.monotonic()  # the coordinator's last authentic frame
        self.thread = threading.Thread(target=self._loop, name="control", daemon=True)

    def outbound(self) -> zmq.Socket:
        sock = self.zctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self.addr)
        return sock

    def _receive(self) -> None:
        try:
            sender, msg = zmq_link.open_msg(self.opener, self.dealer.recv())
        except Rejected as exc:
            self.drops.drop("the coordinator's socket", str(exc))
            return
        if sender != "coordinator":
            self.drops.drop(sender, "not the coordinator")
            return
        self.heard = time.monotonic()
        if msg["t"] != "ping":
            self.inbox.put(("msg", msg))

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        interval_ms = int(self.timeouts.heartbeat_interval_s * 1000)
        next_beat = time.monotonic()
        while not self.stopped.is_set():
            for sock, _ in poller.poll(min(interval_ms, 100)):
                if sock is self.dealer:
                    self._receive()
                else:
                    self.dealer.send(self.sealer.seal(self.events.recv()))
            now = time.monotonic()
            if now >= next_beat:
                status = self.status()
                beat = make("heartbeat", rank=self.rank, **({"status": status} if status else {}))
                zmq_link.send_msg(self.dealer, beat, sealer=self.sealer)
                next_beat = now + self.timeouts.heartbeat_interval_s
            if now - self.heard > self.timeouts.coordinator_timeout_s:
                self.on_lost(f"the coordinator sent nothing for {now - self.heard:.0f}s (it died, or its host is "
                             f"unreachable; raise MAESTRO_COORDINATOR_TIMEOUT_S if it can be that slow): exiting")
        # Flush what the compute thread queued last (its bye / error) before closing; the
        # linger lets the context's termination wait until those frames are on the wire.
        while self.events.poll(0):
            self.dealer.send(self.sealer.seal(self.events.recv()))
        self.events.close(linger=0)
        self.dealer.close(linger=2000)


def use_interface(host: str, interface: str | None) -> None:
    """gloo (and NCCL's bootstrap) listen on the run's interface: the one named, else loopback
    when the control plane is on loopback (they would pick the host's first address)."""
    if interface is None and zmq_link.is_loopback(host):
        names = {name for _, name in socket.if_nameindex()}
        interface = "lo" if "lo" in names else None
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def _await_init(dealer: zmq.Socket, opener: Opener, drops: DropLog, deadline: float) -> dict | None:
    """The coordinator's init (sealed); anything else on the socket is dropped. None at the deadline."""
    while dealer.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
        try:
            sender, msg = zmq_link.open_msg(opener, dealer.recv())
        except Rejected as exc:
            drops.drop("the coordinator's socket", str(exc))
            continue
        if sender == "coordinator" and msg["t"] == "init":
            return msg
    return None


def _outlive_term(signum: int, frame: Any) -> None:
    """SIGTERM taken and let be, not ignored (SIG_IGN): a process the stage starts (exec) gets the
    default action back, so its own terminate() still stops it (found in review)."""


def worker_main(boot: dict[str, Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the coordinator, which stops us
    if boot.get("keep_on_term"):  # --checkpoint-on-term: a scheduler's SIGTERM to every process (runtime/stops.py)
        signal.signal(signal.SIGTERM, _outlive_term)
    if boot.get("cpus"):
        os.sched_setaffinity(0, boot["cpus"])  # before any library starts its threads
    capture = OutputCapture(boot.get("label", f"rank {boot['rank']}"), boot.get("log"))
    name_process(boot.get("label", str(boot["rank"])))
    die_with_parent(boot["parent_pid"])
    rank = boot["rank"]
    timeouts = Timeouts(**boot["timeouts"])
    use_interface(boot.get("host", zmq_link.LOOPBACK), boot.get("interface"))
    key = derive_key(bytes.fromhex(boot["secret"]), boot["session"])
    link = (Sealer(key, f"rank{rank}", "coordinator"), Opener(key, f"rank{rank}", zmq_link.CONTROL_MAX_BYTES))
    drops = DropLog(f"worker {boot.get('label', rank)}")
    zctx = zmq.Context()
    dealer = zmq_link.connect(zctx, zmq.DEALER, boot["coordinator"], key=key)  # the coordinator binds it by its hello
    pull, data_addr = zmq_link.bind(zctx, zmq.PULL, boot.get("host", zmq_link.LOOPBACK),
                                    max_bytes=zmq_link.HEADER_MAX_BYTES, key=key)
    from maestro_flow.transport.host import host_key

    zmq_link.send_msg(dealer, make("hello", version=PROTOCOL_VERSION, rank=rank, pid=os.getpid(), data_addr=data_addr,
                                   host_key=host_key()), sealer=link[0])
    init = _await_init(dealer, link[1], drops, time.monotonic() + timeouts.startup_s)
    if init is None:
        os._exit(NO_INIT_EXIT)  # the coordinator never answered; it reports the missing worker itself
    received = time.time()
    inbox: queue.Queue = queue.Queue()
    def lost(text: str) -> None:
        capture.report(text)
        os._exit(GAVE_UP_EXIT)

    control = _Control(zctx, dealer, rank, inbox, timeouts, link, drops, lost)
    control.thread.start()
    out = control.outbound()
    worker = _Worker(init, inbox, out, pull, zctx, timeouts, key)
    worker.session = boot["session"]
    worker.detail, worker.keep = capture.detail, capture.keep
    worker.threads = boot.get("threads")
    # This host's wall clock -> the coordinator's: none on its host; else its reading at sending
    # against ours at receiving (off by the message's latency).
    worker.clock_offset_s = 0.0 if init["now"] is None else init["now"] - received
    worker.control = control
    code = worker.run()
    if worker.comm is not None:
        worker.comm.close()
    out.close(linger=2000)
    control.stopped.set()
    control.thread.join(timeout=2.0)
    # term() returns once every socket is closed and its last frames sent; bounded, because a
    # channel thread stuck in a transfer that will never complete may still hold its socket.
    closer = threading.Thread(target=zmq_link.term, args=(zctx,), daemon=True)
    closer.start()
    closer.join(timeout=3.0)
    # What the stage registered with atexit (stopping a helper it started, flushing a file) runs
    # as at a normal exit, which os._exit skips; bounded, as a handler may wait on anything.
    handlers = threading.Thread(target=atexit._run_exitfuncs, name="atexit", daemon=True)
    handlers.start()
    handlers.join(timeout=timeouts.shutdown_grace_s)
    stop_children()
    capture.close()
    os._exit(code)  # channel threads may sit in a receive that will never complete


class _Worker:
    def __init__(self, init: dict[str, Any], inbox: queue.Queue, out: zmq.Socket, pull: zmq.Socket,
                 zctx: zmq.Context, timeouts: Timeouts, key: bytes) -> None:
        self.init, self.inbox, self.out, self.pull, self.zctx, self.timeouts = init, inbox, out, pull, zctx, timeouts
        self.key = key  # seals tensor headers to peers (protocol/auth.py)
        self.io_threads = cpus.IoThreads()  # where its threads but the compute thread run
        self.rank = init["rank"]
        self.comm = None
        self.control: _Control | None = None
        self.clock_offset_s = 0.0
        self.section, self.replica, self.step, self.tp = "?", -1, None, 1
        self.phase = "setup"
        self.state = None  # checkpoint.section_state.SectionState, once set up
        self.detail = print  # where tracebacks behind a one-line report go (the worker's log)
        self.keep: Any = lambda text: None  # the worker's log only (reported errors)
        self.threads: int | None = None  # torch threads, when pinned to cores (--pin-cpus)
        self.session = "local"  # the attempt's nonce: names this worker's shared-memory slots
        self.setup_marks: dict[str, float] = {}  # seconds of each part of the setup (startup breakdown)
        self.cpu_mark = 0.0  # the process's CPU when it was ready, then at its last step report

    def send(self, t: str, **fields: Any) -> None:
        zmq_link.send_msg(self.out, make(t, rank=self.rank, **fields))

    def report_step(self, kind: str, body: dict[str, Any]) -> None:
        """The executor's reports; a step's "done" also carries this process's CPU seconds (all
        its threads: compute, transfers, decoding) since the last one (metrics: sections.*.cpu_s)."""
        if kind == "done":
            cpu = time.process_time()
            body["stats"]["cpu_s"] = cpu - self.cpu_mark
            self.cpu_mark = cpu
        self.send(kind, **body)

    def report_error(self, kind: str, text: str) -> None:
        self.keep(text)  # the worker's log keeps it, whatever the coordinator makes of the report
        self.send("error", kind=kind, section=self.section, replica=self.replica, step=self.step,
                  phase=self.phase, traceback=text)

    def run(self) -> int:
        from maestro_flow.runtime.executor_state import StageFault, tp_hint

        executor = None
        try:
            executor = self._setup()
            if executor is None:
                return 1
            if self.control is not None:
                self.control.status = lambda: dict(executor.status)
            self.cpu_mark = time.process_time()  # the first step's CPU leaves the setup out
            self.send("ready", setup=self.setup_marks)
            return self._loop(executor)
        except StageFault as fault:
            self.step, self.phase = fault.step, fault.phase
            hint = tp_hint(fault.text, self.tp, self.section, getattr(executor, "stage", None))
            self.report_error("system" if fault.collateral else "stage", fault.text + hint)
        except PipelineError as exc:  # bad input found here, e.g. a checkpoint that does not fit
            self.report_error("input", str(exc))
        except Exception:
            if self.phase == "step" and executor is not None and executor.current is not None:
                self.step = executor.current.step  # poll() may have finished a step and begun the next
            self.report_error("system", traceback.format_exc())
        return 1

    def _setup(self):
        t0 = time.perf_counter()
        import torch
        import torch.distributed as dist

        from maestro_flow.checkpoint.section_state import SectionState
        from maestro_flow.config import Pipeline
        from maestro_flow.graph import SectionGraph
        from maestro_flow.optim.reduce import GradientReducer
        from maestro_flow.parallel.section import parallelize_section
        from maestro_flow.planner.plan import Placement
        from maestro_flow.runtime.build import add_paths, build_stage, open_source
        from maestro_flow.runtime.executor import SectionExecutor
        from maestro_flow.runtime.executor_state import STAGE_RAISES, recording
        from maestro_flow.runtime.topology import process_groups
        from maestro_flow.runtime.trace import Tracer
        from maestro_flow.transport.tensor_comm import TensorComm

        init = self.init
        add_paths(init["paths"])
        pipeline = Pipeline.from_dict(init["pipeline"])
        placement = Placement.from_dict(init["placement"])
        graph = SectionGraph(pipeline)
        self.section, self.replica = placement.who(self.rank)
        section = graph.sections[self.section]
        self.tp = section.tp
        device = placement.devices[self.rank]
        # CPU workers share the host's cores; without this each one would start a thread per core.
        # A pinned worker (--pin-cpus) is told its thread count with its cores (runtime/cpus.py).
        cpu_workers = sum(1 for d in placement.devices.values() if d == "cpu") or 1
        threads = (cpus.env_threads() or self.threads
                   or max(1, (os.cpu_count() or 1) // cpu_workers))
        torch.set_num_threads(threads)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        torch.set_default_dtype(getattr(torch, pipeline.dtype))  # this process is this pipeline's
        marks = {"imports_s": time.perf_counter() - t0}
        # A sharded section on a GPU is built on the CPU and reaches the device shard by shard.
        staged = device.startswith("cuda") and (section.fsdp or section.tp > 1)
        try:
            stage = build_stage(pipeline, section, self.replica, device, keep_on_cpu=staged)
        except PipelineError as exc:  # the stage as built breaks the contract (a parameter outside its modules)
            self.report_error("input", str(exc))
            return None
        except STAGE_RAISES:
            self.report_error("stage", traceback.format_exc())
            return None
        marks["stage_s"] = time.perf_counter() - t0 - sum(marks.values())
        source = open_source(pipeline)
        host, port, prefix = init["store"]
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self.timeouts.startup_s))
        if prefix:  # the job's rendezvous store (several nodes): this attempt's keys only
            store = dist.PrefixStore(prefix, store)
        # gloo connects the ranks of a group when they first talk, not all pairs at creation: an
        # edge's group then costs a connection per channel, and the world group none it does not use.
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
        uses_cuda = any(d.startswith("cuda") for d in placement.devices.values())
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if uses_cuda else "gloo", store=store, rank=self.rank,
                                world_size=placement.world_size,
                                timeout=timedelta(seconds=self.timeouts.collective_s))
        shm = [tuple(ch) for ch in init["shm"]]  # channels through shared memory (transport/shm.py)
        ipc = [tuple(ch) for ch in init.get("ipc", ())]  # through CUDA IPC (transport/cuda_ipc.py)
        marks["world_s"] = time.perf_counter() - t0 - sum(marks.values())
        groups = process_groups(graph, placement, self.rank, self.timeouts.collective_s, self.timeouts.checkpoint_s)
        marks["groups_s"] = time.perf_counter() - t0 - sum(marks.values())
        try:
            # A lockstep section (parallel/fsdp.py) gathers per micro-batch (the coordinator agrees:
            # PlanMessages); recorded for replay too (a sharded section records no weights).
            layout = parallelize_section(stage, section, placement, self.rank, groups, torch.device(device),
                                         per_micro_batch=graph.lockstep(self.section))
            if staged:  # what no plan or unit sharded (norms, buffers): whole, onto the device
                for module in stage.modules().values():
                    module.to(torch.device(device))
        except PipelineError as exc:  # a layout that cannot train right (parallel/section.py says why)
            self.report_error("input", str(exc))
            return None
        except STAGE_RAISES:
            self.report_error("stage", traceback.format_exc())  # the stage's plan or parallelize failed
            return None
        tracer = Tracer(enabled=init["trace"], offset_s=self.clock_offset_s, epoch=init["epoch"])
        comm = TensorComm(zctx=self.zctx, rank=self.rank, pull=self.pull, key=self.key,
                          peers={int(k): v for k, v in init["peers"].items()}, groups=groups.channels,
                          device=torch.device(device),
                          deliver=lambda *a: self.inbox.put(("tensors", a)),
                          on_error=lambda text: self.inbox.put(("comm_error", text)),
                          tracer=tracer if tracer.enabled else None,
                          relay=(layout.members, groups.relay) if len(layout.members) > 1 else None,
                          timeout_s=self.timeouts.collective_s, shm=shm,
                          shm_prefix=f"maestro-{self.session}-{self.rank}", ipc=ipc)
        self.comm = comm
        executor = SectionExecutor(
            stage=stage, graph=graph, placement=placement, section=self.section, replica=self.replica,
            source=source, comm=comm, report=self.report_step,
            device=torch.device(device), dtype=getattr(torch, pipeline.dtype),
            reducer=GradientReducer(groups.dp) if section.trainable and section.dp > 1 else None, tracer=tracer,
            record=recording(init["record"], self.section, self.replica, whole=not section.fsdp and section.tp == 1),
            layout=layout)
        self.state = SectionState(stage, executor.optim, section=self.section, replica=self.replica,
                                  group=groups.section, device=torch.device(device), tp_index=layout.tp_index,
                                  seed=pipeline.seed)
        if init.get("resume"):
            note = self.state.load(init["resume"], layout=(section.dp, section.tp))
            if note:
                print(f"resume: {note}", flush=True)
            if self.state.standin is not None and executor.fsdp is not None and executor.fsdp.per_micro_batch:
                from maestro_flow.runtime import lockstep

                executor.last_batch = lockstep.unpack(self.state.standin)  # stands in as before the stop
        marks["rest_s"] = time.perf_counter() - t0 - sum(marks.values())
        self.setup_marks = marks
        return executor

    def _loop(self, executor) -> int:
        from maestro_flow.checkpoint.savedir import save_stage

        self.phase = "step"
        # Nothing may come for a whole step elsewhere (plans, inputs, gradients), nor while other
        # workers load (a resume: the first plan waits for every worker's ready) or write a
        # checkpoint; past the longest of the coordinator's own waits and its silence limit, this
        # worker gives up on its own.
        t = self.timeouts
        limit_s = max(t.step_s, t.startup_s) + t.checkpoint_s + t.coordinator_timeout_s
        while True:
            try:
                item = self.inbox.get(timeout=limit_s)
            except queue.Empty:
                state = dict(executor.status)
                raise TimeoutError(f"worker {self.section}[{self.replica}] (rank {self.rank}) waited {limit_s:.0f}s "
                                   f"for a plan, inputs or gradients while {state.get('state')} (step "
                                   f"{state.get('step')}); raise MAESTRO_STEP_S (MAESTRO_CHECKPOINT_S) if steps "
                                   f"(checkpoints) can be that slow") from None
            kind, body = item
            if kind == "tensors":
                executor.deliver(*body)
            elif kind == "comm_error":
                self.report_error("system", body)
                return 1
            elif body["t"] == "plan":
                self.io_threads.place(body.get("io_cpus"))  # (--pin-cpus)
                executor.add_plan(body)
            elif body["t"] == "finalize":
                executor.finalize(body["step"], body["denominator"])
            elif body["t"] == "clip":
                executor.clip(body["step"], body["coef"])
            elif body["t"] == "checkpoint":
                self._checkpoint(executor, body["step"], body["path"])
            elif body["t"] == "stop":
                sharded = executor.layout.mesh is not None  # then every rank takes part in gathering
                if body["save_dir"] and executor.trainable and (sharded or self.replica == 0):
                    # after the last step (found in QA: a sharded rank, whose loop had not moved its step, said 0)
                    self.phase, self.step = "saving to --save-dir", self.init["pipeline"]["steps"] - 1
                    try:
                        save_stage(executor.stage, body["save_dir"], self.section,
                                   write=self.replica == 0 and executor.layout.leader)
                    except OSError as exc:
                        self.detail(traceback.format_exc())
                        self.report_error("system", f"--save-dir {body['save_dir']}: cannot write section "
                                                    f"{self.section!r}: {exc.strerror or exc}")
                        return 1
                self.send("bye")
                return 0
            # Drain everything already queued before computing, so a poll sees all arrivals.
            if not self.inbox.empty():
                continue
            if executor.current is not None:
                self.step = executor.current.step
            executor.poll()
            self.comm.reap()  # out of work: give back the shared-memory slots it is done with
            while self.inbox.empty() and executor.prefetch():
                pass  # and prepare what comes next, one micro-batch at a time, while nothing arrives

    def _checkpoint(self, executor, step: int, path: str) -> None:
        """Save this replica's part at a step boundary; a failure is reported, not fatal (the
        coordinator decides: stop cleanly, or go on without this checkpoint)."""
        from torch.distributed.checkpoint.api import CheckpointException

        from maestro_flow.runtime import lockstep

        assert executor.idle, "a checkpoint was asked for with work in flight"
        self.phase, self.step = "checkpoint", step - 1  # the index of the step it follows (`step` steps are done)
        try:
            info = self.state.save(path, standin=lockstep.pack(executor.last_batch))
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
            self.detail(f"checkpoint at step {step} failed:\n{traceback.format_exc()}")
            self.send("saved", step=step, info={}, error=self.state.cause(exc))
        else:
            self.send("saved", step=step, info=info, error=None)
        self.phase = "step"
