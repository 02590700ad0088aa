"""Two gloo ranks driving FSDPSection directly (spawned by test_parallel.py): a lockstep section's
reduce-scattered gradient sums and gradient presence, against the same model unsharded."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use: str) -> torch.Tensor:
        x = self.a(x)  # `extra`: used by one replica; `never`: by a stand-in round only
        return self.extra(x) if use == "extra" else self.never(x) if use == "never" else x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use: str) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, use)
        return self.head(x).sum()


class Stage:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Model().double()

    def modules(self) -> dict[str, nn.Module]:
        return {"model": self.model}


def peer(rank: int, store: str, legacy: bool = False) -> dict:
    """`legacy`: as on a torch without FSDP2's set_reduce_scatter_unused_params (FSDPSection's
    own zeros for unused parameters)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    if legacy and hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        del FSDPModule.set_reduce_scatter_unused_params  # this spawned process only

    from maestro_flow.parallel.fsdp import FSDPSection

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)  # no port to race for
    try:
        stage = Stage()
        full = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh=torch.arange(2), mesh_dim_names=("dp",))
        fsdp = FSDPSection(stage, mesh["dp"], dist.group.WORLD, per_micro_batch=True)
        fsdp.begin_step()
        # Rank 0 runs two micro-batches, the second one using `extra`; rank 1 one micro-batch
        # without it, then a stand-in round (counted as no one's gradient).
        torch.manual_seed(1 + rank)
        xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
        stage.model(xs[0], "").backward()
        if rank == 0:
            stage.model(xs[1], "extra").backward()
        else:
            fsdp.counting = False  # as runtime/lockstep.py runs a stand-in round
            (stage.model(xs[0], "never") * 0.0).backward()
            fsdp.counting = True
        fsdp.reduce([])  # also checks that both ran as many unit forwards and backwards
        grads = {n: None if p.grad is None else p.grad.full_tensor().tolist() for n, p in stage.model.named_parameters()}
        # Plain lists: tensors would travel through shared memory this process is about to drop.
        return {"grads": grads, "full": {n: t.tolist() for n, t in full.items()}, "xs": [x.tolist() for x in xs]}
    finally:
        dist.destroy_process_group()
