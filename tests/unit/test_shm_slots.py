"""transport/shm.py in one process: what a sender writes into a slot is what the receiver's views
hold, for every kind of tensor the fast copy takes or leaves to torch, and a slot goes back to
its sender's pool once no view of its message is left (and only then)."""

from __future__ import annotations

import os

import pytest
import torch

from maestro_flow.transport import p2p, shm

pytestmark = pytest.mark.skipif(not os.access(shm.SHM_DIR, os.W_OK), reason="no writable /dev/shm")


@pytest.fixture
def pair():
    writer, reader = shm.SlotWriter(f"maestro-unit{os.getpid()}-0"), shm.SlotReader(f"maestro-unit{os.getpid()}")
    yield writer, reader
    reader.close()
    writer.close()
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"maestro-unit{os.getpid()}-")]


def _send(writer, reader, tensors):
    items = [(i, "x", t) for i, t in enumerate(tensors)]
    entries, specs, buffers = p2p.pack_each(items)
    name, offsets = writer.write((1, "fwd"), buffers)
    return name, p2p.unpack(entries, reader.read(0, name, offsets, specs))


def test_only_the_senders_own_slots_of_this_run_are_mapped(pair, tmp_path):
    """Found in review: any maestro-* file in /dev/shm was mapped read-write on a header's word,
    another rank's slot or another run's."""
    writer, reader = pair
    entries, specs, buffers = p2p.pack_each([(0, "x", torch.ones(4))])
    name, offsets = writer.write((1, "fwd"), buffers)
    with pytest.raises(ValueError, match="not a slot of rank 3 of this run"):
        reader.read(3, name, offsets, specs)  # rank 0's slot, named by rank 3
    other = shm.SlotWriter(f"maestro-otherrun{os.getpid()}-0")
    try:
        theirs, offsets = other.write((1, "fwd"), buffers)
        with pytest.raises(ValueError, match="not a slot of rank 0 of this run"):
            reader.read(0, theirs, offsets, specs)
    finally:
        other.close()
    assert reader.read(0, name, offsets, specs)[0].tolist() == [1.0] * 4


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
        torch._neg_view(torch.arange(4.0)),  # a lazy negation, likewise
        torch._efficientzerotensor(4),  # zeros with no memory (autograd makes them): data_ptr() is 0
        torch.empty(0, 3),
        torch.randn(2, 3, requires_grad=True),
    ]
    _, got = _send(writer, reader, tensors)
    assert [(sid, name) for sid, name, _ in got] == [(i, "x") for i in range(len(tensors))]
    for (_, _, out), want in zip(got, tensors, strict=True):
        assert out.dtype == want.dtype and out.shape == want.shape and not out.requires_grad
        assert torch.equal(out, want.detach().resolve_conj().resolve_neg())


def test_closing_the_reader_leaves_a_live_views_memory_mapped(pair):
    """Found in QA: a worker stopping mid-step closed its reader, which unmapped a slot whose
    views its compute thread was still reading (torch.frombuffer holds no buffer export), and the
    worker died of SIGSEGV. The view now keeps its mapping until it is gone."""
    import gc

    writer, reader = pair
    want = torch.arange(50_000, dtype=torch.float64)
    _, got = _send(writer, reader, [want])
    view = got[0][2]
    del got
    reader.close()  # as a worker's shutdown does, the compute thread still holding `view`
    gc.collect()
    assert torch.equal(view * 1, want)  # read every byte: unmapped, this was a SIGSEGV
    view += 1  # and written
    assert torch.equal(view, want + 1)


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation:UserWarning")
def test_a_quantized_tensor_is_refused_not_sent_as_raw_integers(pair):
    writer, reader = pair
    q = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
    with pytest.raises(RuntimeError):
        _send(writer, reader, [q])


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


