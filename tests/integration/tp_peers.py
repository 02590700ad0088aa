"""Two gloo ranks applying a tp plan whose entries name a stage's attributes themselves (a
top-level nn.Linear), spawned by test_parallel.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class TopLevel:
    """A stage-shaped object whose layers are its attributes (Stage.modules() by attribute)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(4, 6, dtype=torch.float64), nn.Linear(6, 4, dtype=torch.float64)

    def modules(self) -> dict[str, nn.Module]:
        return {"up": self.up, "down": self.down}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def peer(rank: int, store: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from maestro_flow.parallel.tp import apply_plan

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        x = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 10
        whole = TopLevel()
        expected = whole(x)
        stage = TopLevel()
        apply_plan(stage, {"up": "colwise", "down": "rowwise"}, DeviceMesh.from_group(dist.group.WORLD, "cpu"))
        got = stage(x)
        return {"sharded": [isinstance(m.weight, DTensor) for m in (stage.up, stage.down)],
                "local_rows": stage.up.weight.to_local().shape[0],
                "diff": (got.full_tensor() if isinstance(got, DTensor) else got).sub(expected).abs().max().item()}
    finally:
        dist.destroy_process_group()
