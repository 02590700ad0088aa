"""TensorComm's sender when a CUDA IPC slot cannot be had (no GPU needed: the writer's failure is
injected): a refusal moves the channel to the host path, any other error is the run's to report."""

from __future__ import annotations

import pytest
import torch
import zmq

from maestro_flow.protocol.auth import derive_key
from maestro_flow.transport import cuda_ipc, zmq_link
from maestro_flow.transport.tensor_comm import TensorComm


@pytest.fixture
def comm():
    ctx = zmq.Context()
    pull, addr = zmq_link.bind(ctx, zmq.PULL)
    errors: list[str] = []
    c = TensorComm(zctx=ctx, rank=0, pull=pull, key=derive_key(b"k" * 16, "s"), peers={0: addr, 1: addr}, groups={},
                   device=torch.device("cpu"), deliver=lambda *a: None, on_error=errors.append, ipc=[(0, 1, "fwd")])
    yield c
    c.close(timeout_s=2.0)
    ctx.destroy(linger=0)
    assert not errors


def _failing(exc: Exception):
    def write(channel, buffers):
        raise exc
    return write


def test_a_refused_ipc_slot_moves_the_channel_to_the_host_path(comm, capsys):
    comm._ipc_slots.write = _failing(cuda_ipc.IpcRefused("operation not supported"))
    assert comm._send_slot(1, "fwd", 0, 0, [(0, "x", torch.ones(2))], ipc=True) is False
    assert (1, "fwd") not in comm._ipc_out
    assert "CUDA IPC failed (operation not supported); fwd tensors to rank 1 go through gloo" in capsys.readouterr().out


def test_a_cuda_error_in_the_copy_is_not_taken_for_a_refusal(comm):
    # Suspected in review: any RuntimeError (a pending asynchronous CUDA error surfacing in the
    # copy) sent the channel to gloo with "CUDA IPC failed", and the real error came up elsewhere.
    comm._ipc_slots.write = _failing(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        comm._send_slot(1, "fwd", 0, 0, [(0, "x", torch.ones(2))], ipc=True)
    assert (1, "fwd") in comm._ipc_out
