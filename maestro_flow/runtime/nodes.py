"""Several nodes, torchrun's way: which node this is, where they meet, and whose ranks are where.

Runs in `maestro run` on every node before anything starts. `Nodes.from_options` takes
torchrun's flags (--nnodes, --node-rank, --rdzv-endpoint, --nproc-per-node), with the node rank
from Slurm's environment (SLURM_NODEID, else SLURM_PROCID with one task per node) when it is not
given. `assign` puts every rank on a node: ranks in order, a replica's tensor-parallel group
always on one node, at most nproc_per_node ranks per node. The rendezvous is a torch.distributed
TCPStore at the endpoint, hosted by node 0 (`rendezvous`); the keys the coordinator and the
agents exchange through it are in runtime/attempts.py and runtime/agent.py.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from maestro_flow.errors import PipelineError, brief
from maestro_flow.planner.plan import Placement
from maestro_flow.runtime.sealing import POLL_S


@dataclass(frozen=True, kw_only=True, slots=True)
class Nodes:
    nnodes: int = 1
    node_rank: int = 0
    endpoint: tuple[str, int] | None = None  # the rendezvous store, hosted by node 0
    nproc_per_node: int | None = None

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @classmethod
    def from_options(cls, nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None,
                     nproc_per_node: int | None, environ: dict[str, str] | None = None) -> Nodes:
        """`nnodes` None: not given (one node); given as 1, an endpoint is accepted and unused, as
        torchrun accepts it (a launch script's `--nnodes $SLURM_NNODES` on one node)."""
        environ = os.environ if environ is None else environ
        given, nnodes = nnodes is not None, 1 if nnodes is None else nnodes
        if nnodes < 1:
            raise PipelineError(f"--nnodes must be at least 1, got {nnodes}")
        if nproc_per_node is not None and nproc_per_node < 1:
            raise PipelineError(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
        if nnodes == 1:  # each would train the whole job alone (found in QA: --nnodes forgotten under srun)
            if node_rank not in (None, 0):
                raise PipelineError(f"--node-rank {node_rank} is for a run over several nodes: add --nnodes N")
            if rdzv_endpoint and not given:
                raise PipelineError(f"--rdzv-endpoint {rdzv_endpoint} is for a run over several nodes: add "
                                    "--nnodes N (N > 1), or leave --rdzv-endpoint out to train on this node alone")
            return cls(nproc_per_node=nproc_per_node)  # a cap on this node's ranks (Nodes.assign)
        if node_rank is None:
            raw = environ.get("SLURM_NODEID") or environ.get("SLURM_PROCID")
            if raw is None:
                raise PipelineError("--node-rank is needed with --nnodes > 1 (or run under Slurm, which sets "
                                    "SLURM_NODEID)")
            node_rank = int(raw)
        if not 0 <= node_rank < nnodes:
            raise PipelineError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
        if not rdzv_endpoint:
            raise PipelineError("--rdzv-endpoint HOST:PORT is needed with --nnodes > 1 (node 0 listens there)")
        host, sep, port = rdzv_endpoint.rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdigit()):
            raise PipelineError(f"--rdzv-endpoint must be HOST:PORT, got {rdzv_endpoint!r}")
        if not 1 <= int(port) <= 65535:  # found in QA: 99999 gave a traceback, 0 a minutes-long wait
            raise PipelineError(f"--rdzv-endpoint {rdzv_endpoint}: the port must be 1-65535 (node 0 listens on it)")
        return cls(nnodes=nnodes, node_rank=node_rank, endpoint=(host.strip("[]"), int(port)),
                   nproc_per_node=nproc_per_node)

    def assign(self, placement: Placement) -> dict[int, int]:
        """rank -> node: ranks in order, a tensor-parallel group never split across nodes."""
        world = placement.world_size
        if not self.multi:
            if self.nproc_per_node is not None and world > self.nproc_per_node:  # found in QA: ignored on one node
                raise PipelineError(f"the pipeline has {world} ranks, more than --nproc-per-node {self.nproc_per_node} "
                                    "on this one node: raise --nproc-per-node, or spread them with --nnodes")
            return {r: 0 for r in range(world)}
        per_node = self.nproc_per_node or math.ceil(world / self.nnodes)
        node_of: dict[int, int] = {}
        node, used = 0, 0
        for leader in sorted(placement.members or {r: (r,) for r in range(world)}):
            group = placement.group(leader)
            if len(group) > per_node:
                section, _ = placement.who(leader)
                raise PipelineError(f"sections.{section}.tp={len(group)} does not fit on one node of "
                                    f"{per_node} ranks (raise --nproc-per-node)")
            # Spread evenly: a group that would take the ranks so far past node n's share, (n + 1) /
            # nnodes of them, starts the next node (found in review: 5 ranks packed 2, 2, 1 left the
            # fourth node none).
            share = math.ceil((node + 1) * world / self.nnodes)
            past_share = used and len(node_of) + len(group) > share and node < self.nnodes - 1
            if used + len(group) > per_node or past_share:
                node, used = node + 1, 0
            for r in group:
                node_of[r] = node
            used += len(group)
        if node >= self.nnodes:
            raise PipelineError(f"the pipeline has {world} ranks, more than {self.nnodes} nodes of {per_node} hold "
                                f"(raise --nproc-per-node or --nnodes)")
        if node < self.nnodes - 1:  # found in QA: such a node started an empty list of ranks, and waited
            raise PipelineError(f"the pipeline's {world} ranks fill {node + 1} nodes (a tensor-parallel group stays "
                                f"on one), leaving node {node + 1} of --nnodes {self.nnodes} nothing to run: lower "
                                f"--nnodes to {node + 1}")
        return node_of


def node_ranks(node_of: dict[int, int], node: int) -> list[int]:
    return sorted(r for r, n in node_of.items() if n == node)


# A node that waits for others to join (node 0) or for node 0 to listen (the others) says so this
# far into the wait, and every WAIT_NOTE_EVERY_S after.
WAIT_NOTE_S = 10.0
WAIT_NOTE_EVERY_S = 60.0
ABANDONED = threading.Event()  # set once a store call was given up while still running (see `bounded`)


class NoAnswer(Exception):
    """A call `bounded` gave up on."""


def bounded(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """fn(*args) on a thread of its own, given up after timeout_s (NoAnswer). Found in review: a
    TCPStore client call to a node 0 that stops answering without closing its connections
    (frozen, or cut off by the network), or a connect to something else listening on the
    endpoint, blocked for good, whatever the store's timeout. The given-up thread stays blocked in
    torch's C++ code: a process that had to give one up ends with os._exit (`exit_code`), since
    a normal interpreter exit with it there can abort."""
    out: list[tuple[bool, Any]] = []

    def call() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller as it is)
            out.append((False, exc))

    thread = threading.Thread(target=call, daemon=True, name="maestro-store-call")
    thread.start()
    thread.join(timeout_s)
    if not out:
        ABANDONED.set()
        raise NoAnswer(f"no answer within {timeout_s:.0f}s")
    ok, value = out[0]
    if ok:
        return value
    raise value


def exit_code(code: int) -> None:
    """End the process with `code` at once where a store call was given up (see `bounded`)."""
    if ABANDONED.is_set():
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def rendezvous(nodes: Nodes, timeout_s: float, waiting: Callable[[float], None] | None = None) -> Any:
    """The job's TCPStore at the rendezvous endpoint: node 0 hosts it (listening on that address
    only), the others connect to it. `waiting(seconds)`: called while another node waits for node
    0 to listen, WAIT_NOTE_S into the wait and every WAIT_NOTE_EVERY_S after (found in QA: node 1
    said nothing for MAESTRO_STARTUP_S when node 0 was not started)."""
    import torch.distributed as dist

    assert nodes.endpoint is not None
    host, port = nodes.endpoint
    timeout = timedelta(seconds=timeout_s)
    if nodes.node_rank != 0:
        try:  # bounded: c10d retries its connect past the timeout, and a silent listener holds it for good
            deadline = time.monotonic() + timeout_s  # one bound for both (found in review: twice the timeout)
            _listening(host, port, deadline, waiting)
            left = max(0.1, deadline - time.monotonic())
            return bounded(lambda: dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=left)),
                           timeout_s=left)
        except Exception as exc:  # noqa: BLE001 (torch raises several types for an unreachable store)
            raise PipelineError(f"--rdzv-endpoint {host}:{port}: node 0 did not answer within {timeout_s:.0f}s "
                                f"({brief(exc)}; is node 0 started? MAESTRO_STARTUP_S sets the wait)") from None
    try:
        return listening_store(host, port, timeout)
    except OSError as exc:
        # found in QA: a port another run held said only "Address already in use"
        held = "; another run (or program) holds the port: give this run another one" \
            if exc.errno == errno.EADDRINUSE else ""
        raise PipelineError(f"--rdzv-endpoint {host}:{port}: node 0 cannot listen there ({exc.strerror}{held})") from None


def _listening(host: str, port: int, deadline: float, waiting: Callable[[float], None] | None = None) -> None:
    """Wait until something listens at host:port, by connecting (and closing) every POLL_S until
    time.monotonic() reaches `deadline`: c10d's own connect logs an ERROR line of its own when it
    times out (found in QA: printed before maestro's message when node 0 was not started).
    `waiting`: as rendezvous's."""
    began = time.monotonic()
    note_at = began + WAIT_NOTE_S
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))).close()
            return
        except OSError:
            now = time.monotonic()
            if now + POLL_S >= deadline:
                raise
            if waiting is not None and now >= note_at:
                note_at = now + WAIT_NOTE_EVERY_S
                waiting(now - began)
            time.sleep(POLL_S)


def listening_store(host: str, port: int = 0, timeout: timedelta = timedelta(seconds=300)) -> Any:
    """A TCPStore master listening on `host` only (by itself it listens on every interface): it
    gets a socket bound there, which it owns and closes. Port 0: any free port."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(1024)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())
