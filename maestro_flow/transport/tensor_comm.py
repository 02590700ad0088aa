"""A worker's tensor channels: headers over ZeroMQ, bytes over torch.distributed.

Runs inside a worker process. `TensorComm.send` is called by the compute thread and returns at
once; a sending thread per (destination, kind) channel posts the header then the tensors.
A receiving thread reads every incoming header from the worker's PULL socket and hands it to
the receiving thread of its channel, which posts the matching receives (headers of a channel
arrive in the order the sender posted its tensors, so the receives match) and delivers the
unpacked tensors through the `deliver` callback. Errors in any thread go to `on_error`; the
comm never raises into the compute thread.

`LocalComm` is the in-process implementation of the same interface (colocated mode, tests).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import zmq

from maestro_flow.protocol.messages import make
from maestro_flow.transport import p2p, zmq_link

Channel = tuple[int, str]  # (peer rank, "fwd" | "bwd")
Deliver = Callable[[str, int, int, int, list[p2p.Item]], None]  # kind, edge, step, src rank, items


class Comm(Protocol):
    def send(self, dst: int, kind: str, edge: int, step: int, items: Sequence[p2p.Item]) -> None: ...

    def close(self) -> None: ...


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.send_s = 0.0
        self.recv_s = 0.0
        self.in_flight = 0

    def snapshot_and_reset(self) -> dict[str, float]:
        with self.lock:
            out = {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                   "send_s": self.send_s, "recv_s": self.recv_s}
            self.bytes_sent = self.bytes_received = 0
            self.send_s = self.recv_s = 0.0
        return out


class TensorComm:
    def __init__(self, *, zctx: zmq.Context, rank: int, pull: zmq.Socket, peers: dict[int, str],
                 groups: dict[tuple[int, int, str], Any], device: torch.device,
                 deliver: Deliver, on_error: Callable[[str], None]) -> None:
        self.rank = rank
        self._zctx, self._pull, self._peers, self._groups = zctx, pull, peers, groups
        self._device, self._deliver, self._on_error = device, deliver, on_error
        self._stop = threading.Event()
        self._send_queues: dict[Channel, queue.Queue] = {}
        self._recv_queues: dict[Channel, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        self.stats = _Stats()
        for (src, dst, kind) in groups:
            if src == rank:
                q: queue.Queue = queue.Queue()
                self._send_queues[(dst, kind)] = q
                self._spawn(f"send-{kind}-{dst}", self._send_loop, dst, kind, q)
            elif dst == rank:
                q = queue.Queue()
                self._recv_queues[(src, kind)] = q
                self._spawn(f"recv-{kind}-{src}", self._recv_loop, src, kind, q)
        self._spawn("headers-in", self._header_loop)

    def _spawn(self, name: str, fn: Callable, *args: Any) -> None:
        t = threading.Thread(target=self._guard, args=(fn, *args), name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _guard(self, fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            if not self._stop.is_set():
                self._on_error(f"tensor channel thread {threading.current_thread().name} failed:\n"
                               + traceback.format_exc())

    # -- compute thread side ---------------------------------------------------------------

    def send(self, dst: int, kind: str, edge: int, step: int, items: Sequence[p2p.Item]) -> None:
        q = self._send_queues.get((dst, kind))
        if q is None:
            raise RuntimeError(f"rank {self.rank} has no {kind} channel to rank {dst}")
        with self.stats.lock:
            self.stats.in_flight += 1
        q.put((edge, step, list(items)))

    @property
    def in_flight(self) -> int:
        return self.stats.in_flight

    def close(self) -> None:
        self._stop.set()
        for q in list(self._send_queues.values()) + list(self._recv_queues.values()):
            q.put(None)

    # -- channel threads -------------------------------------------------------------------

    def _send_loop(self, dst: int, kind: str, q: queue.Queue) -> None:
        sock = zmq_link.connect(self._zctx, zmq.PUSH, self._peers[dst])
        group = self._groups[(self.rank, dst, kind)]
        try:
            while True:
                job = q.get()
                if job is None or self._stop.is_set():
                    return
                edge, step, items = job
                t0 = time.perf_counter()
                entries, specs, buffers = p2p.pack(items)
                zmq_link.send_msg(sock, make("tensors", src=self.rank, kind=kind, edge=edge, step=step,
                                             entries=entries, buffers=specs))
                p2p.send_buffers(buffers, dst, group)
                with self.stats.lock:
                    self.stats.in_flight -= 1
                    self.stats.send_s += time.perf_counter() - t0
                    self.stats.bytes_sent += sum(b.numel() * b.element_size() for b in buffers)
        finally:
            sock.close(linger=0)

    def _header_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                msg = zmq_link.recv_msg(self._pull)
                q = self._recv_queues.get((msg["src"], msg["kind"]))
                if q is None:
                    raise RuntimeError(f"rank {self.rank} got a {msg['kind']} header from unexpected rank {msg['src']}")
                q.put(msg)
        finally:
            self._pull.close(linger=0)

    def _recv_loop(self, src: int, kind: str, q: queue.Queue) -> None:
        group = self._groups[(src, self.rank, kind)]
        while True:
            msg = q.get()
            if msg is None or self._stop.is_set():
                return
            t0 = time.perf_counter()
            buffers = p2p.allocate(msg["buffers"], self._device)
            p2p.recv_buffers(buffers, src, group)
            with self.stats.lock:
                self.stats.recv_s += time.perf_counter() - t0
                self.stats.bytes_received += sum(b.numel() * b.element_size() for b in buffers)
            self._deliver(kind, msg["edge"], msg["step"], src, p2p.unpack(msg["entries"], buffers))


class LocalComm:
    """In-process comm: delivers copies straight to the destination's callback (same interface)."""

    def __init__(self, rank: int, deliver_to: Callable[[int], Deliver]) -> None:
        self.rank = rank
        self._deliver_to = deliver_to
        self.stats = _Stats()
        self.in_flight = 0

    def send(self, dst: int, kind: str, edge: int, step: int, items: Sequence[p2p.Item]) -> None:
        copies = [(sid, name, None if t is None else t.detach().clone()) for sid, name, t in items]
        self._deliver_to(dst)(kind, edge, step, self.rank, copies)

    def close(self) -> None:
        pass
