"""A worker's tensor channels: headers over ZeroMQ, bytes over torch.distributed.

Runs inside a worker process. `TensorComm.send` is called by one thread (the compute thread)
and returns once the message is queued: it packs the message, sends its header on the channel's
ZeroMQ socket and posts the sends (blocking only while the channel's WINDOW earlier sends are
unfinished); a waiter thread per channel completes them in order. On the receiving side the
header thread reads every incoming header, allocates the buffers (reused for large messages) and
posts the matching receives at once (headers of a channel arrive in the order the sender posted
its sends, so the receives match); the channel's waiter thread completes them in order and
delivers the unpacked tensors through the `deliver` callback. Up to WINDOW messages per channel
are in flight, so the next message's receive is posted while the previous one's bytes flow.
Errors in the comm's threads go to `on_error`; the comm raises into the compute thread only for
a send on a channel that does not exist, a window still full after MAESTRO_COLLECTIVE_S
(TimeoutError: a peer is stuck or gone) and a device out of memory. Headers are sealed under the run's key
(protocol/auth.py), one stream per destination; the header thread drops and logs any frame that
is not an authentic header from the rank it names, so garbage or forged headers cost nothing.

Between CPU workers on one host a channel goes through shared memory: the sender copies a
message's buffers into a reused shared-memory slot and names it in the header; the header
thread delivers views of the slot at once, and sends the slot back ("release") once the
executor holds no view of it (transport/shm.py): the compute thread looks for such slots whenever
it runs out of work (`reap`, so slots go back as soon as the executor is done with them and no
thread wakes up just to look), and the header thread every REAP_S while views are out (for a
compute thread that never runs out of work). Releases travel on a stream of their own. A
sender that cannot make a slot (a full /dev/shm) says so once and sends that channel's later
messages over its process group, which every channel has.

Between two workers on one host and one GPU (NCCL refuses two ranks on one device) a channel
goes through CUDA IPC the same way, with device slots (transport/cuda_ipc.py): the header names
the slot and, the first time, its IPC handles; the receiver's stream waits for the sender's copy
and it is handed views. A sender whose CUDA IPC fails says so once and falls back to the
channel's process group (gloo, staged through host memory).

A tensor-parallel replica's leader relays what its replica computes on — each micro-batch's
inputs ("tpf") and gradients ("tpb") — to the other ranks of the replica with `relay`: a header
to each, then one broadcast per buffer over the replica's relay group. Members post the matching
broadcasts as headers arrive, so they receive relays in the leader's order.

transport/local_comm.py's `LocalComm` is the in-process implementation of the same interface
(colocated mode, tests).
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

from maestro_flow.protocol.auth import DropLog, Opener, Rejected, Sealer
from maestro_flow.protocol.messages import make
from maestro_flow.transport import cuda_ipc, p2p, zmq_link
from maestro_flow.transport import shm as shm_module

Channel = tuple[int, str]  # (peer rank, "fwd" | "bwd")
Deliver = Callable[[str, int, int, int, list[p2p.Item]], None]  # kind, edge, step, src rank, items


class Comm(Protocol):
    def send(self, dst: int, kind: str, edge: int, step: int, items: Sequence[p2p.Item]) -> None: ...

    def notify(self, dst: int, step: int, finished: int) -> None: ...

    def reap(self) -> None: ...

    def close(self, timeout_s: float = 0.0) -> bool: ...


class Stats:
    """A comm's transfer counters, read and reset once per step (snapshot_and_reset)."""

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
    # Posted messages queued for their completion, per channel: send() (the header thread, for
    # receives) posts a message and then waits for room, so at most WINDOW + 2 are in flight.
    WINDOW = 16
    REAP_S = 0.05  # how often the header thread looks for shared-memory slots to give back (see reap)

    def __init__(self, *, zctx: zmq.Context, rank: int, pull: zmq.Socket, key: bytes, peers: dict[int, str],
                 groups: dict[tuple[int, int, str], Any], device: torch.device,
                 deliver: Deliver, on_error: Callable[[str], None], tracer: Any = None,
                 relay: tuple[tuple[int, ...], Any] | None = None, timeout_s: float = 300.0,
                 shm: Sequence[tuple[int, int, str]] = (), shm_prefix: str | None = None,
                 ipc: Sequence[tuple[int, int, str]] = ()) -> None:
        """`relay`: (the replica's ranks, leader first; its relay group) for tensor-parallel ranks.
        `timeout_s`: how long a send may wait for room in its channel's window, and the header
        thread for room in a receiving channel or (MAESTRO_CUDA_IPC_WAIT=host) for a CUDA IPC copy
        (Timeouts.collective_s, MAESTRO_COLLECTIVE_S).
        `shm`: the channels (src, dst, kind) through shared memory; `shm_prefix` names this
        worker's slots (maestro-<session>-<rank>; a peer's slots are taken only with its own rank
        there). `ipc`: the channels through CUDA IPC (both
        ranks on this host and this device: transport/cuda_ipc.py)."""
        self._timeout_s = timeout_s
        self.rank = rank
        self._tracer = tracer  # runtime.trace.Tracer or None: transfers as async trace events
        self._zctx, self._pull, self._peers, self._groups = zctx, pull, peers, groups
        self._device, self._deliver, self._on_error = device, deliver, on_error
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._key = key
        self._sockets: dict[int, tuple[zmq.Socket, Sealer]] = {}  # header sockets, owned by the sending thread
        self._opener = Opener(key, f"data{rank}", zmq_link.HEADER_MAX_BYTES)
        self.drops = DropLog(f"rank {rank}'s tensor headers")
        self._sent: dict[Channel, queue.Queue] = {}
        self._received: dict[Channel, queue.Queue] = {}
        self._pools: dict[Channel, p2p.BufferPool] = {}
        self.stats = Stats()
        shm_prefix = shm_prefix or f"maestro-{rank}"
        self._shm_out = {(dst, kind) for src, dst, kind in shm if src == rank}
        self._shm_in = {(src, kind) for src, dst, kind in shm if dst == rank}
        self._slots = shm_module.SlotWriter(shm_prefix) if self._shm_out else None
        self._mapped = shm_module.SlotReader(shm_prefix.removesuffix(f"-{rank}")) if self._shm_in else None
        self._ipc_out = {(dst, kind) for src, dst, kind in ipc if src == rank}
        self._ipc_in = {(src, kind) for src, dst, kind in ipc if dst == rank}
        self._ipc_slots = cuda_ipc.IpcWriter(rank, device) if self._ipc_out else None
        self._ipc_mapped = cuda_ipc.IpcReader(device, cuda_ipc.wait_mode(), timeout_s) if self._ipc_in else None
        self._releases: queue.SimpleQueue = queue.SimpleQueue()  # (rank, slot names) from the header thread
        self._release_sockets: dict[int, tuple[zmq.Socket, Sealer]] = {}  # used under _release_lock
        self._release_lock = threading.Lock()  # the header thread and the compute thread give slots back
        self._relay_members, self._relay_group = relay or ((rank,), None)
        if len(self._relay_members) > 1:
            channel = (self._relay_members[0], "relay")
            if rank == self._relay_members[0]:
                self._sent[channel] = queue.Queue(maxsize=self.WINDOW)
                self._spawn("relay-send-wait", self._send_waiter, self._sent[channel])
            else:
                self._received[channel] = queue.Queue(maxsize=self.WINDOW)
                self._pools[channel] = p2p.BufferPool()
                self._spawn("relay-recv-wait", self._recv_waiter, channel[0], "relay", self._received[channel])
        for (src, dst, kind) in groups:
            if src == rank:
                self._sent[(dst, kind)] = queue.Queue(maxsize=self.WINDOW)
                self._spawn(f"send-wait-{kind}-{dst}", self._send_waiter, self._sent[(dst, kind)])
            elif dst == rank:
                self._received[(src, kind)] = queue.Queue(maxsize=self.WINDOW)
                self._pools[(src, kind)] = p2p.BufferPool()
                self._spawn(f"recv-wait-{kind}-{src}", self._recv_waiter, src, kind, self._received[(src, kind)])
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

    # -- the sending thread ----------------------------------------------------------------

    def send(self, dst: int, kind: str, edge: int, step: int, items: Sequence[p2p.Item]) -> None:
        self._take_releases()  # before taking a slot; on every path, a dropped channel's too
        if (dst, kind) in self._ipc_out:
            if self._send_slot(dst, kind, edge, step, items, ipc=True):
                return
        elif (dst, kind) in self._shm_out:
            if self._send_slot(dst, kind, edge, step, items):
                return
        sent = self._sent.get((dst, kind))
        if sent is None:
            raise RuntimeError(f"rank {self.rank} has no {kind} channel to rank {dst}")
        t0 = time.perf_counter()
        entries, specs, buffers = p2p.pack(items)
        group = self._groups[(self.rank, dst, kind)]
        if p2p.through_host(group, self._device):
            buffers = p2p.to_host(buffers)
        self._posting(buffers)
        # Header first: the receiver needs shapes and dtypes to post its receives.
        self._header(dst, make("tensors", src=self.rank, kind=kind, edge=edge, step=step, entries=entries,
                               buffers=specs))
        self._put(sent, (p2p.post_sends(buffers, dst, group), buffers, t0, dst, kind, step),
                  f"room to send {kind} tensors to rank {dst} (its {self.WINDOW} earlier sends unfinished)")

    def _take_releases(self) -> None:
        """Slots the receivers gave back, to their writers (which keep or remove them). On the
        compute thread only (the writers' one user): at every send, and when it runs out of work
        (reap), so that a channel that no longer sends through slots still gives them back."""
        while not self._releases.empty():
            by, names = self._releases.get_nowait()
            for writer, mine in ((self._slots, False), (self._ipc_slots, True)):
                if writer is not None:
                    writer.released(by, [n for n in names if n.startswith(cuda_ipc.PREFIX) == mine])

    def _send_slot(self, dst: int, kind: str, edge: int, step: int, items: Sequence[p2p.Item],
                   ipc: bool = False) -> bool:
        """The bytes into a reused slot (shared memory, or with `ipc` device memory), the slot's
        name in the header: done when this returns (nothing waits on a transfer). False where
        no slot can be had (a full /dev/shm; CUDA IPC refused): the channel's process group
        carries this message and the channel's later ones (the receiver handles both)."""
        t0 = time.perf_counter()
        entries, specs, buffers = p2p.pack_each(items)
        writer = self._ipc_slots if ipc else self._slots
        refused: type[Exception] = cuda_ipc.IpcRefused if ipc else OSError  # no IPC export; no shared memory
        try:
            slot, offsets = writer.write((dst, kind), buffers)
            export = writer.export(slot) if ipc else None
        except torch.OutOfMemoryError:
            raise
        except refused as exc:
            (self._ipc_out if ipc else self._shm_out).discard((dst, kind))
            writer.drop((dst, kind))
            what = f"CUDA IPC failed ({exc})" if ipc else (getattr(exc, "strerror", None) or str(exc))
            print(f"maestro: rank {self.rank}: {what}; {kind} tensors to rank {dst} go through "
                  f"{'gloo and host memory' if ipc else 'gloo'} from now on", flush=True)
            return False
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        # Built here from this worker's own values (what `make` would check is true by
        # construction): this is the per-message path. The receiver checks it at the door.
        msg = {"t": "tensors", "src": self.rank, "kind": kind, "edge": edge, "step": step,
               "entries": entries, "buffers": specs}
        if ipc:
            msg["ipc"] = [slot, offsets, export]
        else:
            msg["shm"] = [slot, offsets]
        self._header(dst, msg)
        with self.stats.lock:
            self.stats.bytes_sent += nbytes
            self.stats.send_s += time.perf_counter() - t0
        if self._tracer is not None:
            self._tracer.transfer(f"send {kind}", t0, time.perf_counter(), peer=dst, step=step, bytes=nbytes)
        return True

    def _put(self, q: queue.Queue, job: Any, what: str) -> None:
        try:
            q.put(job, timeout=self._timeout_s)
        except queue.Full:
            raise TimeoutError(f"rank {self.rank} waited {self._timeout_s:.0f}s for {what}; a peer is stuck or gone "
                               f"(raise MAESTRO_COLLECTIVE_S if transfers can be that slow)") from None

    def _posting(self, buffers: Sequence[torch.Tensor]) -> None:
        # Bytes count when posted, not when completed: a step's report then holds exactly the
        # bytes that step sent, however late the last transfer completes.
        with self.stats.lock:
            self.stats.in_flight += 1
            self.stats.bytes_sent += sum(b.numel() * b.element_size() for b in buffers)

    def relay(self, kind: str, step: int, index: int, items: Sequence[p2p.Item]) -> None:
        """Leader of a tensor-parallel replica: send micro-batch `index`'s inputs (kind "tpf") or
        its gradients ("tpb") to every other rank of the replica. Same thread as send()."""
        leader, members = self._relay_members[0], self._relay_members[1:]
        t0 = time.perf_counter()
        entries, specs, buffers = p2p.pack(items)
        self._posting(buffers)
        header = make("tensors", src=self.rank, kind=kind, edge=index, step=step, entries=entries, buffers=specs)
        for member in members:
            self._header(member, header)
        self._put(self._sent[(leader, "relay")], (p2p.post_broadcasts(buffers, leader, self._relay_group), buffers,
                                                  t0, -1, kind, step),
                  f"room to relay {kind} tensors to the tensor-parallel group")

    def notify(self, dst: int, step: int, finished: int) -> None:
        """Tell a producer that this replica finished `finished` forward micro-batches of `step`
        (its run-ahead credits). Same thread as send()."""
        self._header(dst, make("progress", src=self.rank, step=step, finished=finished))

    def _header(self, dst: int, msg: dict) -> None:
        """A sealed header (or progress note) to `dst`, on this thread's stream to it."""
        link = self._sockets.get(dst)
        if link is None:
            sock = zmq_link.connect(self._zctx, zmq.PUSH, self._peers[dst], max_bytes=zmq_link.HEADER_MAX_BYTES,
                                    key=self._key)
            link = self._sockets[dst] = (sock, Sealer(self._key, f"rank{self.rank}", f"data{dst}"))
        zmq_link.send_msg(link[0], msg, sealer=link[1])

    @property
    def in_flight(self) -> int:
        return self.stats.in_flight

    def close(self, timeout_s: float = 0.0) -> bool:
        """Stop every thread; wait up to `timeout_s` for them (True if all ended).

        Never blocks longer: a thread stuck in a transfer whose peer died cannot be interrupted
        (worker processes then exit with os._exit). Call from the sending thread."""
        self._stop.set()
        for q in list(self._sent.values()) + list(self._received.values()):
            try:
                q.put_nowait(None)
            except queue.Full:
                pass  # its waiter is stuck in a transfer; it is a daemon thread
        deadline = time.monotonic() + timeout_s
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        for sock, _ in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        for writer in (self._slots, self._ipc_slots):
            if writer is not None:
                writer.close()  # receivers' mappings stay valid; the files go
        return not any(t.is_alive() for t in self._threads)

    # -- comm threads ----------------------------------------------------------------------

    def _next(self, q: queue.Queue) -> Any:
        """A waiter's next job; None once the comm closes. An idle waiter looks at the stop flag
        every half second, so no wait here is unbounded."""
        while True:
            try:
                return q.get(timeout=0.5)
            except queue.Empty:
                if self._stop.is_set():
                    return None

    def _complete(self, works: Any, what: str) -> None:
        """Wait for posted transfers; bounded by the process group's timeout (collective_s), whose
        expiry is reported as what was awaited and which setting changes it."""
        try:
            p2p.wait_all(works)
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                raise
            raise TimeoutError(f"rank {self.rank} waited {self._timeout_s:.0f}s for {what}; the peer is stuck or "
                               f"gone (raise MAESTRO_COLLECTIVE_S if transfers can be that slow)") from exc

    def _send_waiter(self, sent: queue.Queue) -> None:
        while True:
            job = self._next(sent)
            if job is None:
                return
            works, buffers, t0, dst, kind, step = job
            self._complete(works, f"the bytes of {kind} tensors of step {step + 1} to reach "
                                  + (f"rank {dst}" if dst >= 0 else "its tensor-parallel group"))
            if self._tracer is not None:
                self._tracer.transfer(f"send {kind}", t0, time.perf_counter(), peer=dst, step=step,
                                      bytes=sum(b.numel() * b.element_size() for b in buffers))
            with self.stats.lock:
                self.stats.in_flight -= 1
                self.stats.send_s += time.perf_counter() - t0

    def _header_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        next_reap = 0.0
        try:
            while not self._stop.is_set():
                # While views of shared-memory slots are out, look for slots to give back every
                # REAP_S (a burst's releases then go back in a few messages, not one per slot).
                outstanding = any(r is not None and r.outstanding for r in (self._mapped, self._ipc_mapped))
                if outstanding and time.monotonic() >= next_reap:
                    self._give_back()
                    next_reap = time.monotonic() + self.REAP_S
                if not poller.poll(int(self.REAP_S * 1000) if outstanding else 100):
                    continue
                while True:  # every frame already here, before polling again
                    try:
                        frame = self._pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frame)
        finally:
            self._pull.close(linger=0)
            with self._release_lock:
                for sock, _ in self._release_sockets.values():
                    sock.close(linger=0)
                self._release_sockets.clear()
                for reader in (self._mapped, self._ipc_mapped):
                    if reader is not None:
                        reader.close()

    def _handle(self, frame: bytes) -> None:
        """One frame from the header socket: a header (post its receives, or deliver a
        shared-memory message), a progress note or a release."""
        msg = self._open(frame)
        if msg is None:
            return
        if msg["t"] == "progress":
            self._deliver("progress", -1, msg["step"], msg["src"], msg["finished"])
            return
        if msg["t"] == "release":
            self._releases.put((msg["src"], [str(n) for n in msg["slots"]]))
            return
        if msg.get("shm") is not None or msg.get("ipc") is not None:
            self._receive_slot(msg)
            return
        relayed = msg["kind"] in ("tpf", "tpb")
        channel = (msg["src"], "relay" if relayed else msg["kind"])
        received = self._received.get(channel)
        if received is None:
            raise RuntimeError(f"rank {self.rank} got a {msg['kind']} header from unexpected rank {msg['src']}")
        t0 = time.perf_counter()
        group = self._relay_group if relayed else self._groups[(msg["src"], self.rank, msg["kind"])]
        host = not relayed and p2p.through_host(group, self._device)  # gloo broadcasts CUDA itself
        buffers = p2p.allocate(msg["buffers"], torch.device("cpu") if host else self._device,
                               self._pools[channel])
        if relayed:
            works = p2p.post_broadcasts(buffers, msg["src"], group)
        else:
            works = p2p.post_recvs(buffers, msg["src"], group)
        self._put(received, (works, buffers, msg, t0),
                  f"room to receive {msg['kind']} tensors from rank {msg['src']} (its {self.WINDOW} earlier "
                  f"transfers unfinished)")

    def _receive_slot(self, msg: dict) -> None:
        """A message whose bytes are in a shared-memory (or CUDA IPC) slot: delivered now, as
        views of it."""
        ipc = msg.get("ipc") is not None
        if (msg["src"], msg["kind"]) not in (self._ipc_in if ipc else self._shm_in):
            raise RuntimeError(f"rank {self.rank} got a {'CUDA IPC' if ipc else 'shared-memory'} {msg['kind']} header "
                               f"from rank {msg['src']}, which has no such channel to it")
        t0 = time.perf_counter()
        if ipc:
            slot, offsets, export = msg["ipc"]
            buffers = self._ipc_mapped.read_ipc(msg["src"], slot, offsets, msg["buffers"], export)
        else:
            slot, offsets = msg["shm"]
            buffers = self._mapped.read(msg["src"], slot, offsets, msg["buffers"])
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        with self.stats.lock:
            self.stats.recv_s += time.perf_counter() - t0
            self.stats.bytes_received += nbytes
        if self._tracer is not None:
            self._tracer.transfer(f"recv {msg['kind']}", t0, time.perf_counter(), peer=msg["src"], step=msg["step"],
                                  bytes=nbytes)
        self._deliver(msg["kind"], msg["edge"], msg["step"], msg["src"], p2p.unpack(msg["entries"], buffers))

    def reap(self) -> None:
        """Give back the shared-memory slots whose views are all gone. The compute thread calls
        this when it runs out of work: the executor has dropped what it finished with, and a
        moment's work here costs its section nothing (where the header thread's polling for them
        would take the core from it every few milliseconds)."""
        if self._stop.is_set():
            return
        self._take_releases()
        if any(r is not None and r.outstanding for r in (self._mapped, self._ipc_mapped)):
            self._give_back()
        elif self._mapped is not None:
            self._mapped.sweep()  # removed slots still mapped here go, even with nothing outstanding

    def _give_back(self) -> None:
        """Send back the slots whose views are all gone (on a sealed stream of their own)."""
        with self._release_lock:
            back: dict[int, list[str]] = {}
            for reader in (self._mapped, self._ipc_mapped):
                if reader is not None:
                    for src, names in reader.reap().items():
                        back.setdefault(src, []).extend(names)
            for src, names in back.items():
                link = self._release_sockets.get(src)
                if link is None:
                    sock = zmq_link.connect(self._zctx, zmq.PUSH, self._peers[src],
                                            max_bytes=zmq_link.HEADER_MAX_BYTES, key=self._key)
                    link = self._release_sockets[src] = (sock, Sealer(self._key, f"rank{self.rank}/release",
                                                                      f"data{src}"))
                zmq_link.send_msg(link[0], make("release", src=self.rank, slots=names), sealer=link[1])

    def _open(self, frame: bytes) -> dict | None:
        """An authentic header, progress note or release from the rank it names; else None
        (dropped, logged)."""
        try:
            sender, msg = zmq_link.open_msg(self._opener, frame)
        except Rejected as exc:
            self.drops.drop("a header socket", str(exc))
            return None
        expected = f"rank{msg.get('src')}" + ("/release" if msg["t"] == "release" else "")
        if msg["t"] not in ("tensors", "progress", "release") or sender != expected:
            self.drops.drop(sender, f"a {msg['t']!r} message naming rank {msg.get('src')!r}")
            return None
        return msg

    def _recv_waiter(self, src: int, kind: str, received: queue.Queue) -> None:
        while True:
            job = self._next(received)
            if job is None:
                return
            works, buffers, msg, t0 = job
            self._complete(works, f"the bytes of {msg['kind']} tensors of step {msg['step'] + 1} from rank {src}")
            if self._tracer is not None:
                self._tracer.transfer(f"recv {kind}", t0, time.perf_counter(), peer=src, step=msg["step"],
                                      bytes=sum(b.numel() * b.element_size() for b in buffers))
            with self.stats.lock:
                self.stats.recv_s += time.perf_counter() - t0
                self.stats.bytes_received += sum(b.numel() * b.element_size() for b in buffers)
            if self._device.type == "cuda" and any(not b.is_cuda for b in buffers):
                buffers = [b.to(self._device) for b in buffers]  # staged through the host (gloo)
            self._deliver(msg["kind"], msg["edge"], msg["step"], src, p2p.unpack(msg["entries"], buffers))

