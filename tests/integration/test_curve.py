"""Sockets off loopback (`--host`) take only peers that hold the run's secret (CurveZMQ, keys
derived from the run's key: transport/zmq_link.py). Sealing alone let one unauthenticated
message of a million 200-byte parts arrive whole in the receiver's memory (libzmq assembles
a whole multi-part message before anyone can check it); a peer without the keys now cannot
complete the handshake, so nothing it sends arrives. And a real run with --host on this host's
own address trains as on loopback.

Needs an IPv4 address of this host other than loopback (skipped without one).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from maestro_flow.transport import zmq_link
from tests.integration.conftest import maestro

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def routable_ip() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing), else None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
            ip = probe.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


HOST = routable_ip()
needs_ip = pytest.mark.skipif(HOST is None, reason="no IPv4 address other than loopback on this host")
KEY = bytes(range(32))


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


@needs_ip
def test_only_peers_with_the_runs_keys_get_through():
    ctx = zmq.Context()
    router, addr = zmq_link.bind(ctx, zmq.ROUTER, HOST, key=KEY)
    got: list[list[bytes]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if router.poll(50):
                got.append(router.recv_multipart())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    before = rss_mb()
    # An outsider's one message of a million parts (200 MB), from another process.
    flood = subprocess.Popen([sys.executable, "-c", f"""
import time, zmq
s = zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.SNDHWM, 0); s.connect({addr!r})
for _ in range(999_999): s.send(b'x' * 200, zmq.SNDMORE)
s.send(b'x' * 200); time.sleep(30)
"""])
    try:
        wrong = zmq_link.connect(ctx, zmq.DEALER, addr, key=bytes(32))  # another run's keys
        wrong.send(b"from another run")
        friend = zmq_link.connect(ctx, zmq.DEALER, addr, key=KEY)
        friend.send(b"hello")
        peak, deadline = before, time.monotonic() + 8
        while time.monotonic() < deadline:
            peak = max(peak, rss_mb())
            time.sleep(0.1)
        assert [frames[1:] for frames in got] == [[b"hello"]]  # the friend's only
        assert peak - before < 50, f"the receiver grew from {before:.0f} to {peak:.0f} MB"
        assert flood.poll() is None  # it was sending all along
    finally:
        flood.kill()
        flood.wait()
        stop.set()
        reader.join(5)
        zmq_link.term(ctx, linger=0)


@needs_ip
def test_a_client_needs_the_runs_client_key_as_well():
    """Found by review: only the server's public key was a credential; a client that had it
    got through with any key pair of its own. The server's ZAP handler now admits only the
    client key derived from the run's secret, and term() stops the handler (or it would hang)."""
    ctx = zmq.Context()
    try:
        pull, addr = zmq_link.bind(ctx, zmq.PULL, HOST, key=KEY)
        server_public = zmq_link.curve_keys(KEY)[0]
        stranger = ctx.socket(zmq.PUSH)
        stranger.curve_serverkey = server_public
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(addr)
        stranger.send(b"a stranger holding the server's public key")
        assert not pull.poll(1500)
        friend = zmq_link.connect(ctx, zmq.PUSH, addr, key=KEY)
        friend.send(b"hello")
        assert pull.poll(5000) and pull.recv() == b"hello"
        assert not pull.poll(200)
    finally:
        started = time.monotonic()
        zmq_link.term(ctx, linger=0)
        assert time.monotonic() - started < 5


@needs_ip
def test_a_part_of_the_size_limit_arrives_through_curve_too():
    """MAXMSGSIZE applies to the encrypted part: without room for CurveZMQ's 33 bytes, a part
    of 967 to 1000 bytes under a 1000-byte limit was dropped off loopback and not on it."""
    ctx = zmq.Context()
    try:
        pull, addr = zmq_link.bind(ctx, zmq.PULL, HOST, max_bytes=1000, key=KEY)
        push = zmq_link.connect(ctx, zmq.PUSH, addr, max_bytes=1000, key=KEY)
        push.send(b"x" * 1000)
        assert pull.poll(5000) and pull.recv() == b"x" * 1000
    finally:
        zmq_link.term(ctx, linger=0)


@needs_ip
def test_a_run_on_this_hosts_address_trains(demo_data):
    result = maestro("run", "pipelines/distill.py", "--quiet", "--no-run-dir", "--steps", "2", "--host", HOST,
                     "--set", f"data.path={demo_data}", env={**os.environ, "MAESTRO_SECRET": "s" * 32}, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
