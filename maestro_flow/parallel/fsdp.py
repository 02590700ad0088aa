"""FSDP2 over a section's data-parallel replicas, driven once per step (a frozen teacher: per micro-batch).

Runs in a worker's compute thread. `fully_shard` (torch's FSDP2) shards every parameter over the
section's dp mesh dimension: between steps each replica holds 1/dp of the parameters, gradients
and optimizer state (ZeRO-3 at rest), and checkpoints are DTensors that reshard on load.

The runtime's replicas do not run in lockstep: with data-dependent routing one replica may run
three micro-batches in a step, another one, another none, and a trainable encoder runs its
backwards when its consumers' gradients arrive. FSDP's per-forward all-gathers and per-backward
reduce-scatters would then pair up wrongly across replicas. So the collectives are tied to the
step instead of to the micro-batches, the same sequence on every replica whatever it computes:

    begin_step()        at the step's start: all-gather every unit, in unit order (public unshard)
    (forwards and backwards: no collective; gradients accumulate unsharded, no sync)
    reduce(params, ..)  a trainable section's step end: which parameters got a gradient on any
                        replica (one small all-reduce, with the loss section's sums), then FSDP's
                        own reduce-scatter of every unit, in reverse unit order, then release()
    release()           reshard (local: frees the gathered parameters)

Within a step (per-step mode) a unit's gathered parameters (and, when training, its unsharded gradients) stay
in memory: peak memory is that of the gathered section, the state at rest is 1/dp.
A parameter no replica produced a gradient for gets `grad = None` and is skipped by the
optimizer (DESIGN 4b), although the reduce-scatter includes it (as zeros) so that every replica
reduces the same tensors.

A frozen section fed only by the data (a teacher: no producer sections, no backward, tp=1)
gathers per micro-batch instead (`per_micro_batch`, see SectionGraph.lockstep), so that it holds 1/dp of its
parameters plus the unit it is running, not the whole section, and can be sharded to fit:
FSDP's own hooks gather each unit as its forward starts and free it as it ends
(reshard_after_forward). The collectives still pair up because every replica runs the same
number of forwards in a step: the coordinator sends each replica the step's `rounds` (the most
micro-batches any replica of the section runs) and a `probe` sample, and a replica with fewer
micro-batches runs the probe (outputs dropped) until it has run `rounds` forwards
(runtime/executor.py). Such a replica waits on nothing but its own data and its peers' gathers,
so it never waits on a credit from a consumer (PlanMessages drops its run-ahead gates), and no
cycle through another section can form.

Units: every element of an `nn.ModuleList` (a block), then every other module that owns
parameters directly, children before parents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from maestro_flow.parallel.memory import local_bytes


def fsdp_units(stage: Any) -> list[nn.Module]:
    """The modules `fully_shard` wraps, children before parents, in a fixed order: each element
    of an nn.ModuleList as a whole, then each other module that owns parameters directly (FSDP2
    lets a parent unit hold just its own parameters around child units)."""
    units: list[nn.Module] = []
    for top in stage.modules().values():
        blocks = {id(x) for m in top.modules() if isinstance(m, nn.ModuleList) for x in m}
        _collect(top, blocks, units)
    return units


def _collect(m: nn.Module, blocks: set[int], units: list[nn.Module]) -> None:
    if id(m) in blocks:
        units.append(m)
        return
    for child in m.children():
        _collect(child, blocks, units)
    if any(p is not None for p in m._parameters.values()):
        units.append(m)


class FSDPSection:
    def __init__(self, stage: Any, dp_mesh: Any, dp_group: Any, units: list[nn.Module] | None = None,
                 per_micro_batch: bool = False) -> None:
        """Shard the stage's units over `dp_mesh`; or, given `units` a stage already sharded with
        fully_shard (its own `parallelize`), drive those. `per_micro_batch`: gather each unit
        for its forward only (a frozen source section, SectionGraph.lockstep), else once per step."""
        from torch.distributed.fsdp import fully_shard

        self.group = dp_group
        self.per_micro_batch = per_micro_batch
        self.units = units if units is not None else fsdp_units(stage)
        for unit in self.units:
            if units is None:
                fully_shard(unit, mesh=dp_mesh, reshard_after_forward=per_micro_batch)
            unit.set_reshard_after_forward(per_micro_batch, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reduce_scatter_unused_params(True, recurse=False)
            unit.set_gradient_divide_factor(1.0)  # a sum: the runtime divides by the loss denominator
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
            if per_micro_batch:  # after FSDP's own pre-forward hook: the unit is gathered by now
                unit.register_forward_pre_hook(self._note_held)
        self.gathered = False
        self.initialized = False
        self.peak_bytes = 0  # per_micro_batch: the most parameter bytes held at once in this step

    def begin_step(self) -> None:
        """At every step's start, on every replica whatever it computes in the step."""
        self._init()
        if self.per_micro_batch:
            self.peak_bytes = local_bytes(self.sharded())
        else:
            self.gather()

    def _init(self) -> None:
        if not self.initialized:
            # What FSDP does at a root's first forward; a replica may reach its first step
            # end without one. Parents first, so that each marks its children as non-roots.
            for unit in reversed(self.units):
                unit._get_fsdp_state()._lazy_init()
            self.initialized = True

    def gather(self) -> None:
        if not self.gathered:
            self._init()
            for unit in self.units:
                unit.unshard()
            self.gathered = True

    def _note_held(self, *_: Any) -> None:
        """The shards plus every unit gathered right now (a sharded DTensor's numel is global)."""
        gathered = sum(fp.sharded_param.numel() * fp.sharded_param.element_size()
                       for u in self.units if all(g.is_unsharded for g in self._groups(u))
                       for g in self._groups(u) for fp in g.fsdp_params)
        self.peak_bytes = max(self.peak_bytes, local_bytes(self.sharded()) + gathered)

    def sharded(self) -> list[torch.Tensor]:
        """Every unit's sharded parameters (kept while the gathered ones are in use)."""
        return [fp.sharded_param for unit in self.units for group in self._groups(unit) for fp in group.fsdp_params]

    def release(self) -> None:
        for unit in self.units:
            unit.reshard()
        self.gathered = False

    def _groups(self, unit: nn.Module) -> list[Any]:
        # FSDP2 exposes no public "reduce now"; its parameter groups' post_backward is what every
        # backward runs, and is documented there as idempotent and safe without a backward.
        return list(unit._get_fsdp_state()._fsdp_param_groups)

    def reduce(self, params: Sequence[torch.nn.Parameter], extra: Sequence[float] = ()) -> list[float]:
        """The GradientReducer interface for an FSDP section: `params` are the optimizer's
        (sharded) parameters; returns `extra` summed over the replicas."""
        self.gather()  # a replica that ran nothing this step joins the same collectives
        fsdp_params = [fp for unit in self.units for group in self._groups(unit) for fp in group.fsdp_params]
        device = fsdp_params[0].sharded_param.device if fsdp_params else torch.device("cpu")
        present = [0.0 if fp.unsharded_param.grad is None else 1.0 for fp in fsdp_params]
        head = torch.tensor(present + list(extra), dtype=torch.float64, device=device)
        dist.all_reduce(head, op=dist.ReduceOp.SUM, group=self.group)
        for unit in reversed(self.units):
            unit.set_requires_gradient_sync(True, recurse=False)
            for group in reversed(self._groups(unit)):
                group.post_backward()
        for unit in self.units:
            for group in self._groups(unit):
                group.finalize_backward()
            unit.set_requires_gradient_sync(False, recurse=False)
        self.release()
        counts = head.tolist()
        for fp, count in zip(fsdp_params, counts[:len(fsdp_params)], strict=True):
            if count == 0.0:
                fp.sharded_param.grad = None
        return counts[len(fsdp_params):]
