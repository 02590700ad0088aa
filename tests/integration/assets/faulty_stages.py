"""A trainable LM stage that fails on purpose, for the failure-matrix tests.

Config keys besides CausalLM's: `fail` ("setup", "setup_hang", "prepare", "forward", "kill", "segfault", "hang",
"exit0", "sys_exit", "nan" (a NaN loss from `at_step` on) or None), `at_step`
and `on_replica` (which step and replica fail), `sleep_s` (slow every forward down), `helper_s` (start
`sleep helper_s` as a helper process, left running), `atexit_file` (an atexit handler appends the
replica's number to it).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import time

from stages.lm import CausalLM

FAULT_KEYS = ("fail", "at_step", "on_replica", "sleep_s", "helper_s", "atexit_file")


class Faulty(CausalLM):
    def __init__(self, config, ctx):
        self.fault = {k: config.get(k) for k in FAULT_KEYS}
        lm_config = {k: v for k, v in config.items() if k not in FAULT_KEYS}
        if self.fault["fail"] == "setup" and ctx.replica == (self.fault["on_replica"] or 0):
            raise RuntimeError("deliberate failure while building the stage")
        if self.fault["fail"] == "setup_hang" and ctx.replica == (self.fault["on_replica"] or 0):
            time.sleep(3600)
        super().__init__(lm_config, ctx)
        if self.fault["helper_s"]:
            self.helper = subprocess.Popen(["sleep", str(self.fault["helper_s"])])
        if self.fault["atexit_file"]:
            atexit.register(lambda: open(self.fault["atexit_file"], "a").write(f"{ctx.replica}\n"))
        print(f"faulty stage built on replica {ctx.replica}", flush=True)  # the run dir's worker log shows it

    @classmethod
    def outputs(cls, config):
        return CausalLM.outputs({k: v for k, v in config.items() if k not in FAULT_KEYS})

    @classmethod
    def inputs(cls, config):
        return ("hidden",)  # the teacher's edge makes it a consumer; its forward does not read it

    def prepare(self, batch):
        """Fails as the vision encoder's decoding does on a corrupt image: here, or in forward on a
        batch that was not prepared (a replay's, as Stage.prepare's contract says)."""
        if self.fault["fail"] != "prepare":
            return super().prepare(batch)
        self._prepare_fault(batch)
        return dataclasses.replace(batch, columns={**batch.columns, "prepared": [True] * len(batch.sample_ids)})

    def _prepare_fault(self, batch):
        f = self.fault
        if f["fail"] == "prepare" and batch.step == f["at_step"] and self.ctx.replica == (f["on_replica"] or 0):
            raise ValueError(f"deliberate failure in prepare at step {batch.step}")

    def forward(self, batch):
        f = self.fault
        if f["fail"] == "prepare" and "prepared" not in batch.columns:
            self._prepare_fault(batch)
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
            if f["fail"] == "exit0":  # leaves as if it were done, in the middle of a step
                os._exit(0)
            if f["fail"] == "sys_exit":
                sys.exit(3)
        out = super().forward(batch)
        if f["fail"] == "nan" and batch.step >= f["at_step"] and self.ctx.replica == (f["on_replica"] or 0):
            out["loss"] = out["loss"] * float("nan")  # as a diverged model's loss: NaN, and NaN gradients
        return out
