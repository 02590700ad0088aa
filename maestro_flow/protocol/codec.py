"""msgpack encoding of control messages. Never pickles; integer map keys are allowed."""

from __future__ import annotations

from typing import Any

import msgpack

from maestro_flow.protocol.messages import ProtocolError, check


def _default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return sorted(obj) if isinstance(obj, (set, frozenset)) else list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} on the control plane")


def encode(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True, default=_default)


def decode(frame: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"undecodable frame ({len(frame)} bytes): {exc}") from None
    return check(msg)
