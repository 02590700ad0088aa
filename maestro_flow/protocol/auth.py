"""Authenticated control frames: every frame carries an HMAC-SHA256 under the run's key.

Pure (standard library only). A run has one secret (MAESTRO_SECRET, --secret-file, or 32 random
bytes generated for a one-node run and handed to its workers). A secret a user gives is stretched
first (`load_secret`: scrypt), so that whatever is published under keys derived from it (the
rendezvous store's sealed values, runtime/agent.py) costs a guesser a slow KDF per guess; the
raw secret goes no further than the process that read it. Each attempt of a run derives its
own key from the secret and a fresh session nonce, so frames of another run or of an earlier
attempt never verify.

A sealed frame is `mac (32) | seq (8, big-endian) | len(sender) (1) | sender | payload`. The MAC
covers the recipient's name (its length first: "data1" + "0..." is not "data10" + "..."), the
sequence number, the sender's name and the payload, so a frame
cannot be redirected to another recipient, attributed to another sender, or altered. A sender
numbers the frames of each (sender, recipient) stream 1, 2, 3...; ZeroMQ keeps a stream's order,
so a recipient refuses any frame whose number is not above the last it accepted (a replay).
`open` raises `Rejected` with the reason; receivers drop such frames and log them (`DropLog`),
they never fail on them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import sys
import threading
import time
from collections.abc import Callable

MAC_BYTES = 32
_SEQ = struct.Struct("!Q")
SECRET_ENV = "MAESTRO_SECRET"
MIN_SECRET_BYTES = 16
SCRYPT_N = 1 << 15


class Rejected(Exception):
    """A frame that is dropped: unauthenticated, replayed, malformed, oversized or out of place."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def new_nonce() -> str:
    return secrets.token_hex(16)


def load_secret(secret_file: str | None = None, environ: dict[str, str] | None = None) -> bytes | None:
    """The run's secret from --secret-file, else MAESTRO_SECRET, else None (generate one).
    Raises ValueError with what to change when the secret is unusable."""
    environ = os.environ if environ is None else environ
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                _check_mode(secret_file, f.fileno())
                raw = f.read().strip()
        except OSError as exc:
            raise ValueError(f"--secret-file {secret_file}: cannot read it ({exc.strerror})") from None
        origin = f"--secret-file {secret_file}"
    elif environ.get(SECRET_ENV):
        raw, origin = environ[SECRET_ENV].strip().encode(), SECRET_ENV
    else:
        return None
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{origin}: the secret has {len(raw)} bytes, at least {MIN_SECRET_BYTES} are needed "
                         f"(e.g. `openssl rand -hex 32`)")
    return stretch(raw)


def _check_mode(path: str, fd: int) -> None:
    """Refuse a secret file that others can change (found in review: one any user could read
    and write was taken silently); warn where others can read it (ssh's rule for keys). Owned by
    this user or root (a container's mounted secret); root may read anyone's."""
    st = os.fstat(fd)
    foreign = st.st_uid not in (os.geteuid(), 0) and os.geteuid() != 0
    if st.st_mode & 0o022 or foreign:
        who = "its owner is another user" if foreign else "others can write it"
        raise ValueError(f"--secret-file {path}: {who} (mode {st.st_mode & 0o777:o}); make it yours and "
                         f"`chmod 600 {path}`")
    if st.st_mode & 0o044:
        print(f"maestro: warning: --secret-file {path} is readable by others (mode {st.st_mode & 0o777:o}): "
              f"`chmod 600 {path}`", file=sys.stderr, flush=True)


def stretch(raw: bytes) -> bytes:
    """The key material a user's secret gives (scrypt, ~0.1 s and 32 MiB once per process that
    reads it): a passphrase costs a guesser as much per guess."""
    return hashlib.scrypt(raw, salt=b"maestro_flow secret v1", n=SCRYPT_N, r=8, p=1, maxmem=64 << 20, dklen=32)


