"""ZeroMQ socket helpers for the control plane and tensor headers.

Sockets are never shared between threads; each helper returns a socket for the calling thread.
Everything binds to loopback by default and to port 0 (the OS picks a free port), so tests never
collide. Sockets close with linger 0: an aborting process never blocks on undelivered frames.
"""

from __future__ import annotations

import zmq

from maestro_flow.protocol.codec import decode, encode

LOOPBACK = "127.0.0.1"


def bind(ctx: zmq.Context, kind: int, host: str = LOOPBACK) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind in (zmq.PULL, zmq.ROUTER):
        sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


def connect(ctx: zmq.Context, kind: int, addr: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(addr)
    return sock


def send_msg(sock: zmq.Socket, msg: dict, identity: bytes | None = None) -> None:
    if identity is None:
        sock.send(encode(msg))
    else:
        sock.send_multipart([identity, encode(msg)])


def recv_msg(sock: zmq.Socket) -> dict:
    return decode(sock.recv())
