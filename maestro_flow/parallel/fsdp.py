"""FSDP2 over a section's data-parallel replicas, driven per micro-batch (lockstep) or per step.

Runs in a worker's compute thread. `fully_shard` (torch's FSDP2) shards every parameter over the
section's dp mesh dimension: between steps each replica holds 1/dp of the parameters, gradients
and optimizer state (ZeRO-3 at rest), and checkpoints are DTensors that reshard on load.

The runtime's replicas do not run in lockstep: with data-dependent routing one replica may run
three micro-batches in a step, another one, another none, and a trainable encoder runs its
backwards when its consumers' gradients arrive. FSDP's per-forward all-gathers and per-backward
reduce-scatters would then pair up wrongly across replicas. So, but for the lockstep sections
below, the collectives are tied to the step instead of to the micro-batches, the same sequence
on every replica whatever it computes:

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

Two kinds of sections (at tp=1) run per micro-batch instead, in lockstep (`per_micro_batch`,
SectionGraph.lockstep): a frozen section fed only by the data (a teacher), and a loss section
(a student, an LLM: each forward's backward follows at once). FSDP's own hooks then gather each
unit as its forward (or backward) starts and free it as it ends, and each backward
reduce-scatters its gradients into the sharded ones, so a rank holds 1/dp of the section plus
about two units (the one it runs and FSDP's all-gather buffer of the last; training, about
five: also a prefetched unit, a unit's gradients, reduce-scatter buffers), not the whole
section: a section too large for one device is sharded to fit. The
collectives pair up because every replica runs the same number of micro-batches in a step and
the same units in each: the coordinator sends each replica the step's `rounds` (the most any
replica of the section runs), and a replica with fewer runs its last micro-batch again (or the
plan's `probe` sample, read from the data) with outputs dropped and a zero loss until it has run
`rounds` (runtime/lockstep.py; their zero gradients do not count as present). At the step's end
the replicas check that they ran as many unit forwards and backwards (`verify`): a stage that
skips modules for some micro-batches breaks the pairing, and the run stops with an error
saying so. Run-ahead credits change so that no wait closes a cycle through the gathers
(runtime/ledger.py, PlanMessages._gates): a lockstep section gives none (its producers run
ahead freely), and a lockstep teacher's round k waits only for consumer forwards that outputs of
earlier rounds feed.
Which parameters got a gradient (the presence rule) is noted in each backward, before FSDP
reduce-scatters (`_watch_backward`), and summed over the replicas at the step's end.

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


def same_counts(sums: Sequence[float], n: int) -> bool:
    """Whether n integers were all equal, from their sum and their sum of squares (one SUM
    all-reduce gives both): (sum x)^2 <= n sum x^2, with equality iff all are equal."""
    return abs(sums[0] ** 2 - n * sums[1]) < 0.5


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def fsdp_units(stage: Any) -> list[nn.Module]:
    """The modules `fully_shard` wraps, children before parents, in a fixed order: each element
    of an nn.ModuleList as a whole, then each other module that owns parameters directly (FSDP2
    lets a parent unit hold just its own parameters around child units).

    A parameter that several modules hold (tied weights: an embedding and the LM head sharing
    one matrix) must be in one unit, or FSDP2 would shard it twice and untie it: the modules
    between its holders and their lowest common ancestor are not units, and that ancestor is."""
    units: list[nn.Module] = []
    for top in stage.modules().values():
        blocks = {id(x) for m in top.modules() if isinstance(m, nn.ModuleList) for x in m}
        demote, force = _tied(top)
        _collect(top, blocks, units, demote, force)
    return units


def _tied(top: nn.Module) -> tuple[set[int], set[int]]:
    """(modules that must not be units, modules that must be) for the parameters several modules
    of `top` hold."""
    holders: dict[int, list[str]] = {}
    modules = dict(top.named_modules(remove_duplicate=False))
    for path, m in modules.items():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(path)
    demote: set[int] = set()
    force: set[int] = set()
    for paths in holders.values():
        if len(paths) < 2:
            continue
        parts = [p.split(".") if p else [] for p in paths]
        common = 0
        while all(len(x) > common for x in parts) and len({x[common] for x in parts}) == 1:
            common += 1
        force.add(id(modules[".".join(parts[0][:common])]))
        for x in parts:
            demote.update(id(modules[".".join(x[:k])]) for k in range(common + 1, len(x) + 1))
    return demote, force


def largest_unit_bytes(stage: Any) -> int:
    """The bytes of the stage's largest unit, less the units inside it: what a lockstep section
    gathers at once beside its shard (`maestro profile` writes it as unit_mb)."""
    units = fsdp_units(stage)
    ids = {id(u) for u in units}
    sizes = []
    for u in units:
        inner = {id(p) for m in u.modules() if m is not u and id(m) in ids for p in m.parameters()}
        sizes.append(sum(_nbytes(p) for p in u.parameters() if id(p) not in inner))
    return max(sizes, default=0)


def _collect(m: nn.Module, blocks: set[int], units: list[nn.Module], demote: set[int], force: set[int]) -> None:
    if id(m) in blocks and id(m) not in demote:
        units.append(m)
        return
    for child in m.children():
        _collect(child, blocks, units, demote, force)
    if id(m) in force or (id(m) not in demote and any(p is not None for p in m._parameters.values())):
        units.append(m)


class FSDPSection:
    def __init__(self, stage: Any, dp_mesh: Any, dp_group: Any, units: list[nn.Module] | None = None,
                 per_micro_batch: bool = False) -> None:
        """Shard the stage's units over `dp_mesh`; or, given `units` a stage already sharded with
        fully_shard (its own `parallelize`), drive those. `per_micro_batch`: gather each unit
        for its forward (and backward) only and reduce-scatter each micro-batch's gradients (a
        lockstep section, SectionGraph.lockstep), else gather and reduce once per step."""
        from torch.distributed.fsdp import fully_shard

        self.group = dp_group
        self.per_micro_batch = per_micro_batch
        self.units = units if units is not None else fsdp_units(stage)
        for unit in self.units:
            if units is None:
                fully_shard(unit, mesh=dp_mesh, reshard_after_forward=per_micro_batch)
            unit.set_reshard_after_forward(per_micro_batch, recurse=False)
            unit.set_reshard_after_backward(per_micro_batch, recurse=False)
            unit.set_requires_gradient_sync(per_micro_batch, recurse=False)
            self._reduce_unused_as_zeros(unit)
            unit.set_gradient_divide_factor(1.0)  # a sum: the runtime divides by the loss denominator
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
            if per_micro_batch:  # after FSDP's own pre-forward hook: the unit is gathered by now
                unit.register_forward_pre_hook(self._forward_started)
                for group in self._groups(unit):
                    self._watch_backward(group)
        self.gathered = False
        self.initialized = False
        # per_micro_batch: the parameters that got a real gradient this step (not in stand-in
        # rounds: `counting` off), the units run (forwards and backwards: every replica's count
        # must be equal, `verify`), and (parameter, gradient) bytes at the step's peak so far.
        self.present: set[int] = set()
        self.counting = True
        self.calls = 0
        self.peak = (0, 0)
        self._sizes: Any = None  # built on first use, after FSDP's lazy init (_size_up)

    def begin_step(self) -> None:
        """At every step's start, on every replica whatever it computes in the step."""
        self._init()
        if self.per_micro_batch:
            self.peak, self.calls = (0, 0), 0
            self._note_held()
        else:
            self.gather()

    def _forward_started(self, *_: Any) -> None:
        self.calls += 1
        self._note_held()

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

    def _reduce_unused_as_zeros(self, unit: nn.Module) -> None:
        """A trainable parameter that this replica's backward did not reach still joins the
        reduce-scatter, with zeros, so that every replica reduces the same tensors (another one
        may have used it). FSDP2's own switch where torch has it; torch releases without it
        (2.11 is one) reduce only the parameters with a gradient, so the zeros are set here, in
        the parameter group's post_backward just before FSDP's own (inside the presence rule's
        wrapper, which must not count them: installed first, it runs second)."""
        if hasattr(unit, "set_reduce_scatter_unused_params"):
            unit.set_reduce_scatter_unused_params(True, recurse=False)
            return
        for group in self._groups(unit):
            original = group.post_backward

            def post_backward(*args: Any, group: Any = group, original: Any = original) -> Any:
                if getattr(group, "reduce_grads", True):
                    for fp in group.fsdp_params:
                        if (hasattr(fp, "_unsharded_param") and getattr(fp, "unsharded_accumulated_grad", None) is None
                                and fp.unsharded_param.grad is None and fp.unsharded_param.requires_grad):
                            fp.unsharded_param.grad = torch.zeros_like(fp.unsharded_param)
                return original(*args)

            group.post_backward = post_backward

    def _watch_backward(self, group: Any) -> None:
        """Wrap a parameter group's post_backward (run by every backward, and by FSDP's final
        callback for groups autograd did not reach): note which parameters got a gradient (the
        presence rule) and the bytes held, just before FSDP reduce-scatters and frees them."""
        original = group.post_backward

        def post_backward(*args: Any) -> Any:
            grads = 0
            for fp in group.fsdp_params:
                if not hasattr(fp, "_unsharded_param"):  # never gathered (as FSDP checks)
                    continue
                grad = fp.unsharded_accumulated_grad
                grad = fp.unsharded_param.grad if grad is None else grad
                if grad is not None:
                    if self.counting:
                        self.present.add(id(fp))
                    grads += grad.numel() * grad.element_size()
            self.calls += 1
            self._note_held(grads)
            return original(*args)

        group.post_backward = post_backward

    def _note_held(self, unsharded_grads: int = 0) -> None:
        """Keep the largest (parameter, gradient) bytes held so far in the step: the shards, every
        unit gathered now and the all-gather output FSDP keeps until the next all-gather;
        the reduced gradient shards, `unsharded_grads` (a unit's, in its post-backward) and the
        reduce-scatter inputs FSDP keeps in flight. Counted from the tensors FSDP holds (sizes
        taken once), not from an allocator."""
        sizes = self._sizes or self._size_up()
        fps, shard, shards, units, contexts = sizes
        params = shards + sum(full for groups, full in units if all(g.is_unsharded for g in groups))
        grads = unsharded_grads + sum(shard[id(fp)] for fp in fps if fp.sharded_param.grad is not None)
        for ctx in contexts:
            kept = getattr(ctx, "all_gather_state", None)
            if kept is not None:
                params += _nbytes(kept.all_gather_result.all_gather_output)
            grads += sum(_nbytes(s.reduce_scatter_input) for s in getattr(ctx, "reduce_scatter_states", ()))
        if params + grads > sum(self.peak):
            self.peak = (params, grads)

    def _size_up(self) -> Any:
        fps = [fp for unit in self.units for g in self._groups(unit) for fp in g.fsdp_params]
        shard = {id(fp): local_bytes([fp.sharded_param]) for fp in fps}
        units = [(self._groups(u), sum(_nbytes(fp.sharded_param) for g in self._groups(u) for fp in g.fsdp_params))
                 for u in self.units]  # a sharded DTensor's numel is the whole parameter's
        contexts = list({id(g.comm_ctx): g.comm_ctx for u in self.units for g in self._groups(u)}.values())
        self._sizes = (fps, shard, sum(shard.values()), units, contexts)
        return self._sizes

    def verify(self, sums: Sequence[float] | None = None) -> None:
        """Every replica ran the same number of unit forwards and backwards this step (a lockstep
        section's collectives pair up only then): from `sums`, the step's summed [calls,
        calls squared] (reduce's all-reduce), or one small all-reduce of its own."""
        if sums is None:
            head = torch.tensor([float(self.calls), float(self.calls) ** 2], dtype=torch.float64,
                                device=self._device())
            dist.all_reduce(head, op=dist.ReduceOp.SUM, group=self.group)
            sums = head.tolist()
        n = dist.get_world_size(self.group)
        if not same_counts(sums, n):
            raise RuntimeError(
                f"the replicas of this FSDP section ran different numbers of unit forwards and "
                f"backwards (this one {self.calls}, mean {sums[0] / n:g}), so their per-micro-batch gathers "
                "did not pair up and the step's results cannot be trusted. A section that runs FSDP per "
                "micro-batch (a frozen teacher fed by the data, a loss section: parallel/fsdp.py) must run "
                "the same modules for every micro-batch; make the stage do so, or set fsdp=False or tp > 1")

    def _device(self) -> torch.device:
        fps = self._sizes[0] if self._sizes else []
        return fps[0].sharded_param.device if fps else torch.device("cpu")

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
        # torch 2.13 keeps a list of them; releases before it (2.11) a single one, or None.
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        return list(groups)

    def reduce(self, params: Sequence[torch.nn.Parameter], extra: Sequence[float] = ()) -> list[float]:
        """The GradientReducer interface for an FSDP section: `params` are the optimizer's
        (sharded) parameters; returns `extra` summed over the replicas. Per step: gather (a
        replica that ran nothing joins the same collectives), then reduce-scatter; per micro-batch
        the backwards reduce-scattered already, and only the presence counts remain."""
        if not self.per_micro_batch:
            self.gather()
        fsdp_params = [fp for unit in self.units for group in self._groups(unit) for fp in group.fsdp_params]
        device = fsdp_params[0].sharded_param.device if fsdp_params else torch.device("cpu")
        if self.per_micro_batch:
            present = [1.0 if id(fp) in self.present else 0.0 for fp in fsdp_params]
            present += [float(self.calls), float(self.calls) ** 2]  # checked below (verify)
            self.present.clear()
        else:
            present = [0.0 if fp.unsharded_param.grad is None else 1.0 for fp in fsdp_params]
        head = torch.tensor(present + list(extra), dtype=torch.float64, device=device)
        dist.all_reduce(head, op=dist.ReduceOp.SUM, group=self.group)
        counts = head.tolist()
        if self.per_micro_batch:
            self.verify(counts[len(fsdp_params):len(fsdp_params) + 2])
            del counts[len(fsdp_params):len(fsdp_params) + 2]
        if not self.per_micro_batch:
            for unit in reversed(self.units):
                unit.set_requires_gradient_sync(True, recurse=False)
                for group in reversed(self._groups(unit)):
                    group.post_backward()
            for unit in self.units:
                for group in self._groups(unit):
                    group.finalize_backward()
                unit.set_requires_gradient_sync(False, recurse=False)
        self.release()
        for fp, count in zip(fsdp_params, counts[:len(fsdp_params)], strict=True):
            if count == 0.0:
                fp.sharded_param.grad = None
        return counts[len(fsdp_params):]
