"""transport/shm.py in one process: what a sender writes into a slot is what the receiver's views
hold, for every kind of tensor the fast copy takes or leaves to torch, and a slot goes back to
its sender's pool once no view of its message is left (and only then)."""

from __future__ import annotations

import os

import pytest
import torch

from maestro_flow.transport import p2p, shm


@pytest.fixture
def pair():
    writer, reader = shm.SlotWriter(f"maestro-unit-{os.getpid()}"), shm.SlotReader()
    yield writer, reader
    reader.close()
    writer.close()
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"maestro-unit-{os.getpid()}-")]


def _send(writer, reader, tensors):
    items = [(i, "x", t) for i, t in enumerate(tensors)]
    entries, specs, buffers = p2p.pack_each(items)
    name, offsets = writer.write((1, "fwd"), buffers)
    return name, p2p.unpack(entries, reader.read(0, name, offsets, specs))


def test_views_hold_what_was_written(pair):
    writer, reader = pair
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    z = torch.complex(torch.arange(5.0), torch.ones(5))
    tensors = [
        torch.randn(3, 5),  # contiguous: the memmove path
        torch.arange(7, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randn(4, 4).to(torch.bfloat16),
        base.t(),  # not contiguous: torch's copy
        base[:, 1:3],
        z.conj(),  # a lazy conjugate: its bytes are not its values
        torch.empty(0, 3),
        torch.randn(2, 3, requires_grad=True),
    ]
    _, got = _send(writer, reader, tensors)
    assert [(sid, name) for sid, name, _ in got] == [(i, "x") for i in range(len(tensors))]
    for (_, _, out), want in zip(got, tensors, strict=True):
        assert out.dtype == want.dtype and out.shape == want.shape and not out.requires_grad
        assert torch.equal(out, want.detach().resolve_conj())


def test_a_slot_goes_back_only_once_no_view_is_left(pair):
    writer, reader = pair
    name, got = _send(writer, reader, [torch.ones(100), torch.zeros(10)])
    keep = got[1][2][2:5]  # a view of a view of the slot
    del got
    assert reader.reap() == {}  # `keep` still reads the slot
    del keep
    assert reader.reap() == {0: [name]}
    writer.released(1, [name])
    again, got = _send(writer, reader, [torch.full((50,), 3.0)])
    assert again == name  # the freed slot, not a new one
    assert torch.equal(got[0][2], torch.full((50,), 3.0))
