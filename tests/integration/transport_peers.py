"""Processes for the transport tests: real TensorComms over gloo and ZeroMQ on loopback.

`peer_main` runs in a spawned process: it joins a world through a TCPStore, publishes its header
address, builds a TensorComm exactly like a worker does — its channels over gloo groups, or
through shared-memory slots (`path="shm"`; "shm-full": where no slot can be made, so the
channel falls back on its group), or on one GPU through CUDA IPC slots (`path="ipc"`,
tests/gpu) — runs a scenario, and puts what it received on a result queue as plain data, with
how many slots it made.
"""

from __future__ import annotations

import os
import queue
import resource
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from maestro_flow.protocol.auth import derive_key
from maestro_flow.transport import zmq_link
from maestro_flow.transport.local_comm import LocalComm
from maestro_flow.transport.tensor_comm import TensorComm

KEY = derive_key(b"transport test secret", "session")


def messages(seed: int) -> list[list[tuple[int, str, torch.Tensor | None]]]:
    """A varied message sequence: dtypes, shapes, big and small tensors, missing entries, and
    big tensors that are not plain bytes (a lazy conjugate, an efficient zero tensor: every path
    must send their values, not fail after the header went)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in range(6):
        items = []
        for s in range(3):
            sid = m * 10 + s
            # Explicit dtypes: the values must not depend on the process's default dtype.
            items.append((sid, "f32", torch.randn(5 + s, 7, generator=g, dtype=torch.float32)))
            items.append((sid, "f64", torch.randn(3, generator=g, dtype=torch.float64)))
            items.append((sid, "i64", torch.randint(0, 100, (4 + m,), generator=g)))
            items.append((sid, "bf16", torch.randn(2, 2, generator=g, dtype=torch.float32).to(torch.bfloat16)))
            items.append((sid, "i16", torch.randint(-100, 100, (3,), generator=g, dtype=torch.int16)))
            items.append((sid, "none", None))
        if m % 2 == 0:
            items.append((m * 10, "big", torch.randn(300_000, generator=g, dtype=torch.float32)))  # > 1 MiB: uncoalesced
        items.append((m * 10, "empty", torch.empty(0, 3, dtype=torch.float32)))
        if m == 1:
            items.append((m * 10, "conj", torch.randn(150_000, generator=g, dtype=torch.complex64).conj()))
        if m == 3:
            items.append((m * 10, "zero", torch._efficientzerotensor((300_000,), dtype=torch.float32)))
        out.append(items)
    return out


def plain(items) -> list:
    return [(sid, name, None if t is None else (str(t.dtype), list(t.shape), _total(t))) for sid, name, t in items]


def _total(t: torch.Tensor) -> float:
    if t.is_complex():  # the imaginary part weighs differently: a lost conjugation shows
        t = t.resolve_conj()
        return (t.real.double().sum() + 3 * t.imag.double().sum()).item()
    return t.float().sum().item()


def peer_main(rank: int, world: int, port: int, plan: list[tuple[int, int, str]], delay_s: dict, results,
              path: str = "gloo", hold: bool = False, pace_s: float = 0.0) -> None:
    """`hold`: keep every received tensor until everything arrived (the sender must not wait);
    `pace_s`: pause after each send (time for the receiver to give a slot back)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    zctx = zmq.Context()
    pull, addr = zmq_link.bind(zctx, zmq.PULL)
    store.set(f"addr{rank}", addr)
    peers = {r: store.get(f"addr{r}").decode() for r in range(world)}
    groups = {}
    for src, dst, kind in plan:  # every rank creates every group, in the same order (shm falls back on it)
        g = dist.new_group(sorted((src, dst)))
        if rank in (src, dst):
            groups[(src, dst, kind)] = g
    if path == "shm-full":  # no slot can be made (as with a full /dev/shm): the channel falls back on gloo
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    time.sleep(delay_s.get(rank, 0.0))  # a slow peer: no receive posted before this
    got: queue.Queue = queue.Queue()
    errors: list[str] = []
    held: list = []

    device = torch.device("cuda", 0) if path == "ipc" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def deliver(kind, edge, step, src, items):
        if hold:
            held.append(items)
        # Values summed on the host, as the expected ones are (a device sum may round otherwise).
        got.put((time.monotonic(), kind, src, plain([(sid, n, t if t is None else t.cpu()) for sid, n, t in items])))

    prefix = f"maestro-transport-test-{port}-{rank}"
    comm = TensorComm(zctx=zctx, rank=rank, pull=pull, key=KEY, peers=peers, groups=groups, device=device,
                      deliver=deliver, on_error=errors.append, shm=plan if path.startswith("shm") else (),
                      shm_prefix=prefix, ipc=plan if path == "ipc" else ())
    for src, dst, kind in plan:
        if src == rank:
            for i, items in enumerate(messages(seed=dst * 100 + src)):
                comm.send(dst, kind, 0, i, [(sid, n, t if t is None else t.to(device)) for sid, n, t in items])
                time.sleep(pace_s)
    expected = sum(len(messages(0)) for src, dst, _ in plan if dst == rank)
    received = [got.get(timeout=60) for _ in range(expected)]
    held.clear()  # the slots go back to their senders now
    slots = len([n for n in os.listdir("/dev/shm") if n.startswith(prefix)]) if path == "shm" else 0
    if path == "ipc":
        slots = comm._ipc_slots._count if comm._ipc_slots is not None else 0  # device slots it made
    results.put((rank, time.monotonic(), received, errors, slots))
    store.set(f"done{rank}", "1")
    for r in range(world):  # keep every process alive until all have received everything
        store.get(f"done{r}")
    assert comm.close(timeout_s=10.0), "comm threads did not stop"
    dist.destroy_process_group()


