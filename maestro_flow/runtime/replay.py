"""`maestro stage PIPELINE SECTION`: run one section alone, in this process, and report on it.

The section's stage is built exactly as a run builds replica 0 (build_stage: the pipeline's
seed, dtype and device) and fed micro-batches that are either

  - recorded (`--replay RUN_DIR`): what the section received in `maestro run --record SECTION`
    (RUN_DIR/record/SECTION-REPLICA/, see runtime/record.py), with the weights it had at each
    recorded step when the run saved them; or
  - synthetic: a few real samples of the dataset for the section's columns, and, for each
    incoming edge, the tensors its producers compute on those samples, obtained by running the
    upstream sections' stages here (freshly initialised, as at step 0), or random normal tensors
    of a given per-sample shape (`--input-shape NAME=DxD`) when an upstream section cannot run.

Each micro-batch runs forward (under no_grad for a frozen section) and, for a trainable section,
backward: of the loss (summed) for a section returning "loss", else of the sum of its floating
outputs' squares / 2. Received inputs of gradient-carrying edges are leaves requiring grad, as in
the executor. The report gives, per micro-batch, each output's shapes, dtype and statistics, the
gradient norms per parameter group and of the inputs, and forward/backward times (median over
`repeat` runs); with `compare`, the largest differences from the recorded outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from maestro_flow.config import Pipeline
from maestro_flow.errors import MaestroError, PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.runtime.build import build_stage, default_dtype, load_pipeline, open_source, resolve_device
from maestro_flow.runtime.record import load_file, recorded_files, recorded_weights, recording_dirs
from maestro_flow.stage import MicroBatch

__all__ = ["ReplayOptions", "SectionRunner", "RunResult", "replay", "synthetic_batches", "compare_outputs",
           "parse_steps", "parse_shapes"]


@dataclasses.dataclass(kw_only=True, slots=True)
class ReplayOptions:
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_dir: str | None = None  # recorded inputs; None: synthetic
    replica: int | None = None  # which replica's recording (default: all)
    steps: set[int] | None = None  # recorded steps to replay (default: all)
    compare: bool = False
    atol: float = 1e-5
    rtol: float = 1e-4
    repeat: int = 1
    samples: int | None = None  # synthetic: number of samples (default: the section's micro_batch)
    input_shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    weights: str | None = None  # a saved stage file (<save_dir>/<section>.safetensors) to load
    pdb: bool = False


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
    """One section's stage, built as replica 0 of a run builds it, plus how to run a micro-batch."""

    def __init__(self, pipeline: Pipeline, name: str) -> None:
        self.pipeline = pipeline
        self.graph = SectionGraph(pipeline)
        self.section = pipeline.section(name)
        self.name = name
        self.device = torch.device(resolve_device(self.section, 0))
        self.dtype = getattr(torch, pipeline.dtype)
        with default_dtype(self.dtype):
            self.stage = build_stage(pipeline, self.section, 0, str(self.device))
        self.trainable = self.section.trainable
        self.stage.train(self.trainable)  # as the executor does
        self.grad_names = {t for e in self.graph.inputs(name) if e.carries_grad for t in e.edge.tensors}

    def load_weights(self, path: str) -> None:
        from safetensors.torch import load_file as load_tensors

        state = load_tensors(path)
        own = self.stage.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ReplayError(f"{path}: has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                              f"for section {self.name!r} (a file of another section or pipeline?)")
        self.stage.load_state_dict({k: state[k].to(device=own[k].device, dtype=own[k].dtype) for k in own})

    def prepare(self, batch: MicroBatch) -> tuple[MicroBatch, dict[tuple[int, str], torch.Tensor]]:
        """A fresh copy of `batch` with inputs on the section's device (floating ones in the
        pipeline's dtype); inputs of gradient edges become leaves requiring grad (trainable
        sections), as the executor makes them."""
        leaves: dict[tuple[int, str], torch.Tensor] = {}
        inputs: dict[str, list[torch.Tensor | None]] = {}
        for name, values in batch.inputs.items():
            column = []
            for i, t in enumerate(values):
                if t is not None:
                    t = t.detach().to(self.device).clone()
                    if t.is_floating_point() and t.dtype != self.dtype:
                        t = t.to(self.dtype)  # e.g. replaying a float32 recording with --set dtype=float64
                    if self.trainable and name in self.grad_names and t.is_floating_point():
                        t.requires_grad_(True)
                        leaves[(i, name)] = t
                column.append(t)
            inputs[name] = column
        columns = {k: list(v) for k, v in batch.columns.items()}
        return (MicroBatch(step=batch.step, index=batch.index, sample_ids=list(batch.sample_ids),
                           modalities=list(batch.modalities), columns=columns, inputs=inputs), leaves)

    def forward(self, batch: MicroBatch) -> dict[str, Any]:
        from maestro_flow.runtime.precision import compute

        with default_dtype(self.dtype), torch.set_grad_enabled(self.trainable), \
                compute(self.pipeline.mixed_precision, self.device):
            out = self.stage.forward(batch)
        if not isinstance(out, dict):
            raise TypeError(f"{self.section.stage}.forward returned {type(out).__name__}, not a dict of outputs")
        return out

    def _backward_target(self, out: dict[str, Any]) -> tuple[torch.Tensor | None, str]:
        loss = out.get("loss")
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            return loss.sum(), "loss"
        total = None
        for value in out.values():
            for x in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
                    term = x.float().pow(2).sum() / 2
                    total = term if total is None else total + term
        return total, "sum of outputs' squares / 2"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, batch: MicroBatch, repeat: int = 1) -> RunResult:
        """Forward (+ backward when trainable) `repeat` times; outputs and gradients of the first."""
        fwd, bwd = [], []
        first: RunResult | None = None
        for _ in range(max(1, repeat)):
            for p in self.stage.parameters():
                p.grad = None
            prepared, leaves = self.prepare(batch)
            self._sync()
            t0 = time.perf_counter()
            out = self.forward(prepared)
            self._sync()
            t1 = time.perf_counter()
            what = ""
            if self.trainable:
                target, what = self._backward_target(out)
                if target is not None:
                    with default_dtype(self.dtype):
                        target.backward()
                else:
                    what = ""
            self._sync()
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
        from maestro_flow.runtime.executor import _to_torch as convert
    except ImportError:  # pragma: no cover
        convert = None
    if convert is not None:
        return convert(name, value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(np.int64) if name == "tokens" else np.array(value))
    return value


