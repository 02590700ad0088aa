"""`--tensorboard DIR`: the curves people look at, one point per step, in TensorBoard's format.

Runs in the `maestro run` process (section or colocated mode), fed the metrics rows of DESIGN 5.4
by RunReport, into DIR/NAME-TIMESTAMP (one folder per run, made by runtime/run.py). Writes with
`torch.utils.tensorboard.SummaryWriter`, which needs the optional `tensorboard` package (the
`tensorboard` extra: `pip install -e '.[tensorboard]'` in the checkout). Scalars, at global step
= the step index:
    loss (or loss/<section> with several loss sections), grad_norm, step_time_s,
    throughput/samples_per_s, throughput/tokens_per_s, lr/<section>, busy/<section> (the share of
    its replicas' step time spent computing), restarts
"""

from __future__ import annotations

from typing import Any

from maestro_flow.errors import PipelineError


def check_available() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise PipelineError("--tensorboard needs the tensorboard package: pip install tensorboard (or, in the "
                            "checkout, pip install -e '.[tensorboard]')") from None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The scalars of one metrics row (pure)."""
    out: dict[str, float] = {}
    loss = row.get("loss")
    if isinstance(loss, dict):
        out.update({f"loss/{name}": v for name, v in loss.items()})
    elif loss is not None:
        out["loss"] = loss
    if row.get("grad_norm") is not None:
        out["grad_norm"] = row["grad_norm"]
    out["step_time_s"] = row.get("step_time_s") or 0.0
    for key in ("samples_per_s", "tokens_per_s"):  # the row's own (ledger.py), None for a step of no time
        if row.get(key) is not None:
            out[f"throughput/{key}"] = row[key]
    for name, section in row.get("sections", {}).items():
        if "lr" in section:
            out[f"lr/{name}"] = section["lr"]
        total = section.get("busy_s", 0.0) + section.get("idle_s", 0.0)
        if total > 0:
            out[f"busy/{name}"] = section["busy_s"] / total
    out["restarts"] = row.get("restarts", 0)
    return out


class TensorBoardSink:
    def __init__(self, log_dir: str) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)
        self.last_step = -1

    def step(self, row: dict[str, Any]) -> None:
        if row["step"] <= self.last_step:
            # An automatic restart went back to its checkpoint: TensorBoard drops the points it had
            # from this step on, so each curve keeps one point per step.
            from torch.utils.tensorboard import SummaryWriter

            self.writer.close()
            self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=row["step"])
        self.last_step = row["step"]
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
