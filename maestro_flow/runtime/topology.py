"""Which tensor channels and process groups a placement needs.

`channels` is pure: every (producer rank, consumer rank, kind) pair the routing rule allows,
in one deterministic order; `shm_channels` (pure) picks those between CPU workers that share
memory (transport/shm.py), which send through shared memory and fall back on their group only
where a slot cannot be made, and `ipc_channels` (pure) those between workers on one GPU of one
host (transport/cuda_ipc.py), likewise through CUDA IPC (`shm_enabled` and `ipc_enabled` read
the environment switches that turn either off). `process_groups` runs in every worker after init_process_group.
The channels of an edge share one group per direction and backend (every rank of the edge's
channels): gloo pairs inside a group are independent connections, and
NCCL gives each pair of a group its own communicator for point-to-point operations, so one slow
pair never holds another up; a direction has its own group so that the forward and backward
streams of a pair never queue behind each other on NCCL's stream. So the groups grow with the
edges and sections, not with the channels (each new_group is a collective over the whole
world: it is what startup pays per group). Every section gets a gloo group of its ranks
(checkpoints are written over it with torch.distributed.checkpoint), tensor-parallel replicas
their compute and relay groups, and sections that reduce gradients or shard a DP group per
tensor-parallel index (see `process_groups`). Every rank creates every group in the same order
and keeps those it belongs to. Channels join replica leaders: a tensor-parallel replica talks to
other sections through its leader.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.plan import Placement
from maestro_flow.timeouts import env_flag

Channel = tuple[int, int, str]  # (sending rank, receiving rank, "fwd" | "bwd")


def channels(graph: SectionGraph, placement: Placement) -> list[Channel]:
    return [ch for _, ch in _indexed(graph, placement)]


def _indexed(graph: SectionGraph, placement: Placement) -> list[tuple[int, Channel]]:
    out: list[tuple[int, Channel]] = []
    for e in graph.edges:
        for p in range(e.src_dp):
            for c in e.consumers_of(p):
                src, dst = placement.rank(e.edge.src, p), placement.rank(e.edge.dst, c)
                out.append((e.index, (src, dst, "fwd")))
                if e.carries_grad:
                    out.append((e.index, (dst, src, "bwd")))
    return out


def shm_enabled() -> bool:
    """Whether same-host CPU channels use shared memory (MAESTRO_SHM=0: gloo instead), read per run."""
    return env_flag("MAESTRO_SHM")


def ipc_enabled() -> bool:
    """Whether ranks sharing a GPU use CUDA IPC (MAESTRO_CUDA_IPC=0: gloo through the host instead)."""
    return env_flag("MAESTRO_CUDA_IPC")


def shm_channels(graph: SectionGraph, placement: Placement, hosts: dict[int, str | None]) -> list[Channel]:
    """The channels whose two ranks are CPU workers sharing memory (`hosts`: each rank's
    transport.shm.host_key, None where it has none)."""
    return [ch for ch in channels(graph, placement)
            if placement.devices[ch[0]] == "cpu" and placement.devices[ch[1]] == "cpu"
            and hosts.get(ch[0]) is not None and hosts.get(ch[0]) == hosts.get(ch[1])]


def ipc_channels(graph: SectionGraph, placement: Placement, hosts: dict[int, str | None]) -> list[Channel]:
    """The channels whose two ranks share one GPU of one host (transport/cuda_ipc.py): NCCL refuses
    two ranks on one device, so these go through CUDA IPC (`hosts` as for shm_channels)."""
    return [ch for ch in channels(graph, placement)
            if placement.devices[ch[0]].startswith("cuda") and placement.devices[ch[0]] == placement.devices[ch[1]]
            and hosts.get(ch[0]) is not None and hosts.get(ch[0]) == hosts.get(ch[1])]


@dataclass(frozen=True, slots=True)
class Groups:
    """The process groups one rank belongs to."""

    channels: dict[Channel, Any]
    section: Any  # gloo, every rank of this rank's section
    dp: Any | None  # the gradient reduction's group: the replicas at this rank's tp index (None: none)
    tp: Any | None = None  # this rank's replica, when it is a tensor-parallel group (compute collectives)
    relay: Any | None = None  # the same ranks again: the leader broadcasts the replica's inputs over it


def process_groups(graph: SectionGraph, placement: Placement, rank: int, timeout_s: float,
                   checkpoint_timeout_s: float | None = None) -> Groups:
    """`checkpoint_timeout_s`: the section groups' timeout (checkpoints are written over them), at
    least `timeout_s`.

    Per section, in this order on every rank: its gloo group (all its ranks); for tp > 1, per
    replica, a tensor-parallel group and a relay group of the replica's ranks; per tp index, the
    group of the replicas' ranks at that index (gradient reduction and FSDP's dp mesh dimension),
    when the section reduces gradients, shards with FSDP or needs a 2-D mesh."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)

    def backend(ranks: list[int]) -> str:
        # NCCL needs every rank on its own GPU; otherwise gloo (CUDA tensors staged through the host).
        devices = [placement.devices[r] for r in ranks]
        on_cuda = all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices)
        return "nccl" if on_cuda else "gloo"

    mine: dict[Channel, Any] = {}
    by_group: dict[tuple[int, str, str], list[Channel]] = {}  # (edge, kind, backend) -> its channels
    for edge_index, ch in _indexed(graph, placement):
        by_group.setdefault((edge_index, ch[2], backend(sorted(ch[:2]))), []).append(ch)
    for (_, _, kind), chs in by_group.items():
        ranks = sorted({r for ch in chs for r in ch[:2]})
        group = dist.new_group(ranks, timeout=timeout, backend=kind)
        for ch in chs:
            if rank in ch[:2]:
                mine[ch] = group
    found: dict[str, Any] = {"section": None, "dp": None, "tp": None, "relay": None}
    for name in graph.order:
        section = graph.sections[name]
        ranks = placement.section_ranks(name)
        group = dist.new_group(ranks, timeout=timedelta(seconds=max(timeout_s, checkpoint_timeout_s or 0.0)),
                               backend="gloo")
        if rank in ranks:
            found["section"] = group
        tp = placement.tp(name)
        if tp > 1:
            for leader in placement.ranks[name]:
                members = list(placement.group(leader))
                tp_group = dist.new_group(members, timeout=timeout, backend=backend(members))
                relay = dist.new_group(members, timeout=timeout, backend=backend(members))
                if rank in members:
                    found["tp"], found["relay"] = tp_group, relay
        reduces = (section.trainable and section.dp > 1) or section.fsdp or tp > 1
        if not reduces:
            continue
        for t in range(tp):
            column = [placement.group(leader)[t] for leader in placement.ranks[name]]
            if tp == 1 and backend(column) == "gloo":
                dp_group = group  # the section group itself: no need for another
            else:
                dp_group = dist.new_group(column, timeout=timeout, backend=backend(column))
            if rank in column:
                found["dp"] = dp_group
    return Groups(channels=mine, **found)
