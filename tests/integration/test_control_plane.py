"""The control plane under attack on loopback: forged, malformed, oversized and replayed frames
are dropped and logged; training ends exactly as without them (issue 9's reproductions).

A real section-mode run (distill, float64, fixed costs so every run plans alike) is attacked by
a thread of the test process that knows the coordinator's and the workers' endpoints (what a
port scan finds) but not the run's secret.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from maestro_flow.graph import SectionGraph
from maestro_flow.protocol.codec import encode
from maestro_flow.protocol.messages import PROTOCOL_VERSION, make
from maestro_flow.runtime.coordinator import Coordinator
from maestro_flow.runtime.report import RunReport
from maestro_flow.runtime.sampler import EpochSampler
from maestro_flow.runtime.status import query as status_query
from maestro_flow.timeouts import Timeouts
from tests.integration.conftest import ASSETS, ROOT, wait_gone, worker_pids

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
STEPS = 4


def coordinator(demo_data) -> Coordinator:
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.checks import check_pipeline

    pipeline, paths = load_pipeline(str(ROOT / "pipelines" / "distill.py"), {
        "data.path": str(demo_data), "steps": STEPS, "dtype": "float64", "adapt_costs": False})
    checked = check_pipeline(pipeline)
    sampler = EpochSampler(checked.metadata, pipeline.global_batch, pipeline.seed)
    return Coordinator(pipeline, SectionGraph(pipeline), sampler,
                       RunReport(total_steps=STEPS, metrics_out=None, show_progress=False), paths=paths,
                       timeouts=Timeouts(startup_s=60, step_s=60))


def losses(c: Coordinator) -> list[float]:
    return [row["loss"] for row in c.report.rows]


class Attacker(threading.Thread):
    """Connects as soon as the coordinator listens (before any worker's hello) and keeps at it
    until told to stop."""

    def __init__(self, target: Coordinator) -> None:
        super().__init__(daemon=True)
        self.target, self.stop = target, threading.Event()
        self.sent = 0

    def run(self) -> None:
        ctx = zmq.Context()
        socks = []

        def dealer(identity: bytes | None) -> zmq.Socket:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if identity is not None:
                s.setsockopt(zmq.IDENTITY, identity)
            s.connect(self.target.address)
            socks.append(s)
            return s

        while self.target.address is None and not self.stop.is_set():
            time.sleep(0.001)
        # Identity hijack: take the identities the workers used to have, before they connect.
        squatters = [dealer(str(r).encode()) for r in range(3)]
        for r, s in enumerate(squatters):
            s.send(encode(make("hello", version=PROTOCOL_VERSION, rank=r, pid=1, data_addr="tcp://127.0.0.1:1")))
        forger = dealer(b"+1")
        junk = [b"", b"\xc1", b"\xff" * 64, msgpack.packb({"t": "loss", "rank": 1}),
                msgpack.packb({"t": "loss", "rank": "x", "step": [], "loss_sum": None, "denominator": {}}),
                msgpack.packb([1, 2, 3]), b"\0" * 200]
        big_sent = False
        while not self.stop.is_set():
            for step in range(STEPS):  # a huge denominator would scale every gradient to nothing
                forger.send(encode(make("loss", rank=1, step=step, loss_sum=1.0, denominator=1e30)))
                forger.send(encode(make("done", rank=1, step=step, stats={"busy_s": 1.0})))
            forger.send(encode(make("error", rank=1, kind="stage", section="student", replica=0, step=0,
                                    phase="forward", traceback="FORGED TRACEBACK")))
            for frame in junk:
                forger.send(frame)
            forger.send_multipart([b"a", b"b", b"c"])
            for addr in self.target.peers.values():  # the workers' tensor-header sockets
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.connect(addr)
                push.send(encode(make("tensors", src=0, kind="fwd", edge=0, step=0,
                                      entries=[[0, "hidden", "float32", [1 << 40], 0, 0]],
                                      buffers=[["float32", 1 << 40]])))
                push.send(b"\x93garbage")
                socks.append(push)
            if not big_sent and self.target.peers:
                dealer(None).send(b"\0" * (512 << 20), copy=False)  # refused by the size limit
                big_sent = True
            self.sent += 1
            time.sleep(0.05)
        for s in socks:
            s.close(linger=0)
        ctx.term()


def test_forged_and_malformed_messages_change_nothing(demo_data, capfd):
    clean = coordinator(demo_data)
    clean.run()
    attacked = coordinator(demo_data)
    attacker = Attacker(attacked)
    attacker.start()
    try:
        attacked.run()  # ends normally: nothing forged is fatal
    finally:
        attacker.stop.set()
        attacker.join(timeout=30)
    assert attacker.sent > 0
    assert len(losses(attacked)) == STEPS
    assert losses(attacked) == pytest.approx(losses(clean), rel=1e-12, abs=0)
    assert attacked.drops.count > 0
    err = capfd.readouterr().err
    assert "the coordinator dropped a message from connection" in err
    assert "bad MAC" in err
    assert "tensor headers dropped a message" in err  # each worker logs what it dropped
    assert "FORGED TRACEBACK" not in err


def _start(demo_data, tmp_path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """A slow real run (the student sleeps 0.1 s per micro-batch) with a run directory."""
    return subprocess.Popen(
        [sys.executable, "-m", "maestro_flow.cli", "run", str(ASSETS / "faulty.py"), "--quiet",
         "--set", f"data.path={demo_data}", "--set", "sections.student.config.sleep_s=0.1",
         "--run-dir", str(tmp_path / "run"), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _wait_workers(proc: subprocess.Popen, n: int = 3) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = worker_pids(proc.pid)
        if len(workers) == n:
            return workers
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("workers did not start")


def _peak_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM")), 0) / 1024
    except OSError:  # it ended
        return 0.0


def test_a_status_flood_neither_grows_nor_stalls_the_coordinator(demo_data, tmp_path):
    # Reproduced before: flooding the status endpoint grew the coordinator from 280 MB to
    # 2.27 GB in 25 s, stalled training, then blamed a healthy worker for a heartbeat timeout;
    # then one multi-part ZeroMQ request of 2,000,000 frames grew it by 1.2 GB. The endpoint is a
    # plain TCP socket now: here one request that never ends, and connections as fast as they open.
    proc = _start(demo_data, tmp_path, "--steps", "12", env={"MAESTRO_HEARTBEAT_TIMEOUT_S": "3"})
    _wait_workers(proc)
    status = tmp_path / "run" / "status.json"
    deadline = time.monotonic() + 30
    while not status.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    host, port = json.loads(status.read_text())["endpoint"].removeprefix("tcp://").rsplit(":", 1)
    endless = socket.create_connection((host, int(port)))
    endless.setblocking(False)
    peak, opened, fed = 0.0, 0, 0
    t0 = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - t0 < 90:
            try:
                fed += endless.send(b"x" * 65536)
            except OSError:  # its buffers are full, or it was cut off
                pass
            for request in (b"status\n", b"status please " * 8, b"y" * 65536):
                try:
                    with socket.create_connection((host, int(port)), timeout=0.2) as s:
                        s.sendall(request)
                    opened += 1
                except OSError:  # the accept queue is full: the kernel pushes back
                    pass
            peak = max(peak, _peak_rss_mb(proc.pid))
        # The endpoint still answers, within its rate.
        answer = status_query(str(tmp_path / "run"), timeout_s=10.0) if proc.poll() is None else None
    finally:
        endless.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert opened > 100
    assert "heartbeat" not in err
    assert peak < 450, f"the coordinator grew to {peak:.0f} MB under the flood (about 280 MB without one)"
    assert answer is None or "workers" in answer or answer.get("starting")


def test_a_paused_coordinator_finds_its_workers_alive(demo_data, tmp_path):
    # Reproduced before: pausing the coordinator longer than the heartbeat timeout got every
    # worker declared dead (liveness was judged before the queued heartbeats were read).
    proc = _start(demo_data, tmp_path, "--steps", "40", env={"MAESTRO_HEARTBEAT_TIMEOUT_S": "2"})
    _wait_workers(proc)
    time.sleep(1.0)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(5.0)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err


def test_workers_leave_a_coordinator_that_went_silent(demo_data, tmp_path):
    # Reproduced before: workers never noticed a dead coordinator by themselves (only a dead
    # parent process, which a coordinator on another node is not).
    proc = _start(demo_data, tmp_path, "--steps", "1000", env={"MAESTRO_COORDINATOR_TIMEOUT_S": "3"})
    workers = _wait_workers(proc)
    time.sleep(1.0)
    proc.send_signal(signal.SIGSTOP)
    try:
        assert not wait_gone(workers, 15.0), "workers kept waiting for a silent coordinator"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.communicate(timeout=30)
    log = (tmp_path / "run" / "workers" / "teacher-0.log").read_text()
    assert "the coordinator sent nothing for" in log and "MAESTRO_COORDINATOR_TIMEOUT_S" in log


def _listening(pids: list[int]) -> list[str]:
    """Every TCP address the processes listen on ("127.0.0.1:port", "0.0.0.0:port", "[::]:port"...)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                addr, port = local.split(":")
                if v6:
                    host = "[::]" if set(addr) == {"0"} else f"[{addr}]"
                else:
                    host = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                out.append(f"{host}:{int(port, 16)}")
    return out


def test_everything_listens_on_loopback_only(demo_data, tmp_path):
    # Reproduced before: the TCPStore listened on all interfaces.
    proc = _start(demo_data, tmp_path, "--steps", "1000")
    try:
        workers = _wait_workers(proc)
        time.sleep(6.0)  # process groups formed, tensors flowing
        addresses = _listening([proc.pid, *workers])
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert len(addresses) >= 3 + 3, addresses  # control, status, store; each worker's header socket (and gloo)
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


def _report_environment(boot: dict) -> None:
    with open(boot["out"], "w") as f:
        f.write(os.environ.get("MAESTRO_SECRET", "<none>"))


def test_workers_do_not_inherit_the_users_secret(tmp_path, monkeypatch):
    """Found in review: every worker, and whatever its stage started, had MAESTRO_SECRET in its
    environment (a worker gets the key it needs in its boot record)."""
    from maestro_flow.runtime.launcher import Launcher

    monkeypatch.setenv("MAESTRO_SECRET", "victim-secret-0123456789abcdef")
    launcher = Launcher(_report_environment)
    launcher.start(0, "s", 0, {"out": str(tmp_path / "env")})
    try:
        assert launcher.join(60)
    finally:
        launcher.shutdown(0.5, 2.0)
    assert (tmp_path / "env").read_text() == "<none>"
    assert os.environ["MAESTRO_SECRET"] == "victim-secret-0123456789abcdef"  # this process keeps it
