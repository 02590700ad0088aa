"""One section's stage run alone on micro-batches, for `maestro stage` (runtime/replay.py) and
`maestro profile` (runtime/profiling.py, whose section runner extends this one).

`SectionRunner` builds the stage exactly as a replica of a run builds it and runs a micro-batch
forward (each repetition from the recorded RNG states, when given) and, for a trainable section,
backward (of the loss, else of the sum of its floating outputs' squares / 2), timing both and
collecting gradient norms per parameter group and of the inputs. `synthetic_batches` makes
micro-batches from real samples with inputs computed by the upstream sections (run here) or
random tensors of given per-sample shapes. Every forward's outputs are checked as the executor
checks them (stage.output_problem): one that breaks the contract is a `StageOutputError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from maestro_flow.config import Pipeline
from maestro_flow.errors import MaestroError, StageOutputError, brief
from maestro_flow.graph import SectionGraph
from maestro_flow.runtime.build import build_stage, default_dtype, open_source, resolve_device
from maestro_flow.runtime.checks import check_token_limits
from maestro_flow.runtime.precision import autocast_dtype, compute
from maestro_flow.runtime.record import restore_rng
from maestro_flow.stage import MicroBatch, detached_loss, output_problem

SIZES = {"T": "num_tokens", "P": "num_patches", "F": "num_frames"}  # --input-shape's per-sample dimensions


class ReplayError(MaestroError):
    """Something the user can fix about a replay (no recording, bad step, unusable inputs)."""


# -- running one section -------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True)
class RunResult:
    outputs: dict[str, Any]
    forward_s: list[float]
    backward_s: list[float]
    param_grads: dict[str, float]  # parameter group -> gradient norm (trainable sections)
    input_grads: dict[str, tuple[float, int, int]]  # input name -> (norm, samples with a gradient, leaves)
    backward_of: str  # what was backwarded ("" when nothing)


def _group(name: str) -> str:
    """Parameter group: the name up to its first layer index (model.decoder.layers.0), else attr.child."""
    parts = name.split(".")[:-1] or name.split(".")
    for i, part in enumerate(parts[:5]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:2])


class SectionRunner:
    """One section's stage, built as `replica` of a run builds it, plus how to run a micro-batch."""

    def __init__(self, pipeline: Pipeline, name: str, graph: SectionGraph | None = None, replica: int = 0) -> None:
        self.pipeline = pipeline
        self.graph = graph or SectionGraph(pipeline)
        self.section = self.graph.sections[name]
        self.name = name
        self.device = torch.device(resolve_device(self.section, 0))
        self.dtype = getattr(torch, pipeline.dtype)
        # The dtype floating inputs arrive in: bf16 under mixed precision (they cross sections
        # so, and the executor hands them on as they came), else the pipeline's.
        self.input_dtype = autocast_dtype(pipeline.mixed_precision) or self.dtype
        with default_dtype(self.dtype):
            self.stage = build_stage(pipeline, self.section, replica, str(self.device))
        self.trainable = self.section.trainable
        self.stage.train(self.trainable)  # as the executor does
        self.grad_names = {t for e in self.graph.inputs(name) if e.carries_grad for t in e.edge.tensors}
        self.carried = self.graph.carried(name)
        self.is_loss = name in self.graph.loss_sections()

    def load_weights(self, path: str, source: str | None = None) -> None:
        """Load the stage's parameters from a safetensors file; `source` names it in errors
        (default "--weights PATH": the user's file; a replay names the recorded weights). A file
        of --save-dir or `maestro export` holds no frozen parameters (a KD student's copy of the
        teacher's head): those keep the values the stage builds them with, as in the run."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file as load_tensors

        source = source or f"--weights {path}"
        if os.path.isdir(path):  # found in QA: click's "is a directory", with no way on
            raise ReplayError(f"{source}: a folder, not a weights file: for a checkpoint, `maestro export "
                              f"{shlex.quote(path)} --section {self.name} -o OUT` writes OUT/{self.name}.safetensors; "
                              f"a --save-dir holds {os.path.join(path, self.name + '.safetensors')}")
        try:
            state = load_tensors(path)
        except (OSError, SafetensorError) as exc:
            raise ReplayError(f"{source}: not a readable safetensors file ({exc})") from None
        own = self.stage.state_dict()
        frozen = {name for name, p in self.stage.named_parameters() if not p.requires_grad}
        state = {**{k: v for k, v in own.items() if k in frozen}, **state}  # the file's where it has them
        missing = sorted(set(own) - set(state))
        if missing:
            raise ReplayError(f"{source}: has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                              f"for section {self.name!r} (a file of another section or pipeline?)")
        shapes = [f"{k} is {list(state[k].shape)} there, {list(own[k].shape)} here" for k in own
                  if tuple(state[k].shape) != tuple(own[k].shape)]
        if shapes:
            raise ReplayError(f"{source}: does not fit section {self.name!r}: {'; '.join(shapes[:3])}")
        self.stage.load_state_dict({k: state[k].to(device=own[k].device, dtype=own[k].dtype) for k in own})

    def prepare(self, batch: MicroBatch) -> tuple[MicroBatch, dict[tuple[int, str], torch.Tensor]]:
        """A fresh copy of `batch` with inputs on the section's device (floating ones in the
        dtype they cross sections in: bf16 under mixed precision, else the pipeline's); inputs
        of gradient edges become leaves requiring grad (trainable sections), as the executor
        makes them."""
        leaves: dict[tuple[int, str], torch.Tensor] = {}
        inputs: dict[str, list[torch.Tensor | None]] = {}
        for name, values in batch.inputs.items():
            column = []
            for i, t in enumerate(values):
                if t is not None:
                    t = t.detach().to(self.device).clone()
                    if t.is_floating_point() and t.dtype != self.input_dtype:
                        t = t.to(self.input_dtype)  # e.g. a float32 recording replayed with --set dtype=float64
                    if self.trainable and name in self.grad_names and t.is_floating_point():
                        t.requires_grad_(True)
                        leaves[(i, name)] = t
                column.append(t)
            inputs[name] = column
        columns = {k: list(v) for k, v in batch.columns.items()}
        return (MicroBatch(step=batch.step, index=batch.index, sample_ids=list(batch.sample_ids),
                           modalities=list(batch.modalities), columns=columns, inputs=inputs), leaves)

    def forward(self, batch: MicroBatch, grad: bool | None = None) -> dict[str, Any]:
        """The stage's forward as a run calls it (`grad`: default, when the section trains); its
        outputs are refused as a run refuses them (StageOutputError)."""
        with default_dtype(self.dtype), torch.set_grad_enabled(self.trainable if grad is None else grad), \
                compute(self.pipeline.mixed_precision, self.device):
            out = self.stage.forward(batch)
        self.check(out, len(batch))
        return out

    def check(self, out: Any, num_samples: int) -> None:
        """Raise StageOutputError when `out` breaks the output contract, as a run would refuse it."""
        problem = output_problem(out, section=self.name, stage=self.section.stage, num_samples=num_samples,
                                 carried=self.carried, loss=self.is_loss)
        if problem is not None:
            raise StageOutputError(problem)

    def _backward_target(self, out: dict[str, Any]) -> tuple[torch.Tensor | None, str]:
        loss = out.get("loss")
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            return loss.sum(), "loss"
        if isinstance(loss, torch.Tensor) and self.is_loss:  # a run refuses it too (found in QA: `stage` passed it)
            raise StageOutputError(detached_loss(self.name, self.section.stage))
        total = None
        for value in out.values():
            for x in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
                    term = x.float().pow(2).sum() / 2
                    total = term if total is None else total + term
        return total, "sum of outputs' squares / 2"

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, batch: MicroBatch, repeat: int = 1, rng: dict[str, torch.Tensor] | None = None) -> RunResult:
        """Forward (+ backward when trainable) `repeat` times; outputs and gradients of the first.
        With `rng` (record.recorded_rng), every forward starts from those RNG states, as the
        run's did, so each repetition draws the run's dropout masks."""
        fwd, bwd = [], []
        first: RunResult | None = None
        for _ in range(max(1, repeat)):
            for p in self.stage.parameters():
                p.grad = None
            prepared, leaves = self.prepare(batch)
            if rng:
                restore_rng(rng, self.device)
            self.sync()
            t0 = time.perf_counter()
            out = self.forward(prepared)
            self.sync()
            t1 = time.perf_counter()
            what = ""
            if self.trainable:
                target, what = self._backward_target(out)
                if target is not None:
                    with default_dtype(self.dtype):
                        target.backward()
                else:
                    what = ""
            self.sync()
            t2 = time.perf_counter()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            if first is None:
                first = RunResult(outputs=_detached(out), forward_s=[], backward_s=[],
                                  param_grads=self._param_grads() if what else {},
                                  input_grads=_input_grads(leaves, batch.inputs) if what else {}, backward_of=what)
        for p in self.stage.parameters():
            p.grad = None
        first.forward_s, first.backward_s = fwd, bwd if self.trainable else []
        return first

    def _param_grads(self) -> dict[str, float]:
        sq: dict[str, float] = {}
        for name, p in self.stage.named_parameters():
            if p.grad is not None:
                g = _group(name)
                sq[g] = sq.get(g, 0.0) + float(p.grad.detach().double().pow(2).sum())
        return {g: math.sqrt(v) for g, v in sq.items()}


def _detached(out: dict[str, Any]) -> dict[str, Any]:
    def d(x: Any) -> Any:
        return x.detach() if isinstance(x, torch.Tensor) else x
    return {k: [d(x) for x in v] if isinstance(v, (list, tuple)) else d(v) for k, v in out.items()}


def _input_grads(leaves: dict[tuple[int, str], torch.Tensor], inputs: dict[str, list]) -> dict[str, tuple[float, int, int]]:
    out: dict[str, tuple[float, int, int]] = {}
    for name in inputs:
        mine = [t for (_, n), t in leaves.items() if n == name]
        if not mine:
            continue
        grads = [t.grad for t in mine if t.grad is not None]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        out[name] = (norm, len(grads), len(mine))
    return out


# -- synthetic inputs ------------------------------------------------------------------------------

def _to_torch(name: str, value: Any) -> Any:
    try:  # the executor's conversion, so the stage sees what it sees in a run
        from maestro_flow.runtime.executor_state import to_torch as convert
    except ImportError:  # pragma: no cover
        convert = None
    if convert is not None:
        return convert(name, value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(np.int64) if name == "tokens" else np.array(value))
    return value


def ancestors(graph: SectionGraph, name: str, replaced: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The sections upstream of `name` that must run to compute its inputs, in graph order; an
    edge into `name` whose tensors are all `replaced` (random inputs) needs nothing."""
    need, todo = set(), [name]
    while todo:
        at = todo.pop()
        for e in graph.inputs(at):
            if at == name and set(e.edge.tensors) <= replaced:
                continue
            if e.edge.src not in need:
                need.add(e.edge.src)
                todo.append(e.edge.src)
    return [n for n in graph.order if n in need]


