"""The status endpoint (runtime/status.py) under a flood, at close and across an automatic
restart, and a run dir that a live run uses (runtime/rundir.py): each a reviewer's reproduction."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from maestro_flow.runtime.status import StatusServer, ended, query, release
from tests.integration.conftest import ASSETS, ROOT, maestro, worker_pids

ATTACK = """
import socket, sys, threading, time
port, megabytes = int(sys.argv[1]), int(sys.argv[2])
def big():  # one request of `megabytes` MB, never a newline
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        for _ in range(megabytes):
            s.sendall(b"x" * (1 << 20))
    except OSError:
        pass
def many():  # connections as fast as they open, each with 64 KB of junk
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"y" * 65536)
        except OSError:
            pass
threads = [threading.Thread(target=big)] + [threading.Thread(target=many) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
"""


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_flood_leaves_the_status_server_small_and_answering(tmp_path):
    # Reproduced before (ZeroMQ ROUTER, by a one-off script): one multi-part request of 2,000,000
    # frames of 200 bytes was held whole in the coordinator (libzmq assembles a whole message first).
    server = StatusServer(str(tmp_path))
    try:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        server.publish({"step": 3})
        port = int(server.endpoint.rsplit(":", 1)[1])
        before = peak = _rss_mb()
        attacker = subprocess.Popen([sys.executable, "-c", ATTACK, str(port), "500"])
        try:
            while attacker.poll() is None:
                peak = max(peak, _rss_mb())
                time.sleep(0.05)
        finally:
            attacker.kill()
            attacker.wait(10)
        assert peak - before < 20, f"the status server grew by {peak - before:.0f} MB under the flood"
        assert server.answered == 0  # junk is never answered
        assert query(str(tmp_path), timeout_s=5.0) == {"step": 3}  # a normal client, right after
        assert server.answered == 1
    finally:
        server.close()
        release(str(tmp_path))


def test_close_is_prompt_and_leaves_no_thread_or_port(tmp_path):
    server = StatusServer(str(tmp_path))
    port = int(server.endpoint.rsplit(":", 1)[1])
    idle = socket.create_connection(("127.0.0.1", port))  # being served: connected, its request not sent
    time.sleep(0.05)
    started = time.monotonic()
    server.close()
    took = time.monotonic() - started
    idle.close()
    server.close()  # idempotent
    assert took < 0.1, f"close() took {took:.2f}s"
    assert not any(t.name == "status" for t in threading.enumerate())
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        raise AssertionError("the status port still accepts connections after close()")
    except ConnectionRefusedError:
        pass
    release(str(tmp_path))


def test_top_sees_the_next_attempt_across_a_restart(tmp_path):
    """Reproduced before (/tmp/rev_cli/sim_restart.py): an attempt's close() removed status.json
    before the next attempt wrote its own; a `top` reading in that gap said the run had ended.
    status.json is the job's now: it names the old endpoint until the next attempt's replaces it,
    and a query in the gap waits for that one."""
    run = str(tmp_path)
    first = StatusServer(run)
    first.publish({"attempt": 1})
    assert query(run) == {"attempt": 1}
    first.close()  # the attempt fails and will be retried
    assert os.path.exists(os.path.join(run, "status.json")) and ended(run) is None  # top: still running
    answers: list = []
    waiting = threading.Thread(target=lambda: answers.append(query(run, timeout_s=5.0)))
    waiting.start()  # asks during the gap
    time.sleep(0.3)
    second = StatusServer(run)
    second.publish({"attempt": 2})
    waiting.join(10)
    assert answers == [{"attempt": 2}] or answers == [{"starting": True}]
    assert query(run) == {"attempt": 2}
    second.close()
    (tmp_path / "events.jsonl").write_text('{"ended": "done"}\n')  # what the job writes last (run.py)
    release(run)  # the job is over (RunDir.close)
    assert not os.path.exists(os.path.join(run, "status.json"))
    assert ended(run) == f"{run}: the run has ended before any step was recorded"


def test_top_follows_a_run_through_an_automatic_restart(demo_data, tmp_path):
    """A real run whose worker is killed and restarted (--max-restarts 1): status.json is there
    from its first attempt's start to the job's end (it was missing for 1-2 ms at each restart
    before), with the second attempt's endpoint in the end, and a watching `top` ends with the
    last step."""
    run_dir = tmp_path / "run"
    status = run_dir / "status.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "maestro_flow.cli", "run", str(ASSETS / "faulty.py"), "--quiet", "--steps", "20",
         "--run-dir", str(run_dir), "--max-restarts", "1", "--set", f"data.path={demo_data}",
         "--set", "sections.student.config.sleep_s=0.05"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher = None
    try:
        deadline = time.monotonic() + 90
        while len(worker_pids(proc.pid)) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        first = json.loads(status.read_text())["endpoint"]
        watcher = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", "top", str(run_dir), "--interval",
                                    "0.05"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2.0)  # training
        os.kill(worker_pids(proc.pid)[-1], signal.SIGKILL)
        gaps, gone, endpoints = 0, False, {first}
        while proc.poll() is None and time.monotonic() < deadline + 90:
            try:
                endpoints.add(json.loads(status.read_text())["endpoint"])
                gaps += gone  # it was gone, and the job went on
                gone = False
            except FileNotFoundError:
                gone = True  # (for good once the job is over)
            time.sleep(0.0005)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "restart 1/1" in err
        assert gaps == 0, "status.json went missing while the job ran (top would say the run ended)"
        assert len(endpoints) == 2, endpoints  # each attempt's, the second written over the first
        out, werr = watcher.communicate(timeout=30)
        assert watcher.returncode == 0, werr
        assert re.search(r"the run has ended after step 20, loss \d+\.\d{4}$", out.rstrip()), out[-300:]
    finally:
        for p in (proc, watcher):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    assert not status.exists()  # the job is over


def test_a_run_dir_that_a_live_run_uses_is_refused(demo_data, tmp_path):
    """Reproduced before: a second `maestro run --run-dir R` while the first trained moved the
    first run's status.json and metrics to R/previous-1, and `maestro top R` said it was not
    running. Refused now with one line, exit 2, before any worker starts; the folder is untouched."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # stands for the live run
    try:
        (run_dir / "status.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": first.pid}))
        (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 2.5}\n')
        result = maestro("run", "pipelines/distill.py", "--colocated", "--steps", "2", "--run-dir", str(run_dir),
                         "--set", f"data.path={demo_data}", "--quiet", timeout=120)
    finally:
        first.kill()
        first.wait(10)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --run-dir {run_dir} is in use by a run still going "
                                                   f"(pid {first.pid})"), result.stderr
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl", "status.json"]
