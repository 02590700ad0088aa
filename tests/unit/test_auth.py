"""Sealed control frames (maestro_flow/protocol/auth.py): what verifies and what is refused.

A frame verifies only under the run's key, for the recipient it was sealed for, unaltered, and
once; the secret comes from --secret-file or MAESTRO_SECRET and a short one is refused.
"""

from __future__ import annotations

import os

import pytest

from maestro_flow.protocol.auth import (
    MAC_BYTES,
    DropLog,
    Opener,
    Rejected,
    Sealer,
    derive_key,
    load_secret,
    new_nonce,
    new_secret,
    stretch,
)
from maestro_flow.protocol.codec import encode
from maestro_flow.protocol.messages import make
from maestro_flow.transport.zmq_link import open_msg

KEY = derive_key(b"s" * 32, "session-1")


def test_a_sealed_frame_opens_once_with_its_sender():
    sealer, opener = Sealer(KEY, "rank1", "coordinator"), Opener(KEY, "coordinator", 1 << 20)
    frames = [sealer.seal(encode(make("heartbeat", rank=1))) for _ in range(3)]
    for frame in frames:
        sender, msg = open_msg(opener, frame)
        assert (sender, msg) == ("rank1", {"t": "heartbeat", "rank": 1})
    with pytest.raises(Rejected, match="replayed frame 2 from rank1"):
        opener.open(frames[1])


def test_a_frame_is_the_mac_of_recipient_and_body_then_the_body():
    """The wire format, computed independently: HMAC-SHA256 under the run's key of the recipient
    (length, name) and the body (sequence, sender's length and name, payload), then the body. The
    sealer and opener keep a keyed MAC and copy it per frame; the bytes must not change with that."""
    import hashlib
    import hmac
    import struct

    sealer, opener = Sealer(KEY, "rank1", "data2"), Opener(KEY, "data2", 1 << 20)
    for seq, payload in enumerate((b"first", b"", b"third" * 100), start=1):
        body = struct.pack("!Q", seq) + bytes([5]) + b"rank1" + payload
        expected = hmac.new(KEY, bytes([5]) + b"data2" + body, hashlib.sha256).digest() + body
        frame = sealer.seal(payload)
        assert frame == expected
        assert opener.open(frame) == ("rank1", payload)


def test_each_sender_has_its_own_sequence():
    opener = Opener(KEY, "coordinator", 1 << 20)
    a, b = Sealer(KEY, "rank0", "coordinator"), Sealer(KEY, "rank1", "coordinator")
    assert opener.open(a.seal(b"x"))[0] == "rank0"
    assert opener.open(b.seal(b"y"))[0] == "rank1"
    assert opener.open(a.seal(b"z")) == ("rank0", b"z")


@pytest.mark.parametrize("tamper", ["wrong key", "other session", "other recipient", "flipped payload bit",
                                    "renamed sender", "truncated", "empty", "garbage"])
def test_anything_but_the_sealed_frame_is_rejected(tamper):
    frame = Sealer(KEY, "rank1", "coordinator").seal(encode(make("loss", rank=1, step=0, loss_sum=1.0,
                                                                 denominator=1e30)))
    opener = Opener(KEY, "coordinator", 1 << 20)
    if tamper == "wrong key":
        frame = Sealer(derive_key(b"t" * 32, "session-1"), "rank1", "coordinator").seal(b"x")
    elif tamper == "other session":
        frame = Sealer(derive_key(b"s" * 32, "session-2"), "rank1", "coordinator").seal(b"x")
    elif tamper == "other recipient":
        frame = Sealer(KEY, "rank1", "rank2").seal(b"x")
    elif tamper == "flipped payload bit":
        frame = frame[:-1] + bytes([frame[-1] ^ 1])
    elif tamper == "renamed sender":
        i = frame.index(b"rank1")
        frame = frame[:i] + b"rank2" + frame[i + 5:]
    elif tamper == "truncated":
        frame = frame[:40]
    elif tamper == "empty":
        frame = b""
    else:
        frame = bytes(range(256)) * 4
    with pytest.raises(Rejected):
        opener.open(frame)