def _ancestors(graph: SectionGraph, name: str) -> list[str]:
    need, todo = set(), [name]
    while todo:
        for e in graph.inputs(todo.pop()):
            if e.edge.src not in need:
                need.add(e.edge.src)
                todo.append(e.edge.src)
    return [n for n in graph.order if n in need]


def _pick_samples(graph: SectionGraph, name: str, metadata: list, n: int) -> list:
    """`n` samples the section activates on, in file order, including at least one that each of
    its producers activates on when the dataset has one (so every input is exercised)."""
    section = graph.sections[name]
    mine = [s for s in metadata if section.activates(s.modalities)]
    if not mine:
        raise ReplayError(f"no sample of the dataset activates section {name!r} "
                          f"(activates_on={section.activates_on!r})")
    chosen = mine[:n]
    for e in graph.inputs(name):
        producer = graph.sections[e.edge.src]
        if not any(producer.activates(s.modalities) for s in chosen):
            extra = next((s for s in mine if producer.activates(s.modalities)), None)
            if extra is not None:
                keep = [s for s in chosen if not producer.activates(s.modalities)]
                chosen = (keep[:n - 1] + [extra]) if n > 1 else [extra]
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
    produced: dict[tuple[int, str], torch.Tensor | None] = {}
    wanted = {t for e in graph.inputs(name) for t in e.edge.tensors}
    random_names = wanted & set(input_shapes)
    if wanted - random_names:
        _run_upstream(pipeline, graph, name, chosen, produced, random_names, input_shapes, log)
    if random_names:
        gen = torch.Generator().manual_seed(pipeline.seed)
        dtype = getattr(torch, pipeline.dtype)
        for t in sorted(random_names):
            for s in chosen:
                produced[(s.id, t)] = torch.randn(input_shapes[t], generator=gen, dtype=torch.float32).to(dtype)
        log(f"inputs {', '.join(sorted(random_names))}: random normal, per-sample shape "
            + ", ".join(f"{t}={list(input_shapes[t])}" for t in sorted(random_names)))
    batches = []
    step = section.micro_batch
    for i in range(0, len(chosen), step):
        batches.append(_micro_batch(section, graph, source, chosen[i:i + step], produced, len(batches)))
    return batches


