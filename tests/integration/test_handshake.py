"""The startup handshake refuses a worker that speaks another protocol version, and leaks nothing."""

from __future__ import annotations

import os

import pytest
import zmq

from maestro_flow.errors import SystemFailure
from maestro_flow.graph import SectionGraph
from maestro_flow.protocol.auth import Sealer, derive_key
from maestro_flow.protocol.messages import PROTOCOL_VERSION, make
from maestro_flow.runtime.coordinator import Coordinator
from maestro_flow.runtime.report import RunReport
from maestro_flow.runtime.sampler import EpochSampler
from maestro_flow.samples import SampleMeta
from maestro_flow.timeouts import Timeouts
from maestro_flow.transport import zmq_link
from tests.integration.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def impostor(boot: dict) -> None:
    """Says hello (sealed, as a worker of this run) with a wrong protocol version, then waits."""
    ctx = zmq.Context()
    sock = zmq_link.connect(ctx, zmq.DEALER, boot["coordinator"])
    sealer = Sealer(derive_key(bytes.fromhex(boot["secret"]), boot["session"]), f"rank{boot['rank']}", "coordinator")
    zmq_link.send_msg(sock, make("hello", version=PROTOCOL_VERSION + 41, rank=boot["rank"], pid=os.getpid(),
                                 data_addr="tcp://127.0.0.1:1"), sealer=sealer)
    sock.poll(30_000)


def test_wrong_protocol_version_is_refused():
    from maestro_flow.runtime.build import load_pipeline

    pipeline, paths = load_pipeline(str(ROOT / "pipelines" / "distill.py"))
    sampler = EpochSampler([SampleMeta(id=i, row=i) for i in range(32)], pipeline.global_batch, 0)
    coordinator = Coordinator(pipeline, SectionGraph(pipeline), sampler,
                              RunReport(total_steps=1, metrics_out=None, show_progress=False),
                              paths=paths, timeouts=Timeouts(startup_s=30), worker_entry=impostor)
    with pytest.raises(SystemFailure, match=f"protocol version {PROTOCOL_VERSION + 41}"):
        coordinator.run()
