"""Two gloo ranks applying a tp plan whose entries name a stage's attributes themselves (top-level
nn.Linear and nn.Embedding modules), spawned by test_parallel.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class TopLevel:
    """A stage-shaped object whose layers are its attributes (Stage.modules() by attribute)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, dtype=torch.float64)
        self.up, self.down = nn.Linear(4, 6, dtype=torch.float64), nn.Linear(6, 4, dtype=torch.float64)

    def modules(self) -> dict[str, nn.Module]:
        return {"emb": self.emb, "up": self.up, "down": self.down}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(ids))))


def peer(rank: int, store: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from maestro_flow.parallel.tp import apply_plan

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        ids = torch.tensor([[1, 2, 3], [9, 0, 4]])
        whole = TopLevel()
        expected = whole(ids)
        stage = TopLevel()
        apply_plan(stage, {"emb": "rowwise", "up": "colwise", "down": "rowwise"},
                   DeviceMesh.from_group(dist.group.WORLD, "cpu"))
        got = stage(ids)
        # An embedding rowwise: its rows sharded, the ids whole (found in review: gathered into tp x
        # the sequence, (2, 6, 4) here, which a causal model's first positions hid)
        return {"sharded": [isinstance(m.weight, DTensor) for m in (stage.emb, stage.up, stage.down)],
                "emb_rows": stage.emb.weight.to_local().shape[0], "shape": list(got.shape),
                "local_rows": stage.up.weight.to_local().shape[0],
                "diff": (got.full_tensor() if isinstance(got, DTensor) else got).sub(expected).abs().max().item()}
    finally:
        dist.destroy_process_group()
