"""One section's parallel layout, applied to its built stage: mesh, tensor parallelism, FSDP.

Runs in a worker after torch.distributed is up and the process groups exist (runtime/topology),
and before the optimizer is built (it must see the sharded parameters). The section's ranks form
a (dp, tp) grid, replica-major; its DeviceMesh wraps the groups that already exist
(`DeviceMesh.from_group`: no collective). Then, unless the stage overrides `parallelize(mesh)`
(full control), the stage's `tp_plan` shards its modules over the "tp" dimension
(parallel/tp.py) and, with `fsdp=True`, FSDP2 shards them over "dp" (parallel/fsdp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from maestro_flow.parallel.fsdp import FSDPSection
from maestro_flow.parallel.tp import apply_plan


@dataclass
class Layout:
    """What the runtime needs to know of a rank's place in its section."""

    replica: int
    tp_index: int  # 0: the replica's leader (it talks to other sections)
    members: tuple[int, ...]  # the replica's ranks, leader first
    fsdp: FSDPSection | None = None
    mesh: Any = None

    @property
    def leader(self) -> bool:
        return self.tp_index == 0

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this rank counts `param` in the global gradient norm: every value of every
        parameter is counted once, on the first rank of each dimension it is replicated over."""
        from torch.distributed.tensor import DTensor

        if not isinstance(param, DTensor):
            return self.replica == 0 and self.tp_index == 0
        mesh = param.device_mesh
        for dim, placement in enumerate(param.placements):
            if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
                return False
        dims = mesh.mesh_dim_names or ()
        return ("dp" in dims or self.replica == 0) and ("tp" in dims or self.tp_index == 0)


def section_mesh(placement: Any, section: str, dp_group: Any, tp_group: Any, device: torch.device) -> Any:
    """The section's DeviceMesh over the groups the worker already created."""
    from torch.distributed.device_mesh import DeviceMesh

    dp, tp = placement.dp(section), placement.tp(section)
    grid = torch.tensor(placement.section_ranks(section)).view(dp, tp)
    if tp == 1:
        return DeviceMesh.from_group(dp_group, device.type, mesh=grid[:, 0], mesh_dim_names=("dp",))
    return DeviceMesh.from_group([dp_group, tp_group], device.type, mesh=grid, mesh_dim_names=("dp", "tp"))


def parallelize_section(stage: Any, section: Any, placement: Any, rank: int, groups: Any,
                        device: torch.device, per_micro_batch: bool = False) -> Layout:
    """`per_micro_batch`: FSDP gathers each unit for its forward only (SectionGraph.lockstep)."""
    from maestro_flow.stage import Stage

    name, replica = placement.who(rank)
    layout = Layout(replica=replica, tp_index=placement.tp_index(rank),
                    members=placement.group(placement.rank(name, replica)))
    if section.tp == 1 and not section.fsdp:
        return layout
    layout.mesh = mesh = section_mesh(placement, name, groups.dp, groups.tp, device)
    if type(stage).parallelize is not Stage.parallelize:
        stage.parallelize(mesh)  # full control; the FSDP units it made are driven per step below
        units = _fsdp_modules(stage)
        if units:
            layout.fsdp = FSDPSection(stage, None, groups.dp, units=units, per_micro_batch=per_micro_batch)
            _check_all_sharded(stage, layout.fsdp, name, placement.dp(name))
        return layout
    if section.tp > 1:
        apply_plan(stage, type(stage).tp_plan(dict(section.config)), mesh["tp"])
    if section.fsdp:
        layout.fsdp = FSDPSection(stage, mesh["dp"], groups.dp, per_micro_batch=per_micro_batch)
    return layout


def _check_all_sharded(stage: Any, fsdp: FSDPSection, section: str, dp: int) -> None:
    """A stage's own parallelize that shards some modules must shard every trainable parameter:
    the section then sums gradients through FSDP alone, so one left out would never be summed
    over the replicas (they would train apart)."""
    from maestro_flow.errors import PipelineError

    if dp == 1:
        return
    managed = {id(fp.sharded_param) for unit in fsdp.units for group in fsdp._groups(unit) for fp in group.fsdp_params}
    left = [name for name, p in stage.named_parameters() if p.requires_grad and id(p) not in managed]
    if left:
        raise PipelineError(
            f"sections.{section}.stage: {type(stage).__module__}:{type(stage).__name__}.parallelize(mesh) shards some "
            f"modules with fully_shard but leaves {len(left)} trainable parameters outside every FSDP unit (e.g. "
            f"{', '.join(left[:3])}): their gradients would never be summed over the section's {dp} replicas. "
            f"Also fully_shard the module that holds them (the stage's top module, after its blocks)")


def _fsdp_modules(stage: Any) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    found = [m for top in stage.modules().values() for m in top.modules() if isinstance(m, FSDPModule)]
    return found[::-1]  # modules() lists parents first; FSDPSection wants children first