def test_oversized_frames_are_rejected_before_any_mac_is_computed():
    opener = Opener(KEY, "coordinator", max_bytes=1024)
    with pytest.raises(Rejected, match="over the limit of 1024"):
        opener.open(b"\0" * 1025)


def test_authentic_but_malformed_messages_are_rejected():
    sealer, opener = Sealer(KEY, "rank1", "coordinator"), Opener(KEY, "coordinator", 1 << 20)
    with pytest.raises(Rejected, match="malformed: message 'loss' lacks"):
        open_msg(opener, sealer.seal(encode({"t": "loss", "rank": 1})))
    with pytest.raises(Rejected, match="malformed: undecodable"):
        open_msg(opener, sealer.seal(b"\xc1"))


def test_secret_from_file_or_environment(tmp_path, capsys):
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123\n")
    path.chmod(0o600)
    assert load_secret(str(path), environ={}) == stretch(b"0123456789abcdef0123")
    assert load_secret(None, environ={"MAESTRO_SECRET": "x" * 20}) == stretch(b"x" * 20)
    assert load_secret(None, environ={}) is None
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="at least 16 are needed"):
        load_secret(None, environ={"MAESTRO_SECRET": "short"})
    with pytest.raises(ValueError, match="cannot read it"):
        load_secret(str(tmp_path / "missing"), environ={})
    assert len(new_secret()) == 32 and new_nonce() != new_nonce()


def test_a_secret_is_stretched_so_a_guess_costs_a_slow_kdf():
    """Found in review: the store carried a MAC under a key one HMAC away from the secret, which
    tested a guessed passphrase in microseconds."""
    import time

    start = time.perf_counter()
    key = stretch(b"Summer2024Summer2024")
    assert time.perf_counter() - start > 0.01 and len(key) == 32 and key != stretch(b"Summer2024Summer2025")


def test_a_secret_file_others_can_change_is_refused_and_one_they_can_read_is_warned_of(tmp_path, capsys):
    """Found in review: a file every user could read and write was taken silently."""
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123")
    path.chmod(0o666)
    with pytest.raises(ValueError, match=r"others can write it \(mode 666\); make it yours and `chmod 600"):
        load_secret(str(path), environ={})
    path.chmod(0o644)
    assert load_secret(str(path), environ={}) == stretch(b"0123456789abcdef0123")
    assert "is readable by others (mode 644): `chmod 600" in capsys.readouterr().err


def test_a_secret_file_of_root_is_taken_one_of_another_user_is_not(tmp_path, monkeypatch):
    """A container's mounted secret is root's (Docker /run/secrets, Kubernetes volumes): found in
    review, the first version refused it to a non-root user."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to other owners")
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123")
    path.chmod(0o400)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # this process as a user, the file root's
    assert load_secret(str(path), environ={}) == stretch(b"0123456789abcdef0123")
    os.chown(path, 2000, 2000)
    with pytest.raises(ValueError, match="its owner is another user"):
        load_secret(str(path), environ={})
    monkeypatch.undo()  # root may read anyone's
    assert load_secret(str(path), environ={}) == stretch(b"0123456789abcdef0123")


def test_a_frame_for_one_recipient_does_not_open_at_another_whose_name_it_begins():
    """Found in review: the MAC covered recipient + body, so "data10" + body was "data1" + "0" +
    body: a frame sealed for rank 10 opened at rank 1 with one byte moved."""
    frame = Sealer(KEY, "rank3", "data10").seal(b"payload")
    moved = frame[:MAC_BYTES] + b"0" + frame[MAC_BYTES:]
    with pytest.raises(Rejected, match="bad MAC"):
        Opener(KEY, "data1", 1 << 20).open(moved)
    assert Opener(KEY, "data10", 1 << 20).open(frame) == ("rank3", b"payload")


def test_drop_log_is_bounded():
    lines: list[str] = []
    log = DropLog("the coordinator", lines.append, first=3, interval_s=3600)
    for i in range(10_000):
        log.drop("connection 00", f"bad MAC {i}")
    assert log.count == 10_000
    assert len(lines) == 3 and "dropped a message from connection 00: bad MAC 0" in lines[0]
