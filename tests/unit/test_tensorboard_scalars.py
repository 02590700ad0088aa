"""The TensorBoard scalars of a metrics row (runtime/tensorboard.py; pure)."""

from __future__ import annotations

from maestro_flow.runtime.tensorboard import scalars


def test_the_scalars_of_a_row():
    row = {"step": 4, "loss": {"a": 1.0, "b": 2.0}, "grad_norm": None, "samples": 8, "tokens": 80, "step_time_s": 0.5,
           "samples_per_s": 16.0, "tokens_per_s": 160.0,
           "sections": {"enc": {"busy_s": 0.25, "idle_s": 0.75}, "llm": {"busy_s": 1.0, "idle_s": 0.0, "lr": 0.1}}}
    assert scalars(row) == {"loss/a": 1.0, "loss/b": 2.0, "step_time_s": 0.5, "throughput/samples_per_s": 16.0,
                            "throughput/tokens_per_s": 160.0, "busy/enc": 0.25, "busy/llm": 1.0, "lr/llm": 0.1,
                            "restarts": 0}