def derive_key(secret: bytes, nonce: str) -> bytes:
    return hmac.new(secret, b"maestro_flow control plane\x00" + nonce.encode(), hashlib.sha256).digest()


def _named(recipient: str) -> bytes:
    """The recipient as the MAC covers it: its length, then its name."""
    name = recipient.encode()
    if len(name) > 255:
        raise ValueError("recipient name longer than 255 bytes")
    return bytes([len(name)]) + name


def _keyed(key: bytes, recipient: str) -> hmac.HMAC:
    """HMAC-SHA256 with the run's key, fed the recipient already: a frame's MAC copies it and
    adds the frame's body (the key is not set up again at every frame; the MAC is the same)."""
    return hmac.new(key, _named(recipient), hashlib.sha256)


class Sealer:
    """Seals the frames of one stream (one sender to one recipient). Not thread-safe: one
    stream is written by one thread, in the order its frames go on the wire."""

    def __init__(self, key: bytes, sender: str, recipient: str) -> None:
        sender_bytes = sender.encode()
        if len(sender_bytes) > 255:
            raise ValueError("sender name longer than 255 bytes")
        self._named_sender = bytes([len(sender_bytes)]) + sender_bytes
        self._mac = _keyed(key, recipient)
        self._seq = 0

    def seal(self, payload: bytes) -> bytes:
        self._seq += 1
        body = _SEQ.pack(self._seq) + self._named_sender + payload
        mac = self._mac.copy()
        mac.update(body)
        return mac.digest() + body


class Opener:
    """Opens the frames sent to one recipient, from any number of senders. Not thread-safe."""

    def __init__(self, key: bytes, recipient: str, max_bytes: int) -> None:
        self._mac, self.max_bytes = _keyed(key, recipient), max_bytes
        self._last: dict[str, int] = {}

    def open(self, frame: bytes) -> tuple[str, bytes]:
        """(sender, payload) of an authentic frame, or Rejected."""
        if len(frame) > self.max_bytes:
            raise Rejected(f"frame of {len(frame)} bytes, over the limit of {self.max_bytes}")
        if len(frame) < MAC_BYTES + _SEQ.size + 1:
            raise Rejected(f"frame of {len(frame)} bytes is too short to be sealed")
        mac, body = frame[:MAC_BYTES], frame[MAC_BYTES:]
        expected = self._mac.copy()
        expected.update(body)
        if not hmac.compare_digest(mac, expected.digest()):
            raise Rejected("bad MAC (not sealed with this run's secret)")
        (seq,) = _SEQ.unpack_from(body)
        n = body[_SEQ.size]
        start = _SEQ.size + 1
        sender = body[start:start + n].decode("utf-8", "replace")
        if seq <= self._last.get(sender, 0):
            raise Rejected(f"replayed frame {seq} from {sender} (last accepted: {self._last[sender]})")
        self._last[sender] = seq
        return sender, body[start + n:]


class DropLog:
    """Logs dropped frames without letting a flood of them flood the log: the first few in
    full, then one summary line per interval with the count."""

    def __init__(self, where: str, write: Callable[[str], None] | None = None, first: int = 10,
                 interval_s: float = 10.0) -> None:
        self.where, self.first, self.interval_s = where, first, interval_s
        self._write = write or (lambda text: print(text, file=sys.stderr, flush=True))
        self.count = 0
        self._unlogged = 0
        self._last_summary = time.monotonic()
        self._lock = threading.Lock()

    def drop(self, origin: str, reason: str) -> None:
        with self._lock:
            self.count += 1
            if self.count <= self.first:
                self._write(f"maestro: {self.where} dropped a message from {origin}: {reason}")
                return
            self._unlogged += 1
            now = time.monotonic()
            if now - self._last_summary < self.interval_s:
                return
            self._write(f"maestro: {self.where} dropped {self._unlogged} more messages in the last "
                        f"{now - self._last_summary:.0f}s (last from {origin}: {reason})")
            self._unlogged, self._last_summary = 0, now
