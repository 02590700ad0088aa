"""CUDA IPC between two workers on one GPU (transport/cuda_ipc.py), over the transport tests'
contract: every message arrives once, in order, with the same names, dtypes, shapes and values;
both directions at once (the receiver waiting on the device or on the host); device slots reused once the receiver drops its views; a receiver
holding every message never blocks its sender.

Skipped without CUDA (CI has no GPU). One GPU is enough: both ranks share cuda:0.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_transport import check_contract, run_world
from tests.integration.transport_peers import messages

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("wait", ["device", "host"])
def test_both_directions_at_once_through_cuda_ipc(wait, monkeypatch):
    monkeypatch.setenv("MAESTRO_CUDA_IPC_WAIT", wait)  # read by each rank's TensorComm
    plan = [(0, 1, "fwd"), (1, 0, "bwd")]
    out = run_world(2, plan, path="ipc")
    for _, _, errors, _ in out.values():
        assert not errors, errors
    check_contract({r: received for r, (_, received, _, _) in out.items()}, plan)
    assert all(1 <= slots <= len(messages(0)) for *_, slots in out.values()), out


def test_cuda_ipc_slots_are_reused():
    plan = [(0, 1, "fwd")]
    out = run_world(2, plan, path="ipc", pace_s=0.1)
    check_contract({1: out[1][1]}, plan)
    assert 1 <= out[0][3] <= 2, out[0][3]


def test_a_receiver_holding_every_cuda_message_never_blocks_its_sender():
    plan = [(0, 1, "fwd")]
    out = run_world(2, plan, path="ipc", hold=True)
    assert not out[0][2] and not out[1][2]
    check_contract({1: out[1][1]}, plan)
    assert out[0][3] == len(messages(0))
