"""The read-only status endpoint of a running pipeline, its client (`maestro top`), and the run
dir's status.json that leads one to the other.

`StatusServer` runs in the coordinator, served by a thread of its own: a plain TCP socket on
loopback (whatever --host says: `top` runs on the coordinator's host and finds the run through
RUN_DIR/status.json) that answers the request line `status` with the last snapshot the
coordinator published (step, loss, step time, and per worker what it is doing now, its section's
busy fraction, inputs it holds and transfers in flight, from the workers' heartbeats), then
closes the connection. It only ever reads: a client cannot change the run. It cannot slow
training or grow the coordinator's memory either: one connection is served at a time, a request
is read into at most 256 bytes for at most REQUEST_TIMEOUT_S, the snapshot is serialised once per
publish, and the thread takes at most `rate` connections a second; the others wait in the
kernel's accept queue (BACKLOG connections, then the kernel refuses more), so a flood can delay
`top`, never the run.

status.json holds the endpoint and the coordinator's pid with its start time (Linux: /proc), so a
file whose pid is gone, or was taken by another process since, is stale. It
belongs to the job, not to one attempt: each attempt of an automatic restart writes its endpoint
over the last one's (atomically: a reader never sees half a file), and the job's RunDir removes
it when the job is over (`release`), so `top` never finds the run gone while it restarts.
"""

from __future__ import annotations

import difflib
import json
import os
import selectors
import socket
import sys
import threading
import time
from typing import Any

from maestro_flow.errors import first_line
from maestro_flow.wording import count, cut

LOOPBACK = "127.0.0.1"
REQUEST = b"status"  # the one request: a line (b"status\n")
REQUEST_MAX_BYTES = 256
REQUEST_TIMEOUT_S = 0.25  # for a request to arrive once connected (a client sends it at once), and for its answer
BACKLOG = 16  # connections waiting to be served; past that the kernel refuses (or delays) new ones
ANSWER_MAX_BYTES = 64 << 20  # what the client reads at most (a snapshot is a few KB)


class StatusServer:
    def __init__(self, run_dir: str | None, rate: float = 50.0) -> None:
        self._listener = socket.create_server((LOOPBACK, 0), backlog=BACKLOG)
        self._listener.setblocking(False)
        self.endpoint = "tcp://{}:{}".format(*self._listener.getsockname()[:2])
        self.rate = rate
        self.answered = 0
        self._snapshot = json.dumps({"starting": True}).encode()
        self._stop = threading.Event()
        self._wake, self._waker = socket.socketpair()  # close() writes to _waker: every wait here ends
        self.path = os.path.join(run_dir, "status.json") if run_dir else None
        if self.path:
            try:
                before = _read(run_dir)  # an automatic restart's: the run's start stays (found in review)
                me = {"pid": os.getpid(), "pid_start": start_ticks(os.getpid())}
                started = before.get("started") if all(before.get(k) == v for k, v in me.items()) else None
                _write_atomic(self.path, {"endpoint": self.endpoint, **me, "started": started or time.time()})
            except OSError as exc:  # output never takes training down: only `maestro top` loses the run
                print(f"maestro: cannot write {self.path} ({exc.strerror or exc}); `maestro top` will not find "
                      "this run", file=sys.stderr, flush=True)
        self._thread = threading.Thread(target=self._serve, name="status", daemon=True)
        self._thread.start()

    def publish(self, snapshot: dict[str, Any]) -> None:
        """The coordinator's view, serialised once; requests get these bytes until the next one."""
        self._snapshot = json.dumps(snapshot).encode()

    def _serve(self) -> None:
        interval = 1.0 / self.rate
        with selectors.DefaultSelector() as waits:
            waits.register(self._listener, selectors.EVENT_READ)
            waits.register(self._wake, selectors.EVENT_READ)
            while not self._stop.is_set():
                waits.select(timeout=None)  # until a client connects or close() wakes us: no work meanwhile
                try:
                    conn, _ = self._listener.accept()
                except OSError:  # woken by close(), or the client gave up first
                    continue
                with conn:
                    if self._request(conn):
                        self._answer(conn)
                self._stop.wait(interval)  # the rate limit: the next client waits in the accept queue

    def _request(self, conn: socket.socket) -> bool:
        """Whether `conn` asked for the status within REQUEST_TIMEOUT_S; never holds more than
        REQUEST_MAX_BYTES of it."""
        conn.setblocking(False)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        data = b""
        with selectors.DefaultSelector() as waits:
            waits.register(conn, selectors.EVENT_READ)
            waits.register(self._wake, selectors.EVENT_READ)
            while b"\n" not in data:
                left = deadline - time.monotonic()
                if left <= 0 or len(data) >= REQUEST_MAX_BYTES or not waits.select(left) or self._stop.is_set():
                    return False
                try:
                    chunk = conn.recv(REQUEST_MAX_BYTES - len(data))
                except BlockingIOError:
                    continue
                except OSError:
                    return False
                if not chunk:
                    return False
                data += chunk
        return data.split(b"\n", 1)[0].strip() == REQUEST

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)  # a client that does not read gets cut off, not waited for
        try:
            conn.sendall(self._snapshot)
            self.answered += 1
        except OSError:
            pass

    def close(self) -> None:
        """Stops the thread and closes the port at once (a client being served is cut off).
        status.json stays: it is the job's (RunDir removes it with `release`)."""
        self._stop.set()
        try:
            self._waker.send(b"x")
        except OSError:  # closed already
            pass
        self._thread.join(timeout=2.0)
        for s in (self._listener, self._wake, self._waker):
            s.close()