def _pick_samples(graph: SectionGraph, name: str, metadata: list, n: int) -> list:
    """`n` samples the section activates on, in file order, including at least one that each of
    its producers activates on when the dataset has one (so every input is exercised) and `n`
    leaves room: a producer's sample replaces the last one that no other producer still needs."""
    section = graph.sections[name]
    mine = [s for s in metadata if section.activates(s.modalities)]
    if not mine:
        raise ReplayError(f"no sample of the dataset activates section {name!r} "
                          f"(activates_on={section.activates_on!r})")
    chosen = mine[:n]
    producers = list({e.edge.src: graph.sections[e.edge.src] for e in graph.inputs(name)}.values())

    def covers(sample: Any, producer: Any) -> bool:
        return producer.activates(sample.modalities)

    def needed(sample: Any) -> bool:  # the only chosen sample of some producer
        return any(covers(sample, p) and sum(covers(s, p) for s in chosen) == 1 for p in producers)

    for producer in producers:
        if any(covers(s, producer) for s in chosen):
            continue
        candidates = [s for s in mine if covers(s, producer)]
        if not candidates:
            continue
        # Of its samples, the first that also brings the most producers not yet covered.
        extra = max(candidates, key=lambda c: sum(covers(c, p) and not any(covers(s, p) for s in chosen)
                                                  for p in producers))
        if len(chosen) >= n:
            spare = next((s for s in reversed(chosen) if not needed(s)), None)
            if spare is None:
                continue  # `n` too small to cover every producer
            chosen.remove(spare)
        chosen.append(extra)
    return sorted(chosen, key=lambda s: s.id)


