"""Stages written from DESIGN 5.2 alone, as a new user writes them: no `outputs()` declared,
modules moved with `module.to(ctx.device, ctx.dtype)`.

`Embedder` sends per-sample "feat" (unless config `forget` names it: then it returns nothing
under that name); `Regressor` receives "feat" and returns the loss sum (or, with config
`no_loss`, forgets it)."""

from __future__ import annotations

import torch

from maestro_flow import Stage


class Embedder(Stage):
    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.emb = torch.nn.Embedding(260, 8).to(ctx.device, ctx.dtype)

    def forward(self, batch):
        if self.config.get("forget"):
            return {"other": [self.emb(t) for t in batch.columns["tokens"]]}
        return {"feat": [self.emb(t) for t in batch.columns["tokens"]]}


class Regressor(Stage):
    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.head = torch.nn.Linear(8, 1).to(ctx.device, ctx.dtype)
        assert isinstance(ctx.device, torch.device) and isinstance(ctx.dtype, torch.dtype)

    def forward(self, batch):
        loss = sum(self.head(f).pow(2).sum() for f in batch.inputs["feat"])
        if self.config.get("no_loss"):
            return {"total": loss}
        return {"loss": loss}