def local_exchange(plan: list[tuple[int, int, str]]) -> dict[int, list]:
    """The same scenario over LocalComm (in-process), for the contract comparison."""
    received: dict[int, list] = {}

    def deliver_to(dst):
        return lambda kind, edge, step, src, items: received.setdefault(dst, []).append((0.0, kind, src, plain(items)))

    comms = {r: LocalComm(r, deliver_to) for pair in plan for r in pair[:2]}
    for src, dst, kind in plan:
        for i, items in enumerate(messages(seed=dst * 100 + src)):
            comms[src].send(dst, kind, 0, i, items)
    return received


RELAY_DTYPES = ("int16", "uint16", "uint32", "float8_e4m3fn", "bool", "complex64", "bfloat16")


def relay_main(rank: int, port: int, results) -> None:
    """A tensor-parallel relay of two ranks (rank 0 the leader): every dtype an edge carries goes
    through p2p.post_broadcasts; rank 1 puts what it got (as plain values) on `results`."""
    from maestro_flow.transport import p2p

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    items = [(i, name, torch.randint(0, 2, (5 + i,), generator=g).to(getattr(torch, name)))
             for i, name in enumerate(RELAY_DTYPES)]
    entries, specs, buffers = p2p.pack(items)
    if rank == 1:
        buffers = p2p.allocate(specs, torch.device("cpu"))
    try:
        p2p.wait_all(p2p.post_broadcasts(buffers, 0, dist.group.WORLD))
        got = [(name, t.view(torch.uint8).tolist()) for _, name, t in p2p.unpack(entries, buffers)]
        results.put((rank, got, [(name, t.view(torch.uint8).tolist()) for _, name, t in items]))
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        results.put((rank, f"{type(exc).__name__}: {exc}", None))
    dist.destroy_process_group()


def fallback_main(rank: int, port: int, results) -> None:
    """Rank 0 sends rank 1 small messages through shared-memory slots, then one too big for the
    host's shared memory (a file-size limit stands in for a full /dev/shm), so its channel falls
    back on gloo, then more. Rank 1 holds the slot messages until then. Both loop as a worker
    does when out of work (comm.reap). Puts (rank, slot files of rank 0 left, slots rank 1
    still maps) on `results`."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    zctx = zmq.Context()
    pull, addr = zmq_link.bind(zctx, zmq.PULL)
    store.set(f"addr{rank}", addr)
    peers = {r: store.get(f"addr{r}").decode() for r in range(2)}
    plan = [(0, 1, "fwd")]
    groups = {(0, 1, "fwd"): dist.new_group([0, 1])}
    prefix = f"maestro-transport-fallback-{port}-0"
    got: queue.Queue = queue.Queue()
    held: list = []

    def deliver(kind, edge, step, src, items):
        held.append(items)
        got.put(step)

    comm = TensorComm(zctx=zctx, rank=rank, pull=pull, key=KEY, peers=peers, groups=groups,
                      device=torch.device("cpu"), deliver=deliver, on_error=print, shm=plan,
                      shm_prefix=f"maestro-transport-fallback-{port}-{rank}")  # rank 0's slots: `prefix`
    files = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]  # noqa: E731
    if rank == 0:
        for i in range(3):
            comm.send(1, "fwd", 0, i, [(i, "x", torch.full((1000,), float(i)))])  # 64 KiB slots
        made = len(files())
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        comm.send(1, "fwd", 0, 3, [(3, "x", torch.ones(300_000))])  # no slot for it: gloo from now on
        store.get("let go")
        deadline = time.monotonic() + 10.0
        while files() and time.monotonic() < deadline:
            comm.reap()
            time.sleep(0.05)
        results.put((rank, made, len(files())))
    else:
        for _ in range(4):
            got.get(timeout=60)
        held.clear()  # every view gone: the header thread gives the slots back
        store.set("let go", "1")
        deadline = time.monotonic() + 10.0
        while comm._mapped._maps and time.monotonic() < deadline:
            comm.reap()
            time.sleep(0.05)
        results.put((rank, None, len(comm._mapped._maps)))
    store.set(f"done{rank}", "1")
    for r in range(2):
        store.get(f"done{r}")
    assert comm.close(timeout_s=10.0), "comm threads did not stop"
    dist.destroy_process_group()