def _run_upstream(pipeline: Pipeline, graph: SectionGraph, name: str, chosen: list, produced: dict,
                  random_names: set[str], input_shapes: dict, log: Callable[[str], None]) -> None:
    source = open_source(pipeline)
    for up in _ancestors(graph, name):
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
                for t in names:
                    for s, x in zip(mb, out[t], strict=True):
                        produced[(s.id, t)] = None if x is None else x.detach()
            except Exception as exc:
                raise ReplayError(f"running upstream section {up!r} to compute this section's inputs failed "
                                  f"({type(exc).__name__}: {exc}); pass --input-shape NAME=DxD to use random "
                                  "inputs instead") from exc
        log(f"inputs {', '.join(names)}: computed by section {up!r} ({section.stage}, freshly initialised) "
            f"on {len(mine)} sample(s)")


# -- recorded inputs ---------------------------------------------------------------------------

def _recorded(run_dir: str, name: str, options: ReplayOptions) -> list[tuple[str, int, int, str]]:
    """(folder, step, index, file) of the recorded micro-batches to replay."""
    if not os.path.isdir(run_dir):
        raise ReplayError(f"--replay: no run folder {run_dir}")
    dirs = recording_dirs(run_dir, name)
    if not dirs:
        raise ReplayError(f"--replay: no recording of section {name!r} in {os.path.join(run_dir, 'record')} "
                          f"(record one with: maestro run PIPELINE.py --record {name})")
    if options.replica is not None:
        want = f"{name}-{options.replica}"
        dirs = [d for d in dirs if os.path.basename(d) == want]
        if not dirs:
            raise ReplayError(f"--replica {options.replica}: no folder {want} in {os.path.join(run_dir, 'record')}")
    found = [(d, step, index, path) for d in dirs for step, index, path in recorded_files(d)]
    if options.steps is not None:
        have = sorted({f[1] for f in found})
        found = [f for f in found if f[1] in options.steps]
        if not found:
            raise ReplayError(f"--steps: none of {sorted(options.steps)} recorded for {name!r} "
                              f"(recorded steps: {', '.join(map(str, have)) or 'none'})")
    if not found:
        raise ReplayError(f"--replay: the recording of {name!r} in {run_dir} holds no micro-batch")
    return sorted(found, key=lambda f: (f[1], f[2], f[0]))


def _run_settings_note(run_dir: str, pipeline: Pipeline, name: str) -> str | None:
    path = os.path.join(run_dir, "pipeline.json")
    try:
        with open(path) as f:
            recorded = json.load(f).get("pipeline", {})
    except (OSError, ValueError, AttributeError):
        return None
    theirs = next((s for s in recorded.get("sections", []) if s.get("name") == name), None)
    if theirs is None:
        return f"note: the run's pipeline ({path}) has no section {name!r}"
    ours = next(s for s in pipeline.to_dict()["sections"] if s["name"] == name)
    keys = ("stage", "config", "trainable", "columns", "activates_on")
    differ = [k for k in keys if json.dumps(theirs.get(k), sort_keys=True) != json.dumps(ours.get(k), sort_keys=True)]
    if recorded.get("dtype", pipeline.dtype) != pipeline.dtype:
        differ.append("dtype")
    if differ:
        return (f"note: the run used other settings for {name!r} ({', '.join(differ)} {'differs' if len(differ) == 1 else 'differ'} from {path}); "
                "pass the run's --set overrides to replay faithfully")
    return None


# -- report ----------------------------------------------------------------------------------------

def _shape_summary(shapes: list[tuple[int, ...]]) -> str:
    if not shapes:
        return "-"
    if all(s == shapes[0] for s in shapes):
        return f"{len(shapes)} x {list(shapes[0])}" if len(shapes) > 1 else str(list(shapes[0]))
    if all(len(s) == len(shapes[0]) for s in shapes):
        dims = []
        for d in range(len(shapes[0])):
            lo, hi = min(s[d] for s in shapes), max(s[d] for s in shapes)
            dims.append(str(lo) if lo == hi else f"{lo}..{hi}")
        return f"{len(shapes)} x [{', '.join(dims)}]"
    return ", ".join(str(list(s)) for s in shapes)


