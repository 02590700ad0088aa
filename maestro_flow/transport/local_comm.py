"""The in-process comm: one process holds every section (colocated mode, tests).

Same interface as transport/tensor_comm.py's `TensorComm` (its `Comm` protocol): a message's
tensors are copied and handed straight to the destination's deliver callback, in the caller's
thread; nothing is in flight and nothing is shared, so there is nothing to give back or close.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from maestro_flow.transport import p2p
from maestro_flow.transport.tensor_comm import Deliver, Stats


class LocalComm:
    """In-process comm: delivers copies straight to the destination's callback (same interface)."""

    def __init__(self, rank: int, deliver_to: Callable[[int], Deliver]) -> None:
        self.rank = rank
        self._deliver_to = deliver_to
        self.stats = Stats()
        self.in_flight = 0

    def send(self, dst: int, kind: str, edge: int, step: int, items: Sequence[p2p.Item]) -> None:
        # Contiguous, as every process-group or shared-memory delivery is: a stage that views its
        # input must behave the same in colocated mode, the oracle of section mode.
        copies = [(sid, name, None if t is None else t.detach().clone(memory_format=torch.contiguous_format))
                  for sid, name, t in items]
        self._deliver_to(dst)(kind, edge, step, self.rank, copies)

    def notify(self, dst: int, step: int, finished: int) -> None:
        self._deliver_to(dst)("progress", -1, step, self.rank, finished)

    def reap(self) -> None:
        """Nothing to give back: copies, not shared memory."""

    def close(self, timeout_s: float = 0.0) -> bool:
        return True
