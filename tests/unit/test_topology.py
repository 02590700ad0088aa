"""Which tensor channels go through shared memory and which through CUDA IPC (runtime/topology.py):
pure choices from the placement's devices and each rank's host."""

from __future__ import annotations

from maestro_flow import ArrowData, Edge, Pipeline, Section
from maestro_flow.graph import SectionGraph
from maestro_flow.planner.plan import Placement
from maestro_flow.runtime.topology import channels, ipc_channels, shm_channels

GRAPH = SectionGraph(Pipeline(
    name="vlm", data=ArrowData(path="unused.arrow"),
    sections=[Section(name="vision", stage="stages.vision:VisionEncoder", activates_on="image", dp=1, micro_batch=2),
              Section(name="llm", stage="stages.multimodal:MultimodalLM", dp=2, micro_batch=2)],
    edges=[Edge(src="vision", dst="llm", tensors=("image_embeds",))]))


def test_ranks_sharing_one_gpu_of_one_host_talk_through_cuda_ipc():
    """vision on cuda:0 (rank 0) -> llm on cuda:0 and cuda:1 (ranks 1, 2), all on one host: only
    the pair on cuda:0 shares a device (both directions: the encoder trains); the other pair
    has NCCL. Nothing goes through host shared memory."""
    placement = Placement.build(GRAPH.order, {"vision": 1, "llm": 2},
                                devices={"vision": ["cuda:0"], "llm": ["cuda:0", "cuda:1"]})
    hosts = {0: "h", 1: "h", 2: "h"}
    assert ipc_channels(GRAPH, placement, hosts) == [(0, 1, "fwd"), (1, 0, "bwd")]
    assert shm_channels(GRAPH, placement, hosts) == []


def test_cuda_ipc_needs_one_host_and_cpu_sections_use_shared_memory():
    gpus = Placement.build(GRAPH.order, {"vision": 1, "llm": 2}, devices={"vision": ["cuda:0"],
                                                                         "llm": ["cuda:0", "cuda:0"]})
    assert ipc_channels(GRAPH, gpus, {0: "a", 1: "b", 2: "a"}) == [(0, 2, "fwd"), (2, 0, "bwd")]
    assert ipc_channels(GRAPH, gpus, {0: None, 1: None, 2: None}) == []  # no host key: nothing shared
    cpus = Placement.build(GRAPH.order, {"vision": 1, "llm": 2})
    hosts = {0: "h", 1: "h", 2: "h"}
    assert ipc_channels(GRAPH, cpus, hosts) == []
    assert shm_channels(GRAPH, cpus, hosts) == channels(GRAPH, cpus)


class _SlowEvent:
    """A stand-in for a CUDA interprocess event: done after `polls` queries (never, with None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.queried = polls, 0

    def query(self) -> bool:
        self.queried += 1
        return self.polls is not None and self.queried > self.polls

    def wait(self, stream) -> None:
        raise AssertionError("a host wait must not make a stream wait")


def test_a_host_wait_polls_the_senders_event_within_the_timeout(monkeypatch):
    """MAESTRO_CUDA_IPC_WAIT=host (transport/cuda_ipc.py): the header thread polls the sender's
    event until its copy is done, and gives up with an error naming the setting when it never is."""
    import types

    import pytest
    import torch

    from maestro_flow.transport import cuda_ipc

    monkeypatch.setenv("MAESTRO_CUDA_IPC_WAIT", "host")
    reader = cuda_ipc.IpcReader(torch.device("cpu"), cuda_ipc.wait_mode(), timeout_s=0.2)
    monkeypatch.setattr(reader, "read", lambda src, name, offsets, specs: ["views"])
    done_later = _SlowEvent(polls=3)
    reader._maps["ipc-0-1"] = types.SimpleNamespace(event=done_later)
    assert reader.read_ipc(0, "ipc-0-1", [0], [["float32", 1]], None) == ["views"]
    assert done_later.queried == 4
    reader._maps["ipc-0-2"] = types.SimpleNamespace(event=_SlowEvent(polls=None))
    with pytest.raises(TimeoutError, match="rank 0's copy into CUDA IPC slot ipc-0-2.*MAESTRO_COLLECTIVE_S"):
        reader.read_ipc(0, "ipc-0-2", [0], [["float32", 1]], None)
    monkeypatch.setenv("MAESTRO_CUDA_IPC_WAIT", "never")
    with pytest.raises(ValueError, match="use one of device, host"):
        cuda_ipc.wait_mode()
    monkeypatch.setenv("MAESTRO_CUDA_IPC_WAIT", "")  # empty is unset, as every MAESTRO_* (found in review)
    assert cuda_ipc.wait_mode() == "device"
