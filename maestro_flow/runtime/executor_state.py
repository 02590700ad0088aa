"""The executor's bookkeeping of one step and one micro-batch, and what it hands a stage.

Used by runtime/executor.py (and, for `to_torch`, by profiling and `maestro stage`, so a stage
sees the same values everywhere). `StageFault` is user stage code that raised, with the phase
and the traceback formatted where it happened; `recording` turns the run's --record spec into
the executor's argument.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from maestro_flow.samples import SampleMeta

# How gloo and NCCL word a failed collective that torch raises as a plain RuntimeError:
# "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ...", "NCCL error ...".
_COLLECTIVE_FAILURE = re.compile(r"\[[^\]\n]*/gloo/transport/[^\]\n]*\] |NCCL error")


def collective_failure(exc: BaseException | None) -> bool:
    """Whether `exc` is a collective's failure (a peer gone), raised inside stage code by FSDP's
    hooks or a tensor-parallel layer: torch.distributed's own errors, or a RuntimeError worded
    as gloo and NCCL word theirs (at its start, so a stage's message that names them is not)."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    return type(exc) is RuntimeError and _COLLECTIVE_FAILURE.match(str(exc)) is not None


# What stage code may raise that is its own failure: any Exception, and SystemExit (sys.exit),
# which would otherwise leave the worker with no report, or abort it in a native frame. Not
# KeyboardInterrupt: in colocated mode the stages run in the main process, where it is Ctrl-C
# (or SIGTERM, SIGHUP: runtime/run.py), an interrupt of the run.
STAGE_RAISES = (Exception, SystemExit)


_SHAPES = re.compile(r"shapes cannot be multiplied|size of tensor a|mixed torch\.Tensor and DTensor|shape '\[")


def tp_hint(text: str, tp: int, section: str, stage: object = None) -> str:
    """A line to add to a tensor-parallel section's stage error about shapes (found in QA: a plan
    sharding a layer whose consumer it left whole failed with a bare "mat1 and mat2 shapes").
    `stage`: the stage (or its class), when built; one whose `tp_plan` is stages.hf's runs
    transformers' own plan (the model's base_model_tp_plan), which is not edited here."""
    if tp < 2 or not _SHAPES.search(text):
        return ""
    plan = getattr(getattr(stage, "tp_plan", None), "__func__", None)  # stages.hf's, inherited or not (review)
    if getattr(plan, "__module__", None) == "stages.hf":  # found in review: the advice was to edit a plan we do not own
        return (f"(sections.{section} runs at tp={tp} with the model's own tp plan from transformers "
                "(base_model_tp_plan), which it applies as shipped: a config whose sizes or layers that plan does "
                f"not split evenly gives such shapes; --set sections.{section}.tp=1 tells whether tp is the cause)\n")
    return (f"(sections.{section} runs at tp={tp} with its stage's tp_plan: a plan that shards a layer whose "
            "consumer it leaves whole gives such shapes: pair each colwise layer with the rowwise one that reads "
            f"it, or make it colwise_rep; --set sections.{section}.tp=1 tells whether the plan is the cause)\n")


class StageFault(Exception):
    """User stage code raised; carries the phase and the traceback formatted here. `collateral`:
    what it raised (the exception being handled where this is made) is a collective's failure,
    which the worker reports as a system error, so that the coordinator blames the peer's own
    report, not this stage."""

    def __init__(self, phase: str, step: int | None, text: str) -> None:
        super().__init__(text)
        self.phase, self.step, self.text = phase, step, text
        self.collateral = collective_failure(sys.exc_info()[1])


@dataclass
class PendingBackward:
    """A trainable micro-batch whose outputs await gradients from downstream."""

    outputs: dict[tuple[int, str], torch.Tensor]
    expected: set[tuple[int, int]]  # (edge index, sample id) still to come
    grads: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    leaves: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    sample_ids: tuple[int, ...] = ()
    index: int = 0  # the micro-batch's index in the step
    recording: tuple | None = None  # (batch as read, outputs, RNG states) where --record keeps the micro-batch


@dataclass
class StepState:
    step: int
    mbs: list[tuple[int, ...]]
    rows: dict[int, int]
    modalities: dict[int, frozenset[str]]
    routes: dict[str, dict[int, int]]
    next_mb: int = 0
    pending: list[PendingBackward] = field(default_factory=list)
    loss_sum: float = 0.0
    denominator: float = 0.0
    loss_reported: bool = False
    global_denominator: float | None = None
    sizes: dict[int, SampleMeta] = field(default_factory=dict)  # sid -> its tokens, patches and frames
    gates: list[list[tuple[int, int]]] = field(default_factory=list)  # per mb: (consumer rank, forwards done)
    notify: list[int] = field(default_factory=list)  # producer ranks gated on this replica's progress
    started: float = 0.0
    busy_s: float = 0.0
    tokens: int = 0
    timings: list[list] = field(default_factory=list)  # per micro-batch, for the cost model (costfit.Timing)
    waiting: tuple[str, float] | None = None  # (what for, since when), for the trace
    grad_sq: float | None = None  # this replica's share of the squared global gradient norm, once reduced
    lr: float | None = None  # the learning rate of this step's optimizer step
    lr_groups: list[float] | None = None  # each optimizer's, with several (Stage.optimizer_groups)
    stepped: bool = False
    memory: dict[str, int] = field(default_factory=dict)  # bytes held in the step and at its end (parallel/memory)
    rounds: int = 0  # a per-micro-batch FSDP section's forwards per replica this step (parallel/fsdp.py)
    probe: int | None = None  # the sample it runs for rounds without a micro-batch of its own
    probes: int = 0  # such rounds run


def recording(spec: dict[str, Any] | None, section: str, replica: int, whole: bool = True) -> Any:
    """The executor's `record` (a record.Recorder, or None) from the run's record spec ({"dir",
    "section", "steps"}); `whole`: the replica holds whole weights (not fsdp, tp 1) to record."""
    if not spec or spec["section"] != section:
        return None
    from maestro_flow.runtime.record import Recorder, Steps, record_dir

    steps = Steps(ranges=tuple((lo, hi) for lo, hi in spec["steps"])) if spec.get("steps") is not None else None
    return Recorder(record_dir(spec["dir"], section, replica), steps, weights=whole)


def to_torch(name: str, value: Any) -> Any:
    """A loader value as a stage receives it: numeric arrays as tensors (tokens as int64)."""
    if isinstance(value, np.ndarray):
        # Copies: the loader's arrays are read-only views of the memory-mapped dataset.
        return torch.from_numpy(value.astype(np.int64) if name == "tokens" else np.array(value))
    return value
