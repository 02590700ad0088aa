"""Which tensor channels and process groups a placement needs.

`channels` is pure: every (producer rank, consumer rank, kind) pair the routing rule allows,
in one deterministic order. `process_groups` runs in every worker after init_process_group:
each channel gets its own two-rank group, so matched sends and receives of one channel never
queue behind another's (NCCL executes a communicator's operations in order); every section gets
a gloo group of its ranks (checkpoints are written over it with torch.distributed.checkpoint),
and each trainable section with dp > 1 reduces its gradients over a DP group (that same group on
CPU, an NCCL group of the same ranks on CUDA). new_group is collective over the world, so every
rank creates every group in the same order and keeps those it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.plan import Placement

Channel = tuple[int, int, str]  # (sending rank, receiving rank, "fwd" | "bwd")


def channels(graph: SectionGraph, placement: Placement) -> list[Channel]:
    out: list[Channel] = []
    for e in graph.edges:
        for p in range(e.src_dp):
            for c in e.consumers_of(p):
                src, dst = placement.rank(e.edge.src, p), placement.rank(e.edge.dst, c)
                out.append((src, dst, "fwd"))
                if e.carries_grad:
                    out.append((dst, src, "bwd"))
    return out


@dataclass(frozen=True, slots=True)
class Groups:
    """The process groups one rank belongs to."""

    channels: dict[Channel, Any]
    section: Any  # gloo, every rank of this rank's section
    dp: Any | None  # the gradient reduction's group (None: nothing to reduce)


def process_groups(graph: SectionGraph, placement: Placement, rank: int, timeout_s: float,
                   checkpoint_timeout_s: float | None = None) -> Groups:
    """`checkpoint_timeout_s`: the section groups' timeout (checkpoints are written over them), at
    least `timeout_s`."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)

    def backend(ranks: list[int]) -> str:
        on_cuda = all(placement.devices[r].startswith("cuda") for r in ranks)
        return "nccl" if on_cuda else "gloo"

    mine: dict[Channel, Any] = {}
    for ch in channels(graph, placement):
        pair = sorted(ch[:2])
        group = dist.new_group(pair, timeout=timeout, backend=backend(pair))
        if rank in pair:
            mine[ch] = group
    section_group = dp_group = None
    for name in graph.order:
        ranks = list(placement.ranks[name])
        group = dist.new_group(ranks, timeout=timedelta(seconds=max(timeout_s, checkpoint_timeout_s or 0.0)),
                               backend="gloo")
        reduce = group
        if graph.sections[name].trainable and len(ranks) > 1 and backend(ranks) != "gloo":
            reduce = dist.new_group(ranks, timeout=timeout, backend=backend(ranks))
        if rank in ranks:
            section_group = group
            dp_group = reduce if graph.sections[name].trainable and len(ranks) > 1 else None
    return Groups(channels=mine, section=section_group, dp=dp_group)