def test_a_message_that_fills_its_slot_exactly_goes_back_too(pair):
    writer, reader = pair
    name, got = _send(writer, reader, [torch.ones(shm.MIN_SLOT // 4)])  # every byte of the smallest slot
    assert got[0][2].sum().item() == shm.MIN_SLOT // 4
    assert reader.reap() == {}
    del got
    assert reader.reap() == {0: [name]}


def _mapped_bytes(reader) -> int:
    return sum(s.size for s in reader._maps.values())


def test_a_small_message_takes_a_small_slot(pair):
    """A slot's pages are committed when it is made: a consumer holding many small messages (token
    ids until its backward) must not hold a megabyte each."""
    writer, reader = pair
    name, _ = _send(writer, reader, [torch.ones(100)])
    assert os.path.getsize(os.path.join(shm.SHM_DIR, name)) == shm.MIN_SLOT == 64 << 10


def test_slots_the_sender_removes_are_unmapped_by_the_receiver(pair, monkeypatch):
    """Spare slots over the sender's limits are removed; the receiver's mappings of them go at its
    next sweep (before, they stayed mapped and their memory the host's for good)."""
    writer, reader = pair
    monkeypatch.setattr(writer, "spare", 2)
    held = [_send(writer, reader, [torch.ones(100)]) for _ in range(6)]  # six slots, all in use
    names = [n for n, _ in held]
    del held
    done = reader.reap()
    assert sorted(done[0]) == sorted(names)
    writer.released(1, names)  # two kept as spares, four removed
    assert len(reader._maps) == 6
    monkeypatch.setattr(reader, "sweep_s", 0.0)
    reader.reap()
    assert sorted(reader._maps) == sorted(n for n in names if os.path.exists(os.path.join(shm.SHM_DIR, n)))
    assert len(reader._maps) == 2 and _mapped_bytes(reader) == 2 * shm.MIN_SLOT


def test_a_dropped_channel_gives_its_slots_back_to_the_host(pair):
    """A channel gone to its process group (no slot could be made) removes its spare slots at
    once and each slot still in use when it comes back."""
    writer, reader = pair
    first, _ = _send(writer, reader, [torch.ones(100)])
    writer.released(1, [first])  # a spare now
    second, got = _send(writer, reader, [torch.ones(40_000)])  # a bigger slot: the spare does not fit
    writer.drop((1, "fwd"))
    assert not os.path.exists(os.path.join(shm.SHM_DIR, first))
    assert os.path.exists(os.path.join(shm.SHM_DIR, second))  # still read by the receiver
    del got
    assert reader.reap() == {0: [second]}
    writer.released(1, [second])
    assert not os.path.exists(os.path.join(shm.SHM_DIR, second))


def test_the_header_threads_unmapping_and_the_sweep_never_take_one_slot_twice(pair, monkeypatch):
    """read() unmaps idle slots once MAX_MAPPED are mapped (header thread) while reap() sweeps
    removed ones (compute thread): both under the reader's lock, so neither finds a slot gone
    (a KeyError killed the header thread in about 1 round in 20 before)."""
    import sys
    import threading

    writer, reader = pair
    monkeypatch.setattr(writer, "spare", 0)  # every released slot is removed by its sender
    monkeypatch.setattr(reader, "sweep_s", 0.0)
    monkeypatch.setattr(reader, "max_mapped", 16)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(40):
            held = [_send(writer, reader, [torch.ones(10)]) for _ in range(16)]
            names = [n for n, _ in held]
            del held
            assert sorted(reader.reap()[0]) == sorted(names)
            writer.released(1, names)  # removed by the sender, still mapped here
            go = threading.Barrier(2)

            def sweeping(go=go):
                go.wait()
                reader.reap()

            t = threading.Thread(target=sweeping)
            t.start()
            go.wait()
            name, got = _send(writer, reader, [torch.ones(10)])  # a new slot: read() unmaps the idle ones
            t.join()
            del got
            reader.reap()
            writer.released(1, [name])
    finally:
        sys.setswitchinterval(interval)