def _stats(tensors: list[torch.Tensor]) -> str:
    values = [t.detach().reshape(-1) for t in tensors if t.numel()]
    if not values:
        return "empty"
    if not all(v.is_floating_point() or v.is_complex() for v in values):
        flat = torch.cat([v.to(torch.int64).cpu() for v in values])
        return f"min {int(flat.min())}  max {int(flat.max())}"
    flat = torch.cat([v.double().cpu() for v in values])
    nan, inf = int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum())
    finite = flat[torch.isfinite(flat)]
    if finite.numel():
        std = float(finite.std()) if finite.numel() > 1 else 0.0
        text = (f"mean {float(finite.mean()):.4g}  std {std:.4g}  min {float(finite.min()):.4g}  "
                f"max {float(finite.max()):.4g}")
    else:
        text = "no finite value"
    flags = f"  NaN {nan}" if nan else ""
    flags += f"  Inf {inf}" if inf else ""
    return text + (flags or "  NaN/Inf none")


def describe_value(value: Any) -> str:
    """Shapes, dtype and statistics of one output (or input/column) value."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            v = value.detach().double()
            bad = "  NaN" if torch.isnan(v) else ("  Inf" if torch.isinf(v) else "")
            return f"scalar {str(value.dtype).removeprefix('torch.')}  value {float(v):.6g}{bad}"
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}  {_stats([value])}"
    if isinstance(value, (list, tuple)):
        tensors = [x for x in value if isinstance(x, torch.Tensor)]
        nones = sum(x is None for x in value)
        others = len(value) - len(tensors) - nones
        if not tensors:
            return f"{len(value)} entries, {nones} None" + (f", {others} other" if others else "")
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
        text = f"{_shape_summary([tuple(t.shape) for t in tensors])} {'/'.join(dtypes)}"
        if nones:
            text += f" (+{nones} None)"
        return f"{text}  {_stats(tensors)}"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return repr(value)


def _column_summary(values: list[Any]) -> str:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if tensors:
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
        nones = sum(v is None for v in values)
        return f"{_shape_summary([tuple(t.shape) for t in tensors])} {'/'.join(dtypes)}" + (
            f" (+{nones} None)" if nones else "")
    blobs = [v for v in values if isinstance(v, (bytes, bytearray))]
    if blobs:
        nones = sum(v is None for v in values)
        return f"{len(blobs)} x bytes ({min(map(len, blobs))}..{max(map(len, blobs))})" + (
            f" (+{nones} None)" if nones else "")
    shown = values if len(values) <= 8 else [*values[:8], "..."]
    return "[" + ", ".join(map(str, shown)) + "]"


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.2f} ms"


# -- comparison ------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True)
class Diff:
    name: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    ok: bool = True
    problem: str = ""


def _tensor_diff(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, bool, str]:
    if tuple(a.shape) != tuple(b.shape):
        return math.inf, math.inf, False, f"shape {list(a.shape)} vs recorded {list(b.shape)}"
    if a.numel() == 0:
        return 0.0, 0.0, True, ""
    x, y = a.detach().cpu().double(), b.detach().cpu().double()
    both_nan = torch.isnan(x) & torch.isnan(y)
    same_inf = torch.isinf(x) & (x == y)
    diff = (x - y).abs()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    rel = diff / y.abs().clamp_min(1e-12)
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
    ok = bool((diff <= atol + rtol * y.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)).all())
    return float(diff.max()), float(rel.max()), ok, ""


def compare_outputs(got: dict[str, Any], want: dict[str, Any], atol: float, rtol: float) -> list[Diff]:
    """Per output name: the largest absolute/relative difference from the recorded value and
    whether every element is within atol + rtol * |recorded|."""
    diffs = []
    for name, ref in want.items():
        d = Diff(name=name)
        diffs.append(d)
        if name not in got:
            d.ok, d.problem = False, "missing from the replayed outputs"
            continue
        mine = got[name]
        if isinstance(ref, list):
            if not isinstance(mine, (list, tuple)) or len(mine) != len(ref):
                d.ok, d.problem = False, (f"{len(mine) if isinstance(mine, (list, tuple)) else type(mine).__name__} "
                                          f"entries vs recorded {len(ref)}")
                continue
            for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
                if (a is None) != (b is None):
                    d.ok, d.problem = False, f"entry {i} is {'None' if a is None else 'a tensor'} (recorded: " \
                                             f"{'None' if b is None else 'a tensor'})"
                    break
                if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                    ma, mr, ok, problem = _tensor_diff(a, b, atol, rtol)
                    d.max_abs, d.max_rel = max(d.max_abs, ma), max(d.max_rel, mr)
                    if not ok:
                        d.ok = False
                        d.problem = d.problem or (f"entry {i}: {problem}" if problem else "")
                elif a != b and not (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
                    d.ok, d.problem = False, f"entry {i}: {a!r} vs recorded {b!r}"
        elif isinstance(ref, torch.Tensor):
            if not isinstance(mine, torch.Tensor):
                d.ok, d.problem = False, f"{type(mine).__name__} vs a recorded tensor"
                continue
            d.max_abs, d.max_rel, d.ok, d.problem = _tensor_diff(mine, ref, atol, rtol)
        elif isinstance(ref, (int, float)) and not isinstance(ref, bool):
            value = float(mine) if isinstance(mine, (int, float, torch.Tensor)) and (
                not isinstance(mine, torch.Tensor) or mine.numel() == 1) else None
            if value is None:
                d.ok, d.problem = False, f"{type(mine).__name__} vs recorded number {ref}"
                continue
            d.max_abs = abs(value - ref)
            d.max_rel = d.max_abs / max(abs(ref), 1e-12) if d.max_abs else 0.0
            d.ok = d.max_abs <= atol + rtol * abs(ref)
        elif mine != ref:
            d.ok, d.problem = False, f"{mine!r} vs recorded {ref!r}"
    return diffs


# -- the command ---------------------------------------------------------------------------------

def parse_steps(text: str | None) -> set[int] | None:
    """"3", "0,2,5", "4-7" or a mix ("0,4-7") -> a set of steps."""
    if not text:
        return None
    steps: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                steps.update(range(lo, hi + 1))
            elif part:
                steps.add(int(part))
        except ValueError:
            raise ReplayError(f"--steps: {part!r} is not a step, a range A-B or a comma-separated list of them") from None
    return steps


def parse_shapes(items: tuple[str, ...] | list[str]) -> dict[str, tuple[int, ...]]:
    """("image_embeds=16x64", ...) -> {"image_embeds": (16, 64)}."""
    out = {}
    for item in items:
        name, sep, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().replace(",", "x").split("x") if d.strip())
            if not sep or not name or not shape or min(shape) < 0:
                raise ValueError
        except ValueError:
            raise ReplayError(f"--input-shape: expected NAME=DxD (per-sample shape, e.g. hidden=32x128), got {item!r}") \
                from None
        out[name.strip()] = shape
    return out


@contextlib.contextmanager
def post_mortem(enabled: bool) -> Iterator[None]:
    """With `enabled`, an exception from user code drops into pdb (then propagates)."""
    try:
        yield
    except MaestroError as exc:
        if enabled and exc.__cause__ is not None and exc.__cause__.__traceback__ is not None:
            _debug(exc.__cause__)
        raise
    except Exception as exc:
        if enabled:
            _debug(exc)
        raise


def _debug(exc: BaseException) -> None:
    import pdb
    import traceback

    traceback.print_exception(type(exc), exc, exc.__traceback__)
    print("entering the debugger (post mortem); 'c' or 'q' to leave", flush=True)
    pdb.post_mortem(exc.__traceback__)


def replay(path: str, name: str, options: ReplayOptions, echo: Callable[[str], None] = print) -> int:
    """Run section `name` of the pipeline file `path` alone; print the report; 0, or 1 when
    `compare` finds an output out of tolerance."""
    pipeline, _ = load_pipeline(path, options.overrides)
    pipeline.validate()
    if name not in pipeline.section_names:
        raise PipelineError(f"no section named {name!r} in {path} (sections: {', '.join(pipeline.section_names)})")
    if options.compare and not options.run_dir:
        raise ReplayError("--compare needs --replay RUN_DIR (recorded outputs to compare with)")
    if options.repeat < 1:
        raise ReplayError(f"--repeat must be >= 1, got {options.repeat}")
    with post_mortem(options.pdb):
        return _replay(path, pipeline, name, options, echo)


def _replay(path: str, pipeline: Pipeline, name: str, options: ReplayOptions, echo: Callable[[str], None]) -> int:
    graph = SectionGraph(pipeline)
    section = graph.sections[name]
    is_loss = name in graph.loss_sections()
    kind = "trainable" if section.trainable else "frozen"
    recorded = _recorded(options.run_dir, name, options) if options.run_dir else None
    runner = SectionRunner(pipeline, name)
    params = sum(p.numel() for p in runner.stage.parameters())
    echo(f"section {name} ({section.stage}): {kind}{', loss section' if is_loss else ''}, "
         f"{params:,} parameters, device {runner.device}, dtype {pipeline.dtype}")
    if options.weights:
        runner.load_weights(options.weights)
        echo(f"weights: {options.weights}")
    work: list[tuple[MicroBatch, dict[str, Any] | None, str | None]] = []
    if recorded is not None:
        note = _run_settings_note(options.run_dir, pipeline, name)
        if note:
            echo(note)
        steps = sorted({r[1] for r in recorded})
        echo(f"inputs: recorded in {os.path.join(options.run_dir, 'record')} — {len(recorded)} micro-batch(es), "
             f"step(s) {', '.join(map(str, steps))}")
        for folder, step, _index, file in recorded:
            batch, outputs = load_file(file)
            work.append((batch, outputs, recorded_weights(folder, step) if not options.weights else None))
        if options.weights:
            pass
        elif any(w for _, _, w in work):
            echo("weights: as recorded at each step (RECORDING/weights-stepNNNNNN.safetensors)")
        else:
            echo("weights: freshly initialised (the recording holds no weights; outputs of steps after 0 "
                 "differ from the run's — pass --weights SAVE_DIR/SECTION.safetensors)")
    else:
        lines: list[str] = []
        batches = synthetic_batches(pipeline, name, options.samples, options.input_shapes, lines.append)
        n = sum(len(b) for b in batches)
        echo(f"inputs: synthetic — {n} sample(s) of {pipeline.data.path} (ids "
             f"{', '.join(str(s) for b in batches for s in b.sample_ids)}), {len(batches)} micro-batch(es) of up to "
             f"{section.micro_batch}")
        for line in lines:
            echo("  " + line)
        if not options.weights:
            echo("weights: freshly initialised (as at step 0)")
        work = [(b, None, None) for b in batches]

    failed = 0
    loaded_weights = None
    for batch, want, weights in work:
        if weights and weights != loaded_weights:
            runner.load_weights(weights)
            loaded_weights = weights
        echo("")
        mods = sorted({m for ms in batch.modalities for m in ms})
        echo(f"step {batch.step} micro-batch {batch.index}: {len(batch)} sample(s) {batch.sample_ids} "
             f"({', '.join(mods) or 'no modality'})" + (f", weights of step {batch.step}" if weights else ""))
        for col, values in batch.columns.items():
            echo(f"  column {col:<16} {_column_summary(values)}")
        for inp, values in batch.inputs.items():
            echo(f"  input  {inp:<16} {describe_value(values)}")
        result = runner.run(batch, options.repeat)
        for out_name, value in result.outputs.items():
            echo(f"  output {out_name:<16} {describe_value(value)}")
        if section.trainable:
            if result.backward_of:
                total = math.sqrt(sum(v * v for v in result.param_grads.values()))
                echo(f"  backward of {result.backward_of}: parameter grad norm {total:.4g}")
                for group, norm in result.param_grads.items():
                    echo(f"    {group:<28} {norm:.4g}")
                for inp, (norm, with_grad, leaves) in result.input_grads.items():
                    echo(f"  input grad {inp:<10} norm {norm:.4g} ({with_grad} of {leaves} received tensors got a gradient)")
            else:
                echo("  backward: nothing to backward (no output requires grad)")
        timing = f"  time: forward {_ms(result.forward_s)}"
        if result.backward_s:
            timing += f", backward {_ms(result.backward_s)}"
        echo(timing + f" (median of {len(result.forward_s)})")
        if options.compare and want is not None:
            diffs = compare_outputs(result.outputs, want, options.atol, options.rtol)
            for d in diffs:
                verdict = "ok" if d.ok else "MISMATCH"
                extra = f"  {d.problem}" if d.problem else ""
                echo(f"  compare {d.name:<15} max abs {d.max_abs:.3g}  max rel {d.max_rel:.3g}  {verdict}{extra}")
            extra_names = [k for k in result.outputs if k not in want]
            if extra_names:
                echo(f"  compare: not recorded: {', '.join(extra_names)}")
            failed += sum(not d.ok for d in diffs)
    echo("")
    if options.compare:
        if failed:
            echo(f"compare: {failed} output(s) differ from the recording beyond atol={options.atol:g} "
                 f"rtol={options.rtol:g}")
            return 1
        echo(f"compare: all outputs match the recording (atol={options.atol:g}, rtol={options.rtol:g})")
    return 0
