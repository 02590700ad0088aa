"""What `maestro tune` searches and returns (planner/tune.py): a configuration (`Candidate`), the
ranked result (`TuneResult`), the memory model of one rank (`MemoryModel`), the `--set` strings
that apply a configuration, and the representative batch it is evaluated on. Pure.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maestro_flow.errors import PipelineError
from maestro_flow.samples import SampleMeta

Layout = tuple[tuple[str, int, int], ...]  # (section, dp, micro_batch) in topological order


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryModel:
    """Predicted peak memory of one rank: base_mb + per_sample_mb x kept samples, where base_mb
    holds param_mb x copies of training state (1 frozen; 4 AdamW: weights, gradients, two
    moments, 5 with amsgrad; 2 SGD, 3 with momentum; fewer where part of a trainable stage is
    frozen: runtime/tuning.copies) that tensor parallelism and FSDP shard (`at`)."""

    base_mb: float = 0.0
    per_sample_mb: float = 0.0
    param_mb: float = 0.0  # the section's parameters (0: unknown, sharding saves nothing)
    copies: float = 1.0  # a trainable section with frozen parameters has fewer than its optimizer's
    trained: float = 1.0  # the share of param_mb that trains (has gradients)
    tp_share: float = 0.0  # the share of param_mb the stage's tp_plan shards
    unit_mb: float = 0.0  # the largest FSDP unit (0: unknown)
    lockstep: bool = False  # a frozen section fed only by the data, or a loss section: with fsdp at tp=1, per unit

    def at(self, kept: int, tp: int = 1, dp: int = 1, fsdp: bool = False) -> float:
        """Peak MB of one rank of a replica of `tp` ranks, one of `dp` replicas, as the runtime
        holds state (parallel/fsdp.py): with fsdp the parameters (and a trainable section's
        gradients, of the parameters that train) are gathered for the whole step beside the
        persistent 1/dp shard, and the
        optimizer state stays sharded; a lockstep section at tp=1 holds its 1/dp shard and two units
        (the one it runs, FSDP's all-gather buffer of the last), five training (also a prefetched
        unit, a unit's gradients, reduce-scatter buffers: measured 5.1, tools/bench/RESULTS.md
        section 9). Activations are not divided by tp (the residual stream is replicated;
        conservative)."""
        shard = self.param_mb * (1.0 - self.tp_share + self.tp_share / tp)
        fixed = max(0.0, self.base_mb - self.param_mb * self.copies)
        if not fsdp or dp == 1:
            state = shard * self.copies
        elif self.lockstep and tp == 1 and self.unit_mb > 0:
            state = shard * self.copies / dp + min(self.unit_mb, shard) * (2 if self.copies == 1 else 5)
        elif self.copies == 1:
            state = shard * (1.0 + 1.0 / dp)
        else:
            state = shard * (1.0 + self.trained + (self.copies - 1) / dp)
        return fixed + state + self.per_sample_mb * kept


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One evaluated configuration."""

    layout: Layout
    step_s: float  # simulated makespan of the pipeline's schedule's plans (mean over the batches)
    lower_bound_s: float
    devices: int
    utilisation: dict[str, float]  # section -> busy fraction of its replicas over the step
    memory_mb: dict[str, float]  # section -> predicted peak per rank
    tp: dict[str, int] = dataclasses.field(default_factory=dict)  # section -> tensor-parallel ranks per replica
    fsdp: dict[str, bool] = dataclasses.field(default_factory=dict)
    given: dict[str, tuple[int, bool]] = dataclasses.field(default_factory=dict)  # the pipeline's (tp, fsdp)

    def dp(self, section: str) -> int:
        return next(d for n, d, _ in self.layout if n == section)

    def micro_batch(self, section: str) -> int:
        return next(m for n, _, m in self.layout if n == section)

    def to_json_dict(self) -> dict:
        """memory_mb is null for a section without a memory model (0 MB predicted: no --costs
        memory figures), as the table leaves its memory row out."""
        return {"step_s": self.step_s, "lower_bound_s": self.lower_bound_s, "devices": self.devices,
                "sections": {n: {"dp": d, "micro_batch": m, "tp": self.tp.get(n, 1), "fsdp": self.fsdp.get(n, False),
                                 "utilisation": self.utilisation[n], "memory_mb": self.memory_mb[n] or None}
                             for n, d, m in self.layout}}


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneResult:
    best: tuple[Candidate, ...]  # ranked, best first
    uniform: Candidate | None  # best with one dp and micro-batch for every section
    devices: int
    evaluated: int  # configurations simulated
    scored: int  # dp vectors scored analytically
    monolithic: Any = None  # planner.monolithic.MonolithicStep: the Megatron-style baseline on the same devices

    def to_json_dict(self) -> dict:
        mono = self.monolithic
        return {"devices": self.devices, "evaluated": self.evaluated, "scored": self.scored,
                "best": [c.to_json_dict() for c in self.best],
                "uniform": self.uniform.to_json_dict() if self.uniform else None,
                "monolithic": None if mono is None else {"step_s": mono.step_s, "devices": mono.devices,
                                                         "micro_batch": mono.micro_batch}}


def to_overrides(candidate: Candidate) -> list[str]:
    """`--set` strings for `maestro run` that apply a configuration."""
    out = []
    for name, dp, mb in candidate.layout:
        out += [f"sections.{name}.dp={dp}", f"sections.{name}.micro_batch={mb}"]
        tp, fsdp = candidate.tp.get(name, 1), candidate.fsdp.get(name, False)
        if (tp, fsdp) != candidate.given.get(name, (1, False)):
            out += [f"sections.{name}.tp={tp}", f"sections.{name}.fsdp={str(fsdp).lower()}"]
    return out


def representative_batch(pool: Sequence[SampleMeta], global_batch: int, seed: int = 0) -> list[SampleMeta]:
    """`global_batch` samples drawn from `pool` (seeded): a subset when the pool is large enough,
    else the pool repeated with fresh ids, so a short trace can stand for a large batch."""
    if not pool:
        raise PipelineError("tune: no sample metadata to tune for")
    rng = random.Random(seed)
    if len(pool) >= global_batch:
        return sorted(rng.sample(list(pool), global_batch), key=lambda s: s.id)
    picks = [pool[i % len(pool)] for i in range(global_batch)]
    rng.shuffle(picks)
    return [dataclasses.replace(s, id=i, row=-1) for i, s in enumerate(picks)]