def _micro_batch(section: Any, graph: SectionGraph, source: Any, samples: list, produced: dict,
                 index: int) -> MicroBatch:
    raw = source.read([s.row for s in samples], section.columns)
    columns = {k: [_to_torch(k, v) for v in vals] for k, vals in raw.items()}
    inputs: dict[str, list[torch.Tensor | None]] = {}
    for e in graph.inputs(section.name):
        producer = graph.sections[e.edge.src]
        for t in e.edge.tensors:
            inputs[t] = [produced.get((s.id, t)) if producer.activates(s.modalities) else None for s in samples]
    return MicroBatch(step=0, index=index, sample_ids=[s.id for s in samples],
                      modalities=[frozenset(s.modalities) for s in samples], columns=columns, inputs=inputs)


def synthetic_batches(pipeline: Pipeline, name: str, samples: int | None = None,
                      input_shapes: dict[str, tuple[int, ...]] | None = None,
                      log: Callable[[str], None] | None = None) -> list[MicroBatch]:
    """Micro-batches for section `name` from real samples, with inputs computed by its upstream
    sections (run here on the same samples) or random tensors of `input_shapes` (per sample)."""
    log = log or (lambda _m: None)
    input_shapes = input_shapes or {}
    graph = SectionGraph(pipeline)
    section = graph.sections[name]
    source = open_source(pipeline)
    chosen = _pick_samples(graph, name, source.metadata(), samples or section.micro_batch)
    # Samples this section (or one run upstream of it) would refuse in a run: one line, exit 2, as
    # validate says it, not the stage's own error (found in QA: max_seq_len). The others' limits
    # are not this command's business.
    check_token_limits(pipeline, source, chosen, only={name, *ancestors(graph, name, set(input_shapes))})
    produced: dict[tuple[int, str], torch.Tensor | None] = {}
    wanted = {t for e in graph.inputs(name) for t in e.edge.tensors}
    random_names = wanted & set(input_shapes)
    if wanted - random_names:
        _run_upstream(pipeline, graph, name, chosen, produced, random_names, input_shapes, log)
    if random_names:
        gen = torch.Generator().manual_seed(pipeline.seed)
        dtype = getattr(torch, pipeline.dtype)
        for t in sorted(random_names):
            try:
                for s in chosen:
                    shape = [getattr(s, SIZES[d]) if isinstance(d, str) else d for d in input_shapes[t]]
                    produced[(s.id, t)] = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
            except (RuntimeError, MemoryError) as exc:  # found in review: blamed on the stage (exit 3)
                shape = "x".join(map(str, input_shapes[t]))
                raise ReplayError(f"--input-shape {t}={shape}: cannot make {len(chosen)} such tensor(s) "
                                  f"({brief(exc)})") from None
        log(f"inputs {', '.join(sorted(random_names))}: random normal, per-sample shape "
            + ", ".join(f"{t}={'x'.join(map(str, input_shapes[t]))}" for t in sorted(random_names)))
    batches = []
    step = section.micro_batch
    for i in range(0, len(chosen), step):
        batches.append(_micro_batch(section, graph, source, chosen[i:i + step], produced, len(batches)))
    return batches


