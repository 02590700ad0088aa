"""The monolithic baseline: what a Megatron-style trainer runs, for side-by-side comparisons.

`maestro run PIPE --baseline monolithic --devices N` runs N data-parallel ranks, each holding
every section of the pipeline and executing all of them, in graph order, on each micro-batch of
its share of the global batch: one micro-batch size for every section, an encoder running for
every micro-batch that holds a sample of its modality (on those samples), frozen sections under
`no_grad`, one backward through the whole model per micro-batch, and one data-parallel gradient
reduction per step (one flat all-reduce of every trainable parameter), then each section's own
optimizer and lr schedule. Each rank's share is a contiguous block of the global batch (FIFO
order), as a distributed sampler would give it.

It is built from the section runtime itself, so the comparison measures layouts, not two
different code bases: `monolithic_pipeline` turns a pipeline into one section, "model", of dp=N
whose stage is a `FusedStage` holding every section's stage, built with that section's own seed
(weights equal section mode's). The maths is that of colocated mode (the same global loss
normalisation, presence rule, clipping and schedules; tested within 1e-8 in float64).

Runs in the coordinator (`monolithic_pipeline`) and in each worker (`FusedStage`). Refused:
pipelines with more than one loss section (their denominators differ; the fused stage returns
one loss), with no trainable section, or whose sections sit on different device kinds. Tensor
parallelism and FSDP are dropped (every rank holds every section whole: plain data
parallelism), and checkpoints are for section mode.
"""

from __future__ import annotations

from typing import Any

import torch

from maestro_flow.config import Cost, Pipeline, Section
from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.stage import MicroBatch, Stage, StageContext, output_problem, warn_unread_loss

MODEL = "model"  # the one section of the monolithic pipeline
STAGE = "maestro_flow.baseline.monolithic:FusedStage"


def monolithic_pipeline(pipeline: Pipeline, devices: int, micro_batch: int | None = None) -> Pipeline:
    """The pipeline as one section of `devices` data-parallel ranks (at most global_batch), every
    section inside, each micro-batch `micro_batch` samples (default: the loss section's micro-batch)."""
    graph = SectionGraph(pipeline)
    losses = graph.loss_sections()
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise PipelineError(f"--devices must be an integer >= 1, got {devices!r}")
    if devices > pipeline.global_batch:  # 100 ranks for 16 samples started, then timed out
        raise PipelineError(f"--devices {devices} is more than global_batch={pipeline.global_batch}: each rank of the "
                            "monolithic baseline takes its share of every global batch, so "
                            f"{devices - pipeline.global_batch} would idle; pass --devices {pipeline.global_batch} "
                            "or fewer, or raise global_batch")
    if not losses:
        raise PipelineError("--baseline monolithic: the pipeline trains nothing (no trainable section)")
    if len(losses) > 1:
        raise PipelineError(f"--baseline monolithic: the pipeline has {len(losses)} loss sections "
                            f"({', '.join(losses)}); the monolithic baseline supports one")
    kinds = {s.device.split(":")[0] for s in pipeline.sections}
    if len(kinds) > 1:
        raise PipelineError(f"--baseline monolithic: sections sit on different devices ({', '.join(sorted(kinds))}); "
                            "every rank of the baseline holds every section, so they must share one device kind")
    loss = pipeline.section(losses[0])
    mb = loss.micro_batch if micro_batch is None else micro_batch
    if not isinstance(mb, int) or isinstance(mb, bool) or mb < 1:
        raise PipelineError(f"--micro-batch must be an integer >= 1, got {mb!r}")
    whole = pipeline.override(**{f"sections.{s.name}.{k}": v for s in pipeline.sections
                                 for k, v in (("dp", 1), ("tp", 1), ("fsdp", False))})
    columns: tuple[str, ...] | None = ()
    for s in pipeline.sections:
        columns = None if columns is None or s.columns is None else tuple(dict.fromkeys(columns + s.columns))
    fused = Section(name=MODEL, stage=STAGE, config={"pipeline": whole.to_dict()}, trainable=True, dp=devices,
                    micro_batch=mb, optimizer=dict(loss.optimizer), device=loss.device, columns=columns,
                    cost=_summed_cost(pipeline))
    return Pipeline(name=f"{pipeline.name}-monolithic", data=pipeline.data, sections=(fused,), edges=(),
                    global_batch=pipeline.global_batch, steps=pipeline.steps, seed=pipeline.seed,
                    dtype=pipeline.dtype, schedule="fifo", lookahead_steps=pipeline.lookahead_steps,
                    adapt_costs=pipeline.adapt_costs, grad_clip=pipeline.grad_clip,
                    mixed_precision=pipeline.mixed_precision)


def _summed_cost(pipeline: Pipeline) -> Cost:
    """Every section's cost on one rank (an upper bound: encoders run on part of the samples)."""
    def total(field: str) -> float:
        return sum(getattr(s.cost, field) * (1.0 + (s.cost.backward_factor if s.trainable else 0.0))
                   for s in pipeline.sections)
    return Cost(per_sample_s=total("per_sample_s"), per_token_s=total("per_token_s"),
                per_patch_s=total("per_patch_s"), per_frame_s=total("per_frame_s"), backward_factor=0.0)