def _write_atomic(path: str, record: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def release(run_dir: str) -> None:
    """The job is over: remove run_dir/status.json if this process wrote it (a file of another
    run is left alone)."""
    path = os.path.join(run_dir, "status.json")
    if _read(run_dir).get("pid") == os.getpid():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _read(run_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat's 22nd field); None
    where /proc cannot tell (not Linux, or no such process). A pid the kernel gives to a new
    process after the old one ended has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # after the command name, which may hold ") "
    except (OSError, ValueError, IndexError):
        return None


def _alive(record: dict[str, Any]) -> bool:
    """The process status.json `record` names still runs (and is the one that wrote it)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = record.get("pid_start")
    if isinstance(started, int):  # written by a coordinator that could tell its start time
        now = start_ticks(pid)
        if now is not None and now != started:
            return False  # the pid was reused: the coordinator that wrote the file is gone
    return True


def live_pid(run_dir: str) -> int | None:
    """The pid of the coordinator that run_dir/status.json names, while it runs (else None)."""
    record = _read(run_dir)
    return record["pid"] if _alive(record) else None


def _live(run_dir: str) -> bool:
    """The run dir's status.json names a coordinator that is still running."""
    return live_pid(run_dir) is not None


START_WAIT_S = 60.0  # how long `maestro top RUN_DIR` waits for a run to start there (not with --once)


class NotYet(FileNotFoundError):
    """No run in the run directory given, and none that ended there: one may be starting."""


class Over(FileNotFoundError):
    """The run in the run directory given has ended (or its process is gone): a new one may start there."""


def find_run(run_dir: str | None, root: str = "runs", wait_s: float = 0.0, say: Any = None) -> str:
    """The given run directory, or the most recent one under `root` that is running. `wait_s`: how
    long to wait for a run to start in the given directory (found in QA: `top` started beside
    `maestro run --run-dir DIR` said there was no such directory), said once through `say`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _find_run(run_dir, root)
        except (NotYet, Over) as exc:  # found in review: a new run in a reused run dir was taken for the old one
            if time.monotonic() >= deadline:
                raise
            if say is not None:
                said = f"{exc}; waiting" if isinstance(exc, Over) else "waiting"
                say(f"{said} up to {wait_s:.0f}s for a {'new ' if isinstance(exc, Over) else ''}run to start in "
                    f"{run_dir or root + '/'} (Ctrl-C stops){_hint(run_dir)}")
                say = None
            time.sleep(0.2)


def _hint(run_dir: str | None) -> str:
    """What to tell of a RUN_DIR no run is in (yet), while top waits for one and when it gives up.
    One not there: the run dir beside it whose name is closest (found in QA: a typo waited a
    minute for a run that would never start there, without a word on it). One that holds another
    node's folder and nothing of node 0's: it may be that node's --run-dir (found in QA: top waited,
    then said "not running"), or node 0's on a shared disk before node 0 wrote to it (review)."""
    from maestro_flow.runtime.rundir import NODE  # (rundir imports this module)

    if not run_dir:
        return ""
    if os.path.isdir(run_dir):
        try:
            nodes = sorted(d for d in os.listdir(run_dir) if NODE.fullmatch(d))
        except OSError:
            return ""
        if not nodes or any(os.path.exists(os.path.join(run_dir, f)) for f in ("pipeline.json", "metrics.jsonl")):
            return ""
        return (f"; it holds {nodes[0]}/ and nothing of node 0's: if it is the --run-dir of node "
                f"{nodes[0][5:]}, watch the run on node 0 instead (`maestro top` of node 0's run dir)")
    parent, name = os.path.split(os.path.normpath(run_dir))
    try:
        near = difflib.get_close_matches(name, [d for d in os.listdir(parent or ".")
                                                if os.path.isdir(os.path.join(parent, d))], n=1, cutoff=0.75)
    except OSError:
        return f"; {parent} does not exist either"
    return f"; did you mean {os.path.join(parent, near[0])}?" if near else ""


def _find_run(run_dir: str | None, root: str) -> str:
    from maestro_flow.runtime.rundir import NODE  # (rundir imports this module)

    if run_dir:
        if not os.path.isdir(run_dir):  # found in review: said "has no status.json" of a folder not there
            raise NotYet(f"{run_dir}: no such run directory{_hint(run_dir)}")
        if not os.path.exists(os.path.join(run_dir, "status.json")):
            if NODE.fullmatch(os.path.basename(os.path.normpath(run_dir))):  # found in QA
                raise FileNotFoundError(f"{run_dir} is another node's folder of a run over several nodes (its workers' "
                                        f"logs): watch the run on node 0, `maestro top` of node 0's run dir")
            if _last_row(os.path.join(run_dir, "events.jsonl"), lambda row: "ended" in row) is not None:
                raise Over(f"the run is not running; {ended(run_dir)}")  # found in QA: how, not just "not"
            raise NotYet(f"{run_dir} has no status.json: the run is not running (or wrote no run dir){_hint(run_dir)}")
        if not _live(run_dir):
            raise Over(f"{run_dir}/status.json is stale: the coordinator that wrote it is gone")
        return run_dir
    live = [os.path.join(root, d) for d in os.listdir(root)] if os.path.isdir(root) else []
    live = [d for d in live if _live(d)]
    if not live:
        # NotYet: waited for as a named run dir is (found in QA: `maestro top` started just before
        # `maestro run` exited 2 at once, though README and --help say it waits)
        raise NotYet(f"no running pipeline under {root}/ (start one with maestro run, or name its run dir)")
    # The newest started (status.json's "started"), not the folder touched last (found in QA: a
    # checkpoint's events.jsonl line made `top` jump to an older run)
    return max(live, key=lambda d: (_started(d), os.path.getmtime(d)))


def _started(run_dir: str) -> float:
    started = _read(run_dir).get("started")
    return float(started) if isinstance(started, (int, float)) else 0.0


def _last_row(path: str, keep: Any = lambda row: True) -> dict | None:
    """The last JSON object of a JSON Lines file that `keep` accepts (None: none, or no file)."""
    last = None
    try:
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line) if line.strip() else None
                except ValueError:
                    continue  # a line cut short by a kill
                if isinstance(row, dict) and keep(row):
                    last = row
    except OSError:
        return None
    return last


