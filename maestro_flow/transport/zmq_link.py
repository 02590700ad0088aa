"""ZeroMQ socket helpers for the control plane and tensor headers.

Sockets are never shared between threads; each helper returns a socket for the calling thread.
Everything binds to loopback by default and to port 0 (the OS picks a free port), so tests never
collide. Sockets close with linger 0: an aborting process never blocks on undelivered frames.
A bound socket refuses frames over its size limit (ZeroMQ drops the connection that sent one).
Runtime frames are sealed (protocol/auth.py): `send_msg(..., sealer=)` and `open_msg` check the
MAC, the sender, the sequence number and the message's fields; `open_msg` raises `Rejected`.

A socket bound to an address other than loopback (`--host`: a multi-node run) is also a CurveZMQ
server, and a socket connecting to one a CurveZMQ client, both with keys derived from the run's
key (`key=`). Both sides are checked: a CurveZMQ client must know the server's long-term public
key, which the handshake never sends, and the server's context runs a ZAP handler (pyzmq's
ThreadAuthenticator) that admits only the client public key derived from the same secret. Close
such a context with `term()`, which stops the handler first. A peer without the run's secret
cannot complete the handshake, so not one byte of what it sends reaches the process. Sealing alone cannot give that: libzmq assembles a whole
multi-part message before anyone can check it (MAXMSGSIZE bounds each part, not their number),
so one unauthenticated message of many small parts is held whole in the receiver's memory. On
loopback the sockets stay plain (a local user reaches them as before; their frames are dropped
unsealed).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from functools import lru_cache
from typing import Any

import zmq
from zmq.utils import z85

from maestro_flow.protocol.auth import Opener, Rejected, Sealer
from maestro_flow.protocol.codec import decode, encode
from maestro_flow.protocol.messages import ProtocolError

LOOPBACK = "127.0.0.1"
CONTROL_MAX_BYTES = 64 << 20  # a control message (the largest: a step's plan for one replica)
HEADER_MAX_BYTES = 16 << 20  # a tensor header (shapes and dtypes, never tensor bytes)
CURVE_OVERHEAD = 64  # what CurveZMQ adds to a message part (33 bytes: command name, nonce, MAC), rounded up


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@lru_cache(maxsize=8)
def curve_keys(key: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """(server public, server secret, client public, client secret), Z85, derived from the run's
    key: every process of the run has them, and only they."""
    out: list[bytes] = []
    for role in (b"server", b"client"):
        secret = z85.encode(hmac.new(key, b"maestro_flow curve " + role, hashlib.sha256).digest())
        out += [zmq.curve_public(secret), secret]
    return out[0], out[1], out[2], out[3]


class _ClientKeys:
    """pyzmq's credentials provider: the client public keys (Z85) of the runs this context serves."""

    def __init__(self) -> None:
        self.allowed: set[bytes] = set()

    def callback(self, domain: str, client_key: bytes) -> bool:
        return any(hmac.compare_digest(client_key, k) for k in self.allowed)


# context -> (its ThreadAuthenticator, _ClientKeys), until term(context): the handler's thread holds
# the context, so neither goes before that.
_zap: dict[zmq.Context, tuple[Any, _ClientKeys]] = {}
_zap_lock = threading.Lock()


def _check_clients(ctx: zmq.Context, key: bytes) -> None:
    """Run a ZAP handler in `ctx` (once) that admits CurveZMQ clients holding the run's client key."""
    with _zap_lock:
        if ctx not in _zap:
            from zmq.auth.thread import ThreadAuthenticator

            auth, keys = ThreadAuthenticator(ctx), _ClientKeys()
            auth.start()
            auth.configure_curve_callback("*", credentials_provider=keys)
            _zap[ctx] = (auth, keys)
        _zap[ctx][1].allowed.add(curve_keys(key)[2])


def term(ctx: zmq.Context, linger: int | None = None) -> None:
    """Close `ctx`: its ZAP handler first (whose socket would keep term() waiting), then every
    socket with `linger` ms (None: term(), which waits for sockets closed elsewhere)."""
    with _zap_lock:
        auth = _zap.pop(ctx, (None, None))[0]
    if auth is not None:
        auth.stop()
    if linger is None:
        ctx.term()
    else:
        ctx.destroy(linger=linger)


def _host(addr: str) -> str:
    return addr.removeprefix("tcp://").rpartition(":")[0].strip("[]")


def bind(ctx: zmq.Context, kind: int, host: str = LOOPBACK, max_bytes: int = CONTROL_MAX_BYTES,
         hwm: int = 0, key: bytes | None = None) -> tuple[zmq.Socket, str]:
    """`hwm`: messages queued per connection (0: unbounded, for peers of the run, whose every
    message must arrive; a bound for sockets strangers may reach, where TCP then pushes back).
    `key`: the run's key; off loopback the socket then takes only CurveZMQ peers that have it."""
    sock = ctx.socket(kind)
    if key is not None and not is_loopback(host):
        public, secret, _, _ = curve_keys(key)
        _check_clients(ctx, key)  # before the socket can take a connection
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = secret, public
        max_bytes += CURVE_OVERHEAD  # the limit applies to the encrypted part
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if kind in (zmq.PULL, zmq.ROUTER):
        sock.setsockopt(zmq.RCVHWM, hwm)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, hwm)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


def connect(ctx: zmq.Context, kind: int, addr: str, identity: bytes | None = None,
            max_bytes: int = CONTROL_MAX_BYTES, key: bytes | None = None) -> zmq.Socket:
    """`key`: the run's key, for an address off loopback (a CurveZMQ server: see bind)."""
    sock = ctx.socket(kind)
    if key is not None and not is_loopback(_host(addr)):
        server, _, public, secret = curve_keys(key)
        sock.curve_serverkey = server
        sock.curve_publickey, sock.curve_secretkey = public, secret
        max_bytes += CURVE_OVERHEAD
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.SNDHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(addr)
    return sock


def send_msg(sock: zmq.Socket, msg: dict, identity: bytes | None = None, sealer: Sealer | None = None) -> None:
    frame = encode(msg) if sealer is None else sealer.seal(encode(msg))
    if identity is not None:  # a ROUTER's two parts, sent as send_multipart would, at half its cost
        sock.send(identity, zmq.SNDMORE)
    sock.send(frame)


def open_msg(opener: Opener, frame: bytes) -> tuple[str, dict]:
    """(sender, message) of a sealed frame, or Rejected saying why it is dropped."""
    sender, payload = opener.open(frame)
    try:
        return sender, decode(payload)
    except ProtocolError as exc:
        raise Rejected(f"authentic but malformed: {exc}") from None
