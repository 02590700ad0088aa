"""The read-only status endpoint of a running pipeline, and its client (`maestro top`).

`StatusServer` runs in the coordinator: a ROUTER socket that answers every request with the last
snapshot the coordinator published (step, loss, step time, and per worker what it is doing now,
its section's busy fraction, inputs it holds and transfers in flight, from the workers'
heartbeats). It only ever reads: a client cannot change the run. It cannot slow training either:
its own thread answers at most `rate` requests a second with a snapshot serialised once per
publish, requests over 256 bytes are refused by ZeroMQ, and at most 64 per client wait queued
(then TCP pushes back on the flooding client), so a flood costs neither the coordinator's
memory nor its loop. The endpoint and the coordinator's pid are written to RUN_DIR/status.json
so `maestro top` can find a run started in another terminal; a file whose pid is gone is stale.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import zmq

from maestro_flow.transport import zmq_link

REQUEST_MAX_BYTES = 256


class StatusServer:
    def __init__(self, zctx: zmq.Context, run_dir: str | None, host: str = zmq_link.LOOPBACK,
                 rate: float = 50.0) -> None:
        self.socket, self.endpoint = zmq_link.bind(zctx, zmq.ROUTER, host, max_bytes=REQUEST_MAX_BYTES, hwm=64)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a client gone before its answer is fine
        self.rate = rate
        self.answered = 0
        self._snapshot = json.dumps({"starting": True}).encode()
        self._stop = threading.Event()
        self.path = os.path.join(run_dir, "status.json") if run_dir else None
        if self.path:
            with open(self.path, "w") as f:
                json.dump({"endpoint": self.endpoint, "pid": os.getpid(), "started": time.time()}, f)
        self._thread = threading.Thread(target=self._serve, name="status", daemon=True)
        self._thread.start()

    def publish(self, snapshot: dict[str, Any]) -> None:
        """The coordinator's view, serialised once; requests get these bytes until the next one."""
        self._snapshot = json.dumps(snapshot).encode()

    def _serve(self) -> None:
        interval = 1.0 / self.rate
        while not self._stop.is_set():
            if not self.socket.poll(100):
                continue
            frames = self.socket.recv_multipart()
            if len(frames) >= 2:
                self.socket.send_multipart([frames[0], b"", self._snapshot])
                self.answered += 1
            time.sleep(interval)  # the rate limit: the rest waits queued (bounded by the HWM)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.socket.close(linger=0)
        if self.path and os.path.exists(self.path):
            os.remove(self.path)  # the run is over: nothing to attach to


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live(run_dir: str) -> bool:
    """The run dir's status.json names a coordinator that is still running."""
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            return _alive(json.load(f).get("pid"))
    except (OSError, ValueError, AttributeError):
        return False


def find_run(run_dir: str | None, root: str = "runs") -> str:
    """The given run directory, or the most recent one under `root` that is running."""
    if run_dir:
        if not os.path.exists(os.path.join(run_dir, "status.json")):
            raise FileNotFoundError(f"{run_dir} has no status.json: the run is not running (or wrote no run dir)")
        if not _live(run_dir):
            raise FileNotFoundError(f"{run_dir}/status.json is stale: the coordinator that wrote it is gone")
        return run_dir
    live = [os.path.join(root, d) for d in os.listdir(root)] if os.path.isdir(root) else []
    live = [d for d in live if _live(d)]
    if not live:
        raise FileNotFoundError(f"no running pipeline under {root}/ (start one with maestro run, or name its run dir)")
    return max(live, key=os.path.getmtime)


def ended(run_dir: str) -> str | None:
    """What `top` says once the run it watched is over (None while its coordinator runs): the
    last step the run dir's metrics.jsonl recorded."""
    if _live(run_dir):
        return None
    last = None
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                if line.strip():
                    last = line
        row = json.loads(last) if last else None
    except (OSError, ValueError):
        row = None
    if not isinstance(row, dict) or "step" not in row:
        return f"{run_dir}: the run has ended"
    loss = row.get("loss")
    return (f"{run_dir}: the run has ended; its last step was {row['step']}"
            + (f", loss {loss:.4f}" if isinstance(loss, (int, float)) else ""))


def query(run_dir: str, timeout_s: float = 2.0) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            endpoint = json.load(f)["endpoint"]
    except (ValueError, KeyError, TypeError):
        raise FileNotFoundError(f"{run_dir}/status.json is not a maestro status file (no endpoint)") from None
    ctx = zmq.Context.instance()
    sock = zmq_link.connect(ctx, zmq.REQ, endpoint)
    try:
        sock.send(b"status")
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"the run at {endpoint} did not answer within {timeout_s:.1f}s")
        return json.loads(sock.recv())
    finally:
        sock.close(linger=0)


def _clean(value: Any, width: int = 40) -> str:
    """Printable text only: control characters (terminal escapes) shown escaped, long text cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))
    return text if len(text) <= width else text[:width - 3] + "..."


def render(snapshot: dict[str, Any]) -> str:
    """The `maestro top` screen. Everything shown passes through _clean: the snapshot's text
    comes from workers' heartbeats and the pipeline's names."""
    s = snapshot
    if s.get("starting"):
        return "the run is starting (no worker has reported yet)"
    loss = s.get("loss")
    loss_s = f"{loss:.4f}" if isinstance(loss, float) else (
        " ".join(f"{k}={v:.4f}" for k, v in loss.items()) if isinstance(loss, dict) else "-")
    step_time = s.get("step_time_s")
    head = f"{_clean(s['pipeline'])}  step {_clean(s['step'])}/{_clean(s['steps'])}"
    lines = [f"{head}  loss {_clean(loss_s, 80)}  step time {step_time:.3f}s"
             if isinstance(step_time, (int, float)) else head,
             "",
             f"{'worker':<16} {'doing now':<22} {'step':>5} {'mb':>4} {'busy':>6} {'inputs held':>11} "
             f"{'in flight':>9} {'seen':>6}"]
    for w in s["workers"]:
        busy = w.get("busy_fraction")
        busy_s = f"{busy:.0%}" if isinstance(busy, (int, float)) else "-"
        lines.append(f"{_clean(w['name'], 16):<16} {_clean(w.get('state', '?'), 22):<22} {_dash(w.get('step')):>5} "
                     f"{_dash(w.get('mb')):>4} {busy_s:>6} {_dash(w.get('buffered')):>11} "
                     f"{_dash(w.get('in_flight')):>9} {w['seen_s']:>5.1f}s")
    return "\n".join(lines)


def _dash(v: Any) -> str:
    return "-" if v is None else _clean(v, 11)
