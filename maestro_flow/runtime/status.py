"""The read-only status endpoint of a running pipeline, and its client (`maestro top`).

`StatusServer` runs in the coordinator: a ROUTER socket on loopback that answers every request
with a snapshot (step, loss, step time, and per worker what it is doing now, its section's busy
fraction, inputs it holds and transfers in flight, from the workers' heartbeats). It only ever
reads: a client cannot change the run, and a client that vanishes costs nothing. The endpoint is
written to RUN_DIR/status.json so `maestro top` can find a run started in another terminal.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import zmq

from maestro_flow.transport import zmq_link


class StatusServer:
    def __init__(self, zctx: zmq.Context, run_dir: str | None) -> None:
        self.socket, self.endpoint = zmq_link.bind(zctx, zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a client gone before its answer is fine
        self.path = os.path.join(run_dir, "status.json") if run_dir else None
        if self.path:
            with open(self.path, "w") as f:
                json.dump({"endpoint": self.endpoint, "pid": os.getpid(), "started": time.time()}, f)

    def answer(self, snapshot: dict[str, Any]) -> None:
        """Reply to every pending request (never blocks)."""
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            self.socket.send_multipart([frames[0], b"", json.dumps(snapshot).encode()])

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.path and os.path.exists(self.path):
            os.remove(self.path)  # the run is over: nothing to attach to


def find_run(run_dir: str | None, root: str = "runs") -> str:
    """The given run directory, or the most recent one under `root` that is running."""
    if run_dir:
        if not os.path.exists(os.path.join(run_dir, "status.json")):
            raise FileNotFoundError(f"{run_dir} has no status.json: the run is not running (or wrote no run dir)")
        return run_dir
    live = [os.path.join(root, d) for d in os.listdir(root)] if os.path.isdir(root) else []
    live = [d for d in live if os.path.exists(os.path.join(d, "status.json"))]
    if not live:
        raise FileNotFoundError(f"no running pipeline under {root}/ (start one with maestro run, or name its run dir)")
    return max(live, key=os.path.getmtime)


def query(run_dir: str, timeout_s: float = 2.0) -> dict[str, Any]:
    with open(os.path.join(run_dir, "status.json")) as f:
        endpoint = json.load(f)["endpoint"]
    ctx = zmq.Context.instance()
    sock = zmq_link.connect(ctx, zmq.REQ, endpoint)
    try:
        sock.send(b"status")
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"the run at {endpoint} did not answer within {timeout_s:.1f}s")
        return json.loads(sock.recv())
    finally:
        sock.close(linger=0)


def render(snapshot: dict[str, Any]) -> str:
    s = snapshot
    loss = s.get("loss")
    loss_s = f"{loss:.4f}" if isinstance(loss, float) else (
        " ".join(f"{k}={v:.4f}" for k, v in loss.items()) if isinstance(loss, dict) else "-")
    step_time = s.get("step_time_s")
    lines = [f"{s['pipeline']}  step {s['step']}/{s['steps']}  loss {loss_s}  "
             f"step time {step_time:.3f}s" if step_time else f"{s['pipeline']}  step {s['step']}/{s['steps']}",
             "",
             f"{'worker':<16} {'doing now':<22} {'step':>5} {'mb':>4} {'busy':>6} {'inputs held':>11} "
             f"{'in flight':>9} {'seen':>6}"]
    for w in s["workers"]:
        busy = w.get("busy_fraction")
        lines.append(f"{w['name']:<16} {w.get('state', '?'):<22} {_dash(w.get('step')):>5} {_dash(w.get('mb')):>4} "
                     f"{f'{busy:.0%}' if busy is not None else '-':>6} {_dash(w.get('buffered')):>11} "
                     f"{_dash(w.get('in_flight')):>9} {w['seen_s']:>5.1f}s")
    return "\n".join(lines)


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)
