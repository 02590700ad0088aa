"""Stages written from DESIGN 5.2 alone, as a new user writes them: no `outputs()` declared,
modules moved with `module.to(ctx.device, ctx.dtype)`.

`Embedder` sends per-sample "feat" (unless config `forget` names it: then it returns nothing
under that name; with config `numpy`, numpy arrays instead of tensors; with config
`fail_backward_at_step`, ones whose backward raises in that step), and with config `weights` a
float "weight" per sample that needs no gradient;
`Regressor` receives "feat" (weighted by "weight" where sent) and returns the loss sum (or, with
config `no_loss`, forgets it; with config `spin_s`, it computes that long more per micro-batch). Both
report the cores their process may run on, those of its ZeroMQ background threads (bit masks, so a
test can tell which worker had which cores) and its torch threads in `stats()`."""

from __future__ import annotations

import os
import time

import torch

from maestro_flow import Stage


class _ReportsCores(Stage):
    def stats(self):
        io = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().startswith("ZMQbg"):
                        io |= os.sched_getaffinity(int(tid))
            except OSError:  # a thread that ended meanwhile
                continue
        return {"cpu_mask": sum(1 << c for c in os.sched_getaffinity(0)), "io_mask": sum(1 << c for c in io),
                "threads": torch.get_num_threads()}


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("deliberate failure in backward")


class Embedder(_ReportsCores):
    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.emb = torch.nn.Embedding(260, 8).to(ctx.device, ctx.dtype)

    def forward(self, batch):
        if self.config.get("forget"):
            return {"other": [self.emb(t) for t in batch.columns["tokens"]]}
        out = {"feat": [self.emb(t) for t in batch.columns["tokens"]]}
        if self.config.get("numpy"):  # breaks the output contract
            out["feat"] = [f.detach().numpy() for f in out["feat"]]
        if self.config.get("fail_backward_at_step") == batch.step:
            out["feat"] = [_RaiseInBackward.apply(f) for f in out["feat"]]
        if self.config.get("weights"):  # a float from the data beside it, needing no gradient
            out["weight"] = [torch.full((1,), 1.0 + len(t) / 100.0, dtype=self.ctx.dtype) for t in batch.columns["tokens"]]
        return out


class Regressor(_ReportsCores):
    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.head = torch.nn.Linear(8, 1).to(ctx.device, ctx.dtype)
        assert isinstance(ctx.device, torch.device) and isinstance(ctx.dtype, torch.dtype)

    def forward(self, batch):
        until = time.perf_counter() + self.config.get("spin_s", 0.0)
        while time.perf_counter() < until:  # busy, as a larger model would be
            pass
        weights = batch.inputs.get("weight") or [1.0] * len(batch.inputs["feat"])
        loss = sum(self.head(f).pow(2).sum() * w.sum() if torch.is_tensor(w) else self.head(f).pow(2).sum()
                   for f, w in zip(batch.inputs["feat"], weights, strict=True))
        if self.config.get("no_loss"):
            return {"total": loss}
        return {"loss": loss}
