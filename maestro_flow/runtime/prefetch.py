"""Micro-batches prepared ahead (`Stage.prepare`: decoding images) by a section that reads only
the data, while its worker would otherwise wait.

A mixin of runtime/executor.py's SectionExecutor (its plans, source and stage), kept apart to
keep each module to one concern. The worker calls `prefetch` when it has nothing else to do;
`_run_next_forward` takes a prepared micro-batch from `prepared` or prepares it then.
"""

from __future__ import annotations

import traceback

from maestro_flow.runtime.executor_state import STAGE_RAISES, StageFault, StepState
from maestro_flow.stage import MicroBatch

PREFETCH = 2  # micro-batches a section that reads only the data prepares ahead


class Prefetch:
    def _prepare(self, st: StepState, batch: MicroBatch) -> MicroBatch:
        try:
            return self.stage.prepare(batch)
        except STAGE_RAISES:
            raise StageFault("forward", st.step, traceback.format_exc()) from None

    def prefetch(self) -> bool:
        """Prepare (Stage.prepare) the next micro-batch this replica will run, if its section
        reads only the data and fewer than PREFETCH are prepared: work taken off the critical
        path. The worker calls it when it would otherwise wait; True if it tried one. A failure
        here is not raised (it would stop the step still running): that micro-batch is read and
        prepared again just before its forward, where the error names its own step."""
        if not self.prefetching or len(self.prepared) + len(self.unprepared) >= PREFETCH:
            return False
        upcoming = ([self.current] if self.current is not None else []) + list(self.plans)
        for st in upcoming:
            for index in range(st.next_mb, len(st.mbs)):
                key = (st.step, index)
                if key in self.prepared or key in self.unprepared:
                    continue
                t0 = self.clock()
                mb = st.mbs[index]
                try:
                    raw, _ = self._make_batch(st, index, mb, {sid: {} for sid in mb})
                    self.prepared[key] = (raw if self.record is not None else None, self.stage.prepare(raw))
                except STAGE_RAISES:
                    self.unprepared.add(key)
                t1 = self.clock()
                st.busy_s += t1 - t0  # the step's work, done ahead
                self.tracer.span("prepare", "compute", t0, t1, step=st.step, mb=index)
                return True
        return False
