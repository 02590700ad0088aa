"""Packing per-sample tensors into transfer buffers, and the receive-buffer pool (no processes)."""

from __future__ import annotations

import pytest
import torch

from maestro_flow.transport import p2p


def test_pack_unpack_round_trip_coalesces_small_tensors():
    big = torch.randn(300_000)  # > 1 MiB: sent as it is
    items = [(1, "a", torch.randn(3, 4)), (1, "b", torch.arange(5)), (2, "a", torch.randn(2, 4)),
             (2, "none", None), (3, "big", big), (3, "empty", torch.empty(0, 7))]
    entries, specs, buffers = p2p.pack(items)
    assert len(buffers) == 3  # float32 small ones, int64 small ones, the big one
    assert any(b.data_ptr() == big.data_ptr() for b in buffers)  # no copy of the big tensor
    received = p2p.allocate(specs, torch.device("cpu"))
    for dst, src in zip(received, buffers, strict=True):
        dst.copy_(src)
    out = p2p.unpack(entries, received)
    for (sid, name, t), (sid2, name2, t2) in zip(items, out, strict=True):
        assert (sid, name) == (sid2, name2)
        assert (t is None and t2 is None) or torch.equal(t, t2)


def test_pool_reuses_a_buffer_only_once_nothing_refers_to_it():
    pool = p2p.BufferPool()
    first = pool.take(torch.float32, 1 << 20, torch.device("cpu"))
    second = pool.take(torch.float32, 1 << 20, torch.device("cpu"))
    assert first.data_ptr() != second.data_ptr()  # the first is still in use
    sample = first[10:20]  # a delivered per-sample tensor keeps the buffer busy
    del first
    third = pool.take(torch.float32, 1 << 20, torch.device("cpu"))
    assert third.data_ptr() not in (sample.data_ptr() - 40, second.data_ptr())
    del sample, third
    again = pool.take(torch.float32, 1 << 20, torch.device("cpu"))
    assert again.data_ptr() in {b.data_ptr() for b in pool._free[(torch.float32, 1 << 20, torch.device("cpu"))]}


def test_pool_does_not_keep_small_buffers():
    pool = p2p.BufferPool()
    pool.take(torch.float32, 16, torch.device("cpu"))
    assert not pool._free


def test_a_header_naming_no_dtype_or_a_bad_count_is_refused():
    # A header names dtypes and element counts as strings and numbers: only torch dtypes and
    # non-negative integers are taken (getattr(torch, name) would reach any attribute).
    for specs in ([["manual_seed", 4]], [["float32", -1]], [["float32", 2.5]], [[["float32"], 4]]):
        with pytest.raises(ValueError):
            p2p.allocate(specs, torch.device("cpu"))
    assert p2p.allocate([["bfloat16", 3]], torch.device("cpu"))[0].dtype == torch.bfloat16


def test_big_tensors_that_are_not_plain_bytes_are_packed_as_their_values():
    """A process group sends bytes: a lazy conjugate or an efficient zero tensor of 1 MiB or more
    is packed as its values (before, isend raised in the sending thread after the header went,
    and the receiver waited for a transfer that never came)."""
    conj = torch.randn(150_000, dtype=torch.complex64).conj()
    zero = torch._efficientzerotensor((300_000,), dtype=torch.float32)
    neg = torch.randn(150_000, dtype=torch.complex64).conj().imag  # a lazy negation
    assert conj.is_conj() and zero._is_zerotensor() and neg.is_neg()
    entries, specs, buffers = p2p.pack([(0, "conj", conj), (0, "zero", zero), (0, "neg", neg)])
    assert not any(b.is_conj() or b.is_neg() or b._is_zerotensor() or not b.is_contiguous() for b in buffers)
    out = p2p.unpack(entries, buffers)
    assert torch.equal(out[0][2], conj.resolve_conj()) and torch.equal(out[1][2], torch.zeros(300_000))
    assert torch.equal(out[2][2], neg.resolve_neg())


def test_colocated_delivery_is_contiguous_as_every_transfer_is():
    """Colocated mode is section mode's oracle: a stage that views its input must work in both.
    Process groups and shared memory deliver contiguous tensors; so does LocalComm."""
    from maestro_flow.transport.local_comm import LocalComm

    got = []
    comm = LocalComm(0, lambda dst: lambda kind, edge, step, src, items: got.extend(items))
    sent = torch.arange(12.0).reshape(3, 4).t()
    comm.send(1, "fwd", 0, 0, [(0, "x", sent)])
    assert got[0][2].is_contiguous() and torch.equal(got[0][2], sent)
    assert got[0][2].view(-1).shape == (12,)
