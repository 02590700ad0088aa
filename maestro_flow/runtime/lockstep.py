"""Rounds without samples of a lockstep FSDP section (parallel/fsdp.py, SectionGraph.lockstep).

The replicas of such a section gather and reduce-scatter per micro-batch, so each runs the step's
`rounds` forwards (and, training, backwards), the busiest replica's count. A replica with fewer
micro-batches runs the rest on a batch of its own: its last real micro-batch (inputs detached:
no gradient flows back to a producer), or, before it has one, the plan's probe sample read from
the data (a section fed by no other section only). Runs in the executor's thread
(runtime/executor.py), on its state.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import torch

from maestro_flow.runtime.executor_state import StageFault
from maestro_flow.runtime.precision import compute
from maestro_flow.stage import MicroBatch


def run_round(executor: Any, st: Any) -> None:
    """A forward (and, training, a backward of a zero loss) the replica's lockstep peers run and
    it has no micro-batch for, so that every unit's collectives pair up; nothing is sent, counted
    or kept, and the random streams are restored (they would otherwise differ from a run where
    the replica had the samples)."""
    ex = executor
    t0 = ex.clock()
    ex._waited(st, t0)
    ex._doing("FSDP round without samples", st.step, None)
    batch = round_batch(ex, st)
    try:
        with torch.random.fork_rng(devices=[ex.device] if ex.device.type == "cuda" else []):
            with torch.set_grad_enabled(ex.trainable), compute(ex.mixed_precision, ex.device):
                out = ex.stage.forward(batch)
            if ex.trainable and isinstance(out, dict) and getattr(out.get("loss"), "requires_grad", False):
                (out["loss"] * 0.0).backward()
    except Exception:
        raise StageFault("forward", st.step, traceback.format_exc()) from None
    st.probes += 1
    elapsed = ex.clock() - t0
    st.busy_s += elapsed
    ex.tracer.span("FSDP round without samples", "compute", t0, t0 + elapsed, step=st.step)


def kept(batch: MicroBatch) -> MicroBatch:
    """The batch as kept for later rounds: its inputs detached from their producers' graphs."""
    inputs = {name: [t.detach() if isinstance(t, torch.Tensor) else t for t in column]
              for name, column in batch.inputs.items()}
    return dataclasses.replace(batch, inputs=inputs)


def round_batch(executor: Any, st: Any) -> MicroBatch:
    """What a replica runs for a round it has no micro-batch for (module docstring)."""
    if executor.last_batch is not None:
        return dataclasses.replace(executor.last_batch, step=st.step, index=-1)
    if st.probe is not None and not executor.in_edges:
        batch, _ = executor._make_batch(st, -1, (st.probe,), {st.probe: {}})
        return batch
    raise RuntimeError(
        f"section {executor.name!r} replica {executor.replica} step {st.step}: its FSDP peers run {st.rounds} "
        f"micro-batches and it has none yet to stand in for them (a section fed by other sections needs a "
        f"sample of its own in its first step: raise global_batch or lower sections.{executor.name}.dp)")