END_CODES = {"done": 0, "failed": 1, "interrupted": 130}  # by how the run ended, where its code is not written


def end_code(run_dir: str) -> int:
    """The exit code `top` gives once the run it watched is over: maestro run's own (the `code`
    of events.jsonl's `ended` entry; found in review: a run refused after it started exits 2,
    not a failure's 1), else by how it ended, and 1 for a run whose process went without
    recording it (killed; found in QA: top exited 0 there, as after a finished run)."""
    end = _last_row(os.path.join(run_dir, "events.jsonl"), lambda row: "ended" in row) or {}
    code = end.get("code")
    return code if type(code) is int else END_CODES.get(end.get("ended"), 1)


def ended(run_dir: str) -> str | None:
    """What `top` says once the run it watched is over (None while its coordinator runs): how it
    ended (the run dir's events.jsonl: done, failed and why, interrupted; nothing there when its
    process was killed), and the last step its metrics.jsonl recorded, counted from 1."""
    if _live(run_dir):
        return None
    end = _last_row(os.path.join(run_dir, "events.jsonl"), lambda row: "ended" in row) or {}
    row = _last_row(os.path.join(run_dir, "metrics.jsonl"), lambda row: "step" in row)
    # Counted from 1, as the progress lines and top's header count (metrics rows from 0; found in
    # review: a 60-step run "ended; its last step was 59" under "step 60/60").
    step = None if row is None else row["step"] + 1 if isinstance(row["step"], int) else row["step"]
    loss = None if row is None else row.get("loss")
    before = " before any step was recorded"
    after = (f" after step {step}" + (f", loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
             if step is not None else before)
    if end.get("ended") == "interrupted":
        return f"{run_dir}: {end.get('why', 'the run was interrupted')}{after}"
    if end.get("ended") == "failed":  # found in QA: a failed run "has ended" as a finished one
        return f"{run_dir}: the run failed{after}: {end.get('why', '?')}"
    if end.get("ended") != "done":
        last = f"; its last step was {step}" if step is not None else f",{before}"
        return f"{run_dir}: the run's process is gone without recording how the run ended (killed?){last}"
    return f"{run_dir}: the run has ended{after}"


def query(run_dir: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """The run's snapshot. A refused connection while the coordinator lives is an automatic
    restart between two attempts (status.json still names the last one's endpoint): asked again
    until the next attempt's endpoint answers, for up to `timeout_s` in all."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(os.path.join(run_dir, "status.json")) as f:
                record = json.load(f)
            endpoint = record["endpoint"]
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            address = (host, int(port))
        except FileNotFoundError:
            raise FileNotFoundError(f"{run_dir} has no status.json: the run is not running") from None
        except (ValueError, KeyError, TypeError, AttributeError):
            raise FileNotFoundError(f"{run_dir}/status.json is not a maestro status file (no endpoint)") from None
        try:
            answer = _ask(address, deadline)
            if answer:  # nothing: the attempt closed its endpoint while answering
                snapshot = json.loads(answer)
                if not isinstance(snapshot, dict):
                    raise ValueError(f"a JSON {type(snapshot).__name__}")
                return snapshot
        except ConnectionError:  # refused, or cut off
            if not _alive(record):
                raise FileNotFoundError(f"{run_dir}/status.json is stale: the coordinator that wrote it is gone") from None
        except TimeoutError:
            pass
        except ValueError as exc:  # not JSON, too long, not an object: whatever listens there is no maestro run
            raise FileNotFoundError(f"{endpoint} (from {run_dir}/status.json) answered something that is not a "
                                    f"maestro status snapshot ({first_line(exc)[:200]})") from None
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the run at {endpoint} did not answer within {timeout_s:.1f}s")
        time.sleep(0.05)


def _ask(address: tuple[str, int], deadline: float) -> bytes:
    with socket.create_connection(address, timeout=max(deadline - time.monotonic(), 0.01)) as sock:
        sock.sendall(REQUEST + b"\n")
        answer = b""
        while len(answer) <= ANSWER_MAX_BYTES:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            chunk = sock.recv(1 << 16)
            if not chunk:
                return answer
            answer += chunk
        raise ValueError(f"{address[0]}:{address[1]} answered more than {ANSWER_MAX_BYTES} bytes: not a maestro "
                         "status endpoint")


def _clean(value: Any, width: int = 40) -> str:
    """Printable text only: control characters (terminal escapes) shown escaped, long text cut."""
    return cut("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value)), width)


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
    if s.get("restarts"):  # found in QA: after an automatic restart, top looked like a fresh run
        head += f"  (after {_clean(count(s['restarts'], 'automatic restart'), 40)})"
    lines = [f"{head}  loss {_clean(loss_s, 80)}  step time {step_time:.3f}s"
             if isinstance(step_time, (int, float)) else head,
             *([_clean(s["phase"], 160)] if s.get("phase") else []),
             "",
             f"{'worker':<16} {'doing now':<22} {'step':>5} {'mb':>4} {'busy':>6} {'inputs held':>11} "
             f"{'in flight':>9} {'as of':>6}"]
    for w in s["workers"]:
        busy = w.get("busy_fraction")
        busy_s = f"{busy:.0%}" if isinstance(busy, (int, float)) else "-"
        # The row is the worker's last heartbeat (every 0.5 s): "as of" is its age, so a fast run's
        # rows may be a few steps behind the header, which counts the steps the coordinator awaits.
        age = w.get("status_s")
        age_s = f"{age:>5.1f}s" if isinstance(age, (int, float)) else f"{'-':>6}"
        state = w.get("state", "starting" if s.get("phase") else "?")
        lines.append(f"{_clean(w['name'], 16):<16} {_clean(state, 22):<22} {_dash(_from_1(w.get('step'))):>5} "
                     f"{_dash(w.get('mb')):>4} {busy_s:>6} {_dash(w.get('buffered')):>11} "
                     f"{_dash(w.get('in_flight')):>9} {age_s}")
    return "\n".join(lines)


def _from_1(step: Any) -> Any:
    """A worker's step index counted from 1, as the header and the run's messages count."""
    return step + 1 if isinstance(step, int) else step


def _dash(v: Any) -> str:
    return "-" if v is None else _clean(v, 11)
