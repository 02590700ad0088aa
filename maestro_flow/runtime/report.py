"""What a run shows and writes: the progress line, the metrics JSON Lines, the final summary.

Runs in the coordinator process. A progress bar redraws in place on a terminal; elsewhere
(CI, pipes) a plain line is printed every few steps. Writes to stderr so stdout stays clean.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO


class RunReport:
    def __init__(self, *, total_steps: int, metrics_out: str | None, stream: TextIO | None = None,
                 show_progress: bool = True) -> None:
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.show = show_progress
        self.rows: list[dict[str, Any]] = []
        if metrics_out and os.path.dirname(metrics_out):
            os.makedirs(os.path.dirname(metrics_out), exist_ok=True)
        self._metrics = open(metrics_out, "w") if metrics_out else None  # noqa: SIM115 (closed in close())
        self._t0 = time.monotonic()

    def step(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._metrics:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()
        if not self.show:
            return
        n = len(self.rows)
        loss = row["loss"]
        loss_s = (f"{loss:.4f}" if isinstance(loss, float)
                  else " ".join(f"{k}={v:.4f}" for k, v in (loss or {}).items()))
        if self.tty:
            width = 24
            filled = int(width * n / max(self.total, 1))
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r[{bar}] step {n}/{self.total}  loss {loss_s}  {row['step_time_s']:.2f} s/step ")
            if n == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif n == 1 or n == self.total or n % max(1, self.total // 10) == 0:
            self.stream.write(f"step {n}/{self.total}  loss {loss_s}  {row['step_time_s']:.3f} s/step\n")
            self.stream.flush()

    def summary(self) -> str:
        if not self.rows:
            return "no step completed"
        first, last = self.rows[0]["loss"], self.rows[-1]["loss"]
        times = sorted(r["step_time_s"] for r in self.rows)
        median = times[len(times) // 2]
        text = f"{len(self.rows)} steps in {time.monotonic() - self._t0:.1f}s, median {median:.3f} s/step"
        if isinstance(first, float) and isinstance(last, float):
            text += f", loss {first:.4f} -> {last:.4f}"
        return text

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
            self._metrics = None
