"""Stages written from DESIGN 5.2 alone, as a new user writes them: no `outputs()` declared,
modules moved with `module.to(ctx.device, ctx.dtype)`.

`Embedder` sends per-sample "feat" (unless config `forget` names it: then it returns nothing
under that name); `Regressor` receives "feat" and returns the loss sum (or, with config
`no_loss`, forgets it). Both report the cores their process may run on and its torch threads
in `stats()` (a bit mask, so a test can tell which worker had which cores)."""

from __future__ import annotations

import os

import torch

from maestro_flow import Stage


class _ReportsCores(Stage):
    def stats(self):
        return {"cpu_mask": sum(1 << c for c in os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


class Embedder(_ReportsCores):
    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.emb = torch.nn.Embedding(260, 8).to(ctx.device, ctx.dtype)

    def forward(self, batch):
        if self.config.get("forget"):
            return {"other": [self.emb(t) for t in batch.columns["tokens"]]}
        return {"feat": [self.emb(t) for t in batch.columns["tokens"]]}


class Regressor(_ReportsCores):
    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.head = torch.nn.Linear(8, 1).to(ctx.device, ctx.dtype)
        assert isinstance(ctx.device, torch.device) and isinstance(ctx.dtype, torch.dtype)

    def forward(self, batch):
        loss = sum(self.head(f).pow(2).sum() for f in batch.inputs["feat"])
        if self.config.get("no_loss"):
            return {"total": loss}
        return {"loss": loss}
