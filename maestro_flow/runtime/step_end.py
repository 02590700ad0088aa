"""The end of a step in a replica's executor: the loss report, the gradient reduction, the
optimizer step, the memory measurements and the step's report.

A mixin of runtime/executor.py's SectionExecutor (its state: the current StepState, the
optimizer, FSDP, the report callback), kept apart to keep each module to one concern. Runs in
the executor's thread: `_finish_step` returns True when it did something, False while it waits
(for the global loss denominator, the clip coefficient) or while the step still has work.
"""

from __future__ import annotations

import resource
from typing import Any

from maestro_flow.parallel import memory
from maestro_flow.runtime import lockstep
from maestro_flow.runtime.executor_state import StepState

# The process's peak resident size, per step. Linux gives it for the calling thread too (it is
# the address space's), and RUSAGE_SELF would sum every thread's CPU times first: a visible cost
# in a worker with DALI's busy threads (py-spy, tools/bench/RESULTS.md 11.2).
_RSS_OF = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


class StepEnd:
    def _finish_step(self, st: StepState) -> bool:
        if st.next_mb < len(st.mbs) or st.pending:
            return False
        if self.fsdp is not None and self.fsdp.per_micro_batch and st.next_mb + st.probes < st.rounds:
            lockstep.run_round(self, st)
            return True
        if self._report_loss(st):  # (a replica without micro-batches this step: nothing reported it yet)
            return True
        if self.trainable and st.grad_sq is None:
            st.grad_sq = 0.0  # a trainable stage without trainable parameters adds nothing to the norm
            if self.optim is not None:
                if self.is_loss:
                    denominator = None  # summed over the DP group with the gradients, below
                else:
                    denominator = self.finalized.get(st.step)
                    if denominator is None:
                        st.grad_sq = None
                        return self._wait(st, "wait loss denominator")
                    del self.finalized[st.step]
                t0 = self.clock()
                self._waited(st, t0)
                self._doing("reducing gradients", st.step, None)
                self._reduce(st, denominator)
                st.busy_s += self.clock() - t0
            if self.grad_clip is not None:
                # Every trainable replica's share of the global norm goes to the coordinator,
                # which answers every one of them with the same clip coefficient.
                self.report("norm", {"step": st.step, "sq": st.grad_sq})
                return True
        if self.trainable and not st.stepped:
            coef = 1.0
            if self.grad_clip is not None:
                if st.step not in self.clips:
                    return self._wait(st, "wait clip")
                coef = self.clips.pop(st.step)
            if self.optim is not None:
                t0 = self.clock()
                self._waited(st, t0)
                self._doing("optimizer step", st.step, None)
                st.lr, st.lr_groups = self.optim.lr, self.optim.lr_groups
                self.optim.step(coef)
                st.busy_s += self.clock() - t0
                self.tracer.span("optimizer step", "compute", t0, self.clock(), step=st.step)
            st.stepped = True
        if self.fsdp is not None and (self.fsdp.gathered or (self.fsdp.per_micro_batch and "step_params" not in st.memory)):
            self._measure(st, "step")
            if self.fsdp.per_micro_batch:
                self.fsdp.verify()  # (a trainable section verified in its reduction)
            self.fsdp.release()  # a frozen section's (a trainable one released when it reduced)
        for when in ("step", "rest"):  # unless measured around the gradient reduction
            if f"{when}_params" not in st.memory:
                self._measure(st, when)
        st.memory["optimizer"] = sum(memory.optimizer_bytes(o) for o in (self.optim.optimizers if self.optim else ()))
        self.inbox.pop(st.step, None)
        for key in [k for k in self.progress if k[0] <= st.step]:
            del self.progress[key]
        self.report("done", {"step": st.step, "stats": self._stats(st)})
        self._doing("idle (step done)", st.step, None)
        self.current = None
        self.steps_done += 1
        return True

    def _report_loss(self, st: StepState) -> bool:
        """Trainable sections upstream need the global denominator: the coordinator sums the loss
        replicas' reports and sends it to them (finalize). Sent once per step, as soon as this
        replica's last forward has counted its share (executor._loss_backward: before that
        micro-batch's backward, which the upstream reduction, and without grad_clip the upstream
        optimizer step, then overlap; with grad_clip that step still waits for the global norm,
        which needs this backward); True when it was sent now."""
        if not self.is_loss or not self.feeds_upstream or st.loss_reported or self.follower:
            return False
        st.loss_reported = True
        self.report("loss", {"step": st.step, "loss_sum": st.loss_sum, "denominator": st.denominator})
        return True

    def _reduce(self, st: StepState, denominator: float | None) -> None:
        """All-reduce the gradients, divide by the global loss denominator, measure the norm. A
        loss section passes None: its replicas sum their denominators in the same collective as
        the gradients (no round trip through the coordinator on the critical path)."""
        extra = [st.loss_sum, st.denominator] if denominator is None else []
        self._measure(st, "step")
        t0 = self.clock()
        extra = self.optim.reduce(extra)
        if self.optim.reducer is not None:
            self.tracer.span("gradient all-reduce", "reduce", t0, self.clock(), step=st.step)
        self.optim.divide(extra[1] if denominator is None else denominator)
        self._measure(st, "rest")
        st.grad_sq = self.optim.sq_norm()

    def _measure(self, st: StepState, when: str) -> None:
        """Bytes of the parameters and gradients this rank holds now (parallel/memory.py)."""
        params, grads = memory.held(self.stage.parameters())
        if when == "step" and self.fsdp is not None and self.fsdp.gathered:
            params += memory.local_bytes(self.fsdp.sharded())  # kept beside the gathered copy
        elif when == "step" and self.fsdp is not None and self.fsdp.per_micro_batch:
            params, grads = self.fsdp.peak  # the most it held at once, in a forward or a backward
        st.memory.update({f"{when}_params": params, f"{when}_grads": grads})

    def _stats(self, st: StepState) -> dict[str, Any]:
        wall = self.clock() - st.started
        stage_stats = getattr(self.stage, "stats", None)
        return {"busy_s": st.busy_s, "wall_s": wall, "stage": dict(stage_stats()) if callable(stage_stats) else {},
                **({"loss_sum": st.loss_sum, "denominator": st.denominator} if self.is_loss else {}),
                "micro_batches": len(st.mbs), "samples": sum(len(mb) for mb in st.mbs), "tokens": st.tokens,
                **({"probe_rounds": st.probes} if st.rounds else {}),
                "timings": st.timings,
                **({"grad_sq": st.grad_sq} if self.trainable else {}),
                **({"lr": st.lr} if self.optim is not None else {}),
                **({"lr_groups": st.lr_groups} if st.lr_groups else {}),
                "max_rss_kb": resource.getrusage(_RSS_OF).ru_maxrss,
                "memory": {**st.memory, "peak_mb": memory.peak_mb(self.device)},
                **({"trace": self.tracer.take()} if self.tracer.enabled else {}),
                **self.comm.stats.snapshot_and_reset()}