class FusedStage(Stage):
    """Every section of a pipeline (config `pipeline`: its plain-data form) as one stage.

    `forward` runs the sections in graph order on the samples each activates on, hands each
    consumer its producers' outputs per sample (`None` where the producer did not activate, as
    the runtime does), keeps the autograd graph across an edge when gradients flow on it (both
    ends trainable) and detaches it otherwise, and returns the loss section's "loss" and
    "loss_denominator". Modules are named `<section>.<attribute>`.
    """

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        from maestro_flow.runtime.build import build_stage

        super().__init__(config, ctx)
        self.pipeline = Pipeline.from_dict(config["pipeline"])
        self.graph = SectionGraph(self.pipeline)
        self.loss = self.graph.loss_sections()[0]
        # Each section built as section mode builds it (its own seed, dtype, device; frozen
        # sections without gradients), so the weights are the same.
        self.parts: dict[str, Stage] = {n: build_stage(self.pipeline, self.graph.sections[n], ctx.replica,
                                                        str(ctx.device)) for n in self.graph.order}
        self.wire = torch.bfloat16 if self.pipeline.mixed_precision == "bf16" else None
        # Warned of once (rank 0) when a forward returns a "loss" nothing reads, as section mode does.
        self.unread_loss = {n for n in self.graph.order if ctx.replica == 0 and self.graph.drops_loss(n)}

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("loss", "loss_denominator")

    def modules(self) -> dict[str, torch.nn.Module]:
        return {f"{n}.{attr}": m for n, part in self.parts.items() for attr, m in part.modules().items()}

    def train(self, mode: bool = True) -> None:
        for n, part in self.parts.items():
            part.train(mode and self.graph.sections[n].trainable)

    def optimizer_groups(self, spec: dict[str, Any]) -> list[tuple[dict[str, Any], list[torch.nn.Parameter]]]:
        """Each trainable section's parameters with that section's optimizer and schedule, in the
        groups its stage asks for (Stage.optimizer_groups), as section mode's executor builds them
        (found in review: the baseline trained a stage's groups with the section's one spec)."""
        groups = []
        for n, part in self.parts.items():
            if not self.graph.sections[n].trainable:
                continue
            own = dict(self.graph.sections[n].optimizer)
            params = [p for p in part.parameters() if p.requires_grad]
            chosen = part.optimizer_groups(own) if params else None
            groups += chosen if chosen is not None else [(own, params)]
        return groups

    def saved_sections(self) -> dict[str, Stage]:
        """What `--save-dir` writes: each trainable section as section mode writes it."""
        return {n: part for n, part in self.parts.items() if self.graph.sections[n].trainable}

    def stats(self) -> dict[str, float]:
        return {f"{n}.{k}": v for n, part in self.parts.items() for k, v in part.stats().items()}

    def forward(self, batch: MicroBatch) -> dict[str, Any]:
        produced: dict[str, dict[int, dict[str, torch.Tensor | None]]] = {}
        result: dict[str, Any] | None = None
        for name in self.graph.order:
            section = self.graph.sections[name]
            picked = [i for i, m in enumerate(batch.modalities) if section.activates(m)]
            if not picked:
                continue
            sids = [batch.sample_ids[i] for i in picked]
            wanted = section.columns if section.columns is not None else tuple(batch.columns)
            inputs: dict[str, list[torch.Tensor | None]] = {}
            for e in self.graph.inputs(name):
                got = produced.get(e.edge.src, {})
                for tensor in e.edge.tensors:
                    inputs[tensor] = [self._cross(got[sid][tensor], e.carries_grad) if sid in got else None
                                      for sid in sids]
            sub = MicroBatch(step=batch.step, index=batch.index, sample_ids=sids,
                             modalities=[batch.modalities[i] for i in picked],
                             columns={c: [batch.columns[c][i] for i in picked] for c in wanted},
                             inputs=inputs)
            try:
                with torch.set_grad_enabled(section.trainable and torch.is_grad_enabled()):
                    out = self.parts[name].forward(sub)
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11: shown under the traceback
                    exc.add_note(f"(in section {name!r}, {section.stage}, inside the monolithic baseline's model)")
                raise
            problem = output_problem(out, section=name, stage=section.stage, num_samples=len(sids),
                                     carried=self.graph.carried(name),
                                     loss=name == self.loss)  # the contract section mode holds stages to
            if problem is not None:
                raise ValueError(problem)
            if name in self.unread_loss and "loss" in out:  # (found in review: dropped in silence here)
                self.unread_loss.discard(name)
                warn_unread_loss(self.parts[name], section.config, name)
            if name == self.loss:
                result = {"loss": out["loss"], "loss_denominator": out.get("loss_denominator", len(sids))}
            per_sample: dict[int, dict[str, torch.Tensor | None]] = {sid: {} for sid in sids}
            for e in self.graph.outputs(name):
                for tensor in e.edge.tensors:
                    values = out[tensor]
                    for sid, value in zip(sids, values, strict=True):
                        per_sample[sid][tensor] = value
            produced[name] = per_sample
        if result is None:  # no sample of this micro-batch reached the loss section
            zero = torch.zeros((), dtype=self.ctx.dtype, device=self.ctx.device, requires_grad=True)
            result = {"loss": zero, "loss_denominator": 0}
        return result

    def _cross(self, t: torch.Tensor | None, grad: bool) -> torch.Tensor | None:
        """A tensor crossing an edge, as section mode sends it: in bf16 under mixed precision,
        and cut from the producer's graph unless gradients flow back on the edge."""
        if t is None:
            return None
        if not grad:
            t = t.detach()
        return t.to(self.wire) if self.wire is not None and t.is_floating_point() else t
