"""Two gloo ranks gathering DTensors the way --save-dir does (checkpoint/savedir._full_tensor),
spawned by test_parallel.py: a 1-D mesh without dimension names, a 2-D mesh and its sub-mesh,
uneven shards."""

from __future__ import annotations

import torch
import torch.distributed as dist


def peer(rank: int, store: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from maestro_flow.checkpoint.savedir import _full_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        whole = torch.arange(7 * 3, dtype=torch.float64).reshape(7, 3)  # 7 rows over 2 ranks: uneven
        flat = DeviceMesh.from_group(dist.group.WORLD, "cpu")  # no dimension names
        dp = dist.new_group([0, 1])
        tp = [dist.new_group([r]) for r in range(2)]  # every rank creates every group, in one order
        square = DeviceMesh.from_group([dp, tp[rank]], "cpu", mesh=[[0], [1]], mesh_dim_names=("dp", "tp"))
        hosts: dict = {}
        out = {"flat": _full_tensor(distribute_tensor(whole, flat, [Shard(0)]), hosts),
               "2d": _full_tensor(distribute_tensor(whole, square, [Shard(0), Shard(1)]), hosts),
               "sub": _full_tensor(distribute_tensor(whole, square["dp"], [Shard(1)]), hosts)}
        return {k: v.tolist() for k, v in out.items()} | {"whole": whole.tolist(), "hosts": len(hosts)}
    finally:
        dist.destroy_process_group()