def _run_upstream(pipeline: Pipeline, graph: SectionGraph, name: str, chosen: list, produced: dict,
                  random_names: set[str], input_shapes: dict, log: Callable[[str], None]) -> None:
    source = open_source(pipeline)
    for up in ancestors(graph, name, random_names):
        section = graph.sections[up]
        try:
            runner = SectionRunner(pipeline, up)
        except MaestroError:
            raise
        except Exception as exc:
            raise ReplayError(f"building upstream section {up!r} to compute this section's inputs failed "
                              f"({type(exc).__name__}: {exc}); pass --input-shape NAME=DxD for its outputs "
                              "to use random inputs instead") from exc
        names = [t for e in graph.outputs(up) for t in e.edge.tensors]
        mine = [s for s in chosen if section.activates(s.modalities)]
        for i in range(0, len(mine), section.micro_batch):
            mb = mine[i:i + section.micro_batch]
            batch = _micro_batch(section, graph, source, mb, produced, i)
            try:
                with default_dtype(runner.dtype), torch.no_grad():
                    out = runner.stage.forward(batch)
                runner.check(out, len(mb))
                for t in names:
                    for s, x in zip(mb, out[t], strict=True):
                        produced[(s.id, t)] = None if x is None else x.detach()
            except Exception as exc:
                raise ReplayError(f"running upstream section {up!r} to compute this section's inputs failed "
                                  f"({type(exc).__name__}: {exc}); pass --input-shape NAME=DxD to use random "
                                  "inputs instead") from exc
        log(f"inputs {', '.join(names)}: computed by section {up!r} ({section.stage}, freshly initialised) "
            f"on {len(mine)} sample(s)")
