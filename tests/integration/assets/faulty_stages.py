"""A trainable LM stage that fails on purpose, for the failure-matrix tests.

Config keys besides CausalLM's: `fail` ("setup", "forward", "kill", "segfault", "hang" or None), `at_step`
and `on_replica` (which step and replica fail), `sleep_s` (slow every forward down).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

from stages.lm import CausalLM

FAULT_KEYS = ("fail", "at_step", "on_replica", "sleep_s")


class Faulty(CausalLM):
    def __init__(self, config, ctx):
        self.fault = {k: config.get(k) for k in FAULT_KEYS}
        lm_config = {k: v for k, v in config.items() if k not in FAULT_KEYS}
        if self.fault["fail"] == "setup" and ctx.replica == (self.fault["on_replica"] or 0):
            raise RuntimeError("deliberate failure while building the stage")
        super().__init__(lm_config, ctx)
        print(f"faulty stage built on replica {ctx.replica}", flush=True)  # the run dir's worker log shows it

    @classmethod
    def outputs(cls, config):
        return CausalLM.outputs({k: v for k, v in config.items() if k not in FAULT_KEYS})

    def forward(self, batch):
        f = self.fault
        if f["sleep_s"]:
            time.sleep(f["sleep_s"])
        if batch.step == f["at_step"] and self.ctx.replica == (f["on_replica"] or 0):
            if f["fail"] == "forward":
                raise ValueError(f"deliberate failure in forward at step {batch.step}")
            if f["fail"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f["fail"] == "segfault":  # a crash in native code, as a library's bug would cause
                ctypes.string_at(0)
            if f["fail"] == "hang":
                time.sleep(3600)
        return super().forward(batch)
