"""Rounds without samples of a lockstep FSDP section (parallel/fsdp.py, SectionGraph.lockstep).

The replicas of such a section gather and reduce-scatter per micro-batch, so each runs the step's
`rounds` forwards (and, training, backwards), the busiest replica's count. A replica with fewer
micro-batches runs the rest on a batch of its own: its last real micro-batch (inputs detached:
no gradient flows back to a producer), or, before it has one, the plan's probe sample read from
the data (a section fed by no other section only). The last real micro-batch goes into each
checkpoint (`pack`, beside the replica's RNG states), so a resumed replica stands in as the
uninterrupted one does. Runs in the executor's thread (runtime/executor.py), on its state.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import numpy as np
import torch

from maestro_flow.runtime.executor_state import STAGE_RAISES, StageFault
from maestro_flow.runtime.precision import compute
from maestro_flow.stage import MicroBatch


def run_round(executor: Any, st: Any) -> None:
    """A forward (and, training, a backward of a zero loss) the replica's lockstep peers run and
    it has no micro-batch for, so that every unit's collectives pair up. Nothing is sent or
    kept; its gradients (zeros) do not count as present; the random streams and, training, the
    stage's buffers are restored. A stage's own counters (`Stage.stats`) do count it."""
    ex = executor
    t0 = ex.clock()
    ex._waited(st, t0)
    ex._doing("FSDP round without samples", st.step, None)
    batch = round_batch(ex, st)
    buffers = [b for m in ex.stage.modules().values() for b in m.buffers()]
    saved = [b.clone() for b in buffers] if ex.trainable else []  # e.g. batch-norm statistics
    ex.fsdp.counting = False  # its zero gradients are no one's: the presence rule ignores them
    try:
        with torch.random.fork_rng(devices=[ex.device] if ex.device.type == "cuda" else []):
            with torch.set_grad_enabled(ex.trainable), compute(ex.mixed_precision, ex.device):
                out = ex.stage.forward(batch)
            loss = out.get("loss") if ex.trainable and isinstance(out, dict) else None
            if loss is not None and loss.requires_grad:
                if not torch.isfinite(loss.detach()).all():  # 0 x inf would add NaN to every peer's gradients
                    raise FloatingPointError(f"the stand-in round's loss is {float(loss.detach())}")
                (loss * 0.0).backward()
    except STAGE_RAISES:
        raise StageFault("forward", st.step, traceback.format_exc()) from None
    finally:
        ex.fsdp.counting = True
        with torch.no_grad():
            for b, value in zip(buffers, saved, strict=False):
                b.copy_(value)
    st.probes += 1
    elapsed = ex.clock() - t0
    st.busy_s += elapsed
    ex.tracer.span("FSDP round without samples", "compute", t0, t0 + elapsed, step=st.step)


def kept(batch: MicroBatch) -> MicroBatch:
    """The batch as kept for later rounds: its inputs detached from their producers' graphs, as
    new leaves that require a gradient where the inputs did (so that autograd reaches the same
    units as in a real round, and FSDP reduce-scatters them in the same order)."""
    inputs = {name: [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                     for t in column]
              for name, column in batch.inputs.items()}
    return dataclasses.replace(batch, inputs=inputs)


def pack(batch: MicroBatch | None) -> dict[str, Any] | None:
    """A kept batch as a checkpoint holds it (tensors and plain values, rng.save's kinds), so
    that a resumed replica stands in as the uninterrupted one would; None where it holds a
    value of another kind (then the resumed replica needs a sample of its own, as at a start)."""
    if batch is None:
        return None
    try:
        return {"step": batch.step, "index": batch.index, "sample_ids": list(batch.sample_ids),
                "modalities": [sorted(m) for m in batch.modalities],
                "columns": {k: [_pack(v) for v in col] for k, col in batch.columns.items()},
                "inputs": {k: [_pack(v) for v in col] for k, col in batch.inputs.items()}}
    except TypeError:
        return None


def unpack(state: dict[str, Any]) -> MicroBatch:
    """pack's batch back, its inputs leaves as kept() makes them."""
    return MicroBatch(step=state["step"], index=state["index"], sample_ids=list(state["sample_ids"]),
                      modalities=[frozenset(m) for m in state["modalities"]],
                      columns={k: [_unpack(v) for v in col] for k, col in state["columns"].items()},
                      inputs={k: [_unpack(v) for v in col] for k, col in state["inputs"].items()})


def _pack(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"tensor": v.detach().cpu(), "grad": v.requires_grad, "device": str(v.device)}
    if isinstance(v, np.ndarray):
        return {"numpy": torch.from_numpy(np.ascontiguousarray(v))}
    if isinstance(v, (list, tuple)):
        return {"list": [_pack(x) for x in v], "tuple": isinstance(v, tuple)}
    if v is None or isinstance(v, (bytes, str, int, float, bool)):
        return {"value": v}
    raise TypeError(f"a {type(v).__name__} in a stand-in batch")


def _unpack(v: dict[str, Any]) -> Any:
    if "tensor" in v:
        return v["tensor"].to(v["device"]).requires_grad_(v["grad"])
    if "numpy" in v:
        return v["numpy"].numpy()
    if "list" in v:
        out = [_unpack(x) for x in v["list"]]
        return tuple(out) if v["tuple"] else out
    return v["value"]


def round_batch(executor: Any, st: Any) -> MicroBatch:
    """What a replica runs for a round it has no micro-batch for (module docstring)."""
    if executor.last_batch is not None:
        return dataclasses.replace(executor.last_batch, step=st.step, index=-1)
    if st.probe is not None and not executor.in_edges:
        batch, _ = executor._make_batch(st, -1, (st.probe,), {st.probe: {}})
        return executor._prepare(st, batch)
    raise RuntimeError(
        f"section {executor.name!r} replica {executor.replica} step {st.step + 1}: its FSDP peers run {st.rounds} "
        f"micro-batches and it has none yet to stand in for them (a section fed by other sections needs a "
        f"sample of its own in its first step: raise global_batch or lower sections.{executor.name}.dp)")
