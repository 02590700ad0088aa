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
