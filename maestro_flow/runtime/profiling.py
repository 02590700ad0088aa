"""`maestro profile`: measure each section's time per micro-batch and its peak memory, fit costs.

Runs in a worker process the CLI process starts (spawn, pinned to one core: `profile_pipeline`),
every section in that one process (like colocated mode): each section's stage is built with
dp=1 on its own device, fed real dataset rows (entry sections) or
the real outputs of its producers (run first on the same samples; detached, and marked
requires_grad where the edge carries gradients, as the executor does).

What is measured, per section and per micro-batch size (default 1, 2, 4, ... up to twice the
section's micro_batch): three micro-batches — the smallest, middle and largest samples by
tokens+patches+frames among a pool spread over the dataset's size range — and one of mixed
lengths spread over the pool, each timed `repeats` times after one warm-up call, keeping the
median. Each is counted as the cost model charges it (planner/cost.charged: for a stage that
pads, `Cost.padded`, every sample at the micro-batch's longest):
  - forward: building the micro-batch (reading and converting its rows, as the executor's
    timing does) + `stage.forward` (under no_grad for frozen sections);
  - backward (trainable sections): the loss's backward for a loss section, else the backward of
    the sum of the section's outgoing tensors.
Fit (planner.costfit.fit_nonnegative, non-negative least squares lightly pulled towards the
pipeline's Cost shape): forward seconds = overhead + a*samples + b*tokens + c*patches +
d*frames, with the token/patch/frame terms the section's Cost uses (the CostFitter rule);
backward_factor = total backward / total forward time. The fit is made both with padding
(tokens, patches, frames counted at each micro-batch's longest sample) and without, and the
clearly better one sets the cost file's `padded` (runtime/profile_fit.py: padding is measured,
not only declared).

Peak memory per micro-batch: on CUDA, torch.cuda.max_memory_allocated above the allocation
before the call; on CPU, the process RSS sampled every millisecond by a thread during the call,
above the RSS before it (after glibc's malloc_trim, so freed memory of earlier calls does not
hide growth). CPU figures are approximate (allocator caching, page granularity). The memory
model: memory_base_mb = parameter bytes x (1 frozen; 4 trainable: weights, gradients, two AdamW
states; 2 for SGD) + the fitted constant; peak_memory_mb_per_sample = the fitted slope of peak
activation memory against micro-batch size; param_mb and tp_share (the share of it the stage's
tp_plan shards) let `maestro tune` model tensor parallelism and FSDP.

Runtime costs (calibration; the stage's compute alone under-predicts a real step):
  - step_overhead_s (trainable sections): the end-of-step work the executor does once per step,
    timed on the real stage after a backward — zero-filling missing gradients, dividing by the
    loss denominator, `optimizer.step()` and `zero_grad` (median of `repeats`); grad_mb is the
    gradient size, from which the tuner estimates the all-reduce when dp > 1;
  - runtime_overhead_s: the executor's fixed cost per micro-batch beyond the stage's forward
    and backward (headers and tensor sends per micro-batch, progress messages, the executor's
    Python loop, waking the compute thread). It cannot be timed in this one process: it starts
    at RUNTIME_OVERHEAD_S (measured on the 2-core CPU VM of tools/bench/RESULTS.md) and the
    calibration run scales it with the compute terms; pass runtime_overhead_s to override;
  - calibration (calibrate_steps > 0, the default): a short real run of the pipeline, one pinned
    worker per section, scales each section's costs by its measured busy time over the
    profile's prediction (runtime/calibration.py);
  - planning_s: one wavefront plan of the global batch, which the coordinator computes every step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from maestro_flow.config import Pipeline
from maestro_flow.errors import PipelineError
from maestro_flow.graph import SectionGraph
from maestro_flow.parallel.fsdp import largest_unit_bytes
from maestro_flow.parallel.tp import tp_share
from maestro_flow.planner.cost import charged
from maestro_flow.runtime.build import build_stage, default_dtype, load_pipeline, resolve_device
from maestro_flow.runtime.checks import check_pipeline
from maestro_flow.runtime.costfile import apply_cost_file, load_cost_file, write_cost_file
from maestro_flow.runtime.profile_fit import fit_section
from maestro_flow.samples import SampleMeta
from maestro_flow.stage import MicroBatch

__all__ = ["ProfileOptions", "profile_pipeline", "load_cost_file", "apply_cost_file", "default_sizes"]

MB = 1 << 20
# The executor's fixed cost per micro-batch beyond the stage's compute, measured on the 2-core CPU
# VM of tools/bench/RESULTS.md (2026-11-22): the median over the busy time of real runs of
# pipelines/distill.py and vlm.py minus the profiled compute of the micro-batches they ran,
# divided by the micro-batches (see tools/bench/tune_report.py --calibrate).
RUNTIME_OVERHEAD_S = 0.5e-3


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    overrides: dict[str, Any]
    out: str | None = None  # default runs/costs-NAME.json
    sizes: tuple[int, ...] | None = None  # micro-batch sizes; default per section (default_sizes)
    repeats: int = 3
    threads: int | None = None  # torch CPU threads; default MAESTRO_WORKER_THREADS or 1 (see below)
    log: Any = None  # callable(str) for progress lines, or None
    runtime_overhead_s: float | None = None  # per micro-batch; default RUNTIME_OVERHEAD_S
    calibrate_steps: int = 14  # a real run of this many steps calibrates the costs (runtime/calibration.py); 0: none


def default_sizes(micro_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, ... up to twice the section's micro-batch (at least 8)."""
    top, out, m = max(8, 2 * micro_batch), [], 1
    while m <= top:
        out.append(m)
        m *= 2
    return tuple(out)


def _size(s: SampleMeta) -> int:
    return s.num_tokens + s.num_patches + s.num_frames


def _spread(samples: list[SampleMeta], n: int) -> list[SampleMeta]:
    """`n` samples evenly spaced over the size order (all of them when there are fewer)."""
    ordered = sorted(samples, key=lambda s: (_size(s), s.id))
    if len(ordered) <= n:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / (n - 1))] for i in range(n)] if n > 1 else ordered[:1]


class _RssPeak:
    """Peak resident memory above the starting point while the block runs (CPU method)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> _RssPeak:
        _malloc_trim()
        self.start = self.peak = self._rss()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="maestro-rss")
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.peak = max(self.peak, self._rss())

    @property
    def grown_mb(self) -> float:
        return max(0, self.peak - self.start) / MB


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _CudaPeak:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> _CudaPeak:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device)

    @property
    def grown_mb(self) -> float:
        return max(0, self.peak - self.start) / MB


class _Section:
    """One section's stage plus how to feed it (columns from the dataset, inputs from producers)."""

    def __init__(self, pipeline: Pipeline, graph: SectionGraph, name: str, source: Any) -> None:
        self.name, self.graph, self.source = name, graph, source
        self.mixed_precision = pipeline.mixed_precision
        self.section = graph.sections[name]
        self.device = torch.device(resolve_device(self.section, 0))
        self.stage = build_stage(pipeline, self.section, 0, str(self.device))
        self.is_loss = name in graph.loss_sections()
        self.grad_names = {t for e in graph.inputs(name) if e.carries_grad for t in e.edge.tensors}
        self.out_names = [t for e in graph.outputs(name) for t in e.edge.tensors]

    def batch(self, mb: Sequence[SampleMeta], outputs: dict[tuple[int, str], torch.Tensor | None]) -> MicroBatch:
        from maestro_flow.runtime.executor_state import to_torch as _to_torch

        raw = self.source.read([s.row for s in mb], self.section.columns)
        columns = {k: [_to_torch(k, v) for v in vals] for k, vals in raw.items()}
        inputs: dict[str, list[torch.Tensor | None]] = {}
        for e in self.graph.inputs(self.name):
            producer = self.graph.sections[e.edge.src]
            for t in e.edge.tensors:
                column = []
                for s in mb:
                    x = outputs.get((s.id, t)) if producer.activates(s.modalities) else None
                    if x is not None:
                        x = x.detach().clone()
                        if self.section.trainable and t in self.grad_names and x.is_floating_point():
                            x.requires_grad_(True)
                    column.append(x)
                inputs[t] = column
        return MicroBatch(step=0, index=0, sample_ids=[s.id for s in mb], modalities=[s.modalities for s in mb],
                          columns=columns, inputs=inputs)

    def forward(self, batch: MicroBatch) -> dict[str, Any]:
        from maestro_flow.runtime.precision import compute

        with torch.set_grad_enabled(self.section.trainable), compute(self.mixed_precision, self.device):
            return self.stage.forward(batch)

    def backward(self, out: dict[str, Any]) -> None:
        if self.is_loss:
            out["loss"].backward()
            return
        total = None
        for t in self.out_names:
            for x in out.get(t, ()):
                if x is not None and x.requires_grad:
                    total = x.sum() if total is None else total + x.sum()
        if total is not None:
            total.backward()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def param_mb(self, trained: bool = False) -> float:
        """The stage's parameters; `trained`: those that get gradients (a trainable stage may hold frozen ones)."""
        return sum(p.numel() * p.element_size() for p in self.stage.parameters() if p.requires_grad or not trained) / MB

    def zero_grad(self, keep: bool = False) -> None:
        """`keep`: zero the gradients in place (they stay allocated, as they do in a run)."""
        for p in self.stage.parameters():
            if keep and p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = None


def _produce(sec: _Section, samples: list[SampleMeta], outputs: dict) -> None:
    """Run a producer on `samples` (its micro-batch at a time) and keep its outgoing tensors."""
    mine = [s for s in samples if sec.section.activates(s.modalities)]
    step = sec.section.micro_batch
    from maestro_flow.runtime.precision import compute

    with torch.no_grad(), compute(sec.mixed_precision, sec.device):
        for i in range(0, len(mine), step):
            mb = mine[i:i + step]
            out = sec.stage.forward(sec.batch(mb, outputs))
            for t in sec.out_names:
                for s, x in zip(mb, out[t], strict=True):
                    outputs[(s.id, t)] = None if x is None else x.detach()


def _measure(sec: _Section, mb: list[SampleMeta], outputs: dict, repeats: int) -> dict[str, Any]:
    fwd, bwd, peak = [], [], 0.0
    # The first call warms up (allocator, lazy init, the gradients' memory) and is not kept: the
    # peaks kept are what a micro-batch adds to the training state (fit_section counts the state).
    for r in range(repeats + 1):
        sec.zero_grad(keep=True)
        meter = _CudaPeak(sec.device) if sec.device.type == "cuda" else _RssPeak()
        with meter:
            t0 = time.perf_counter()
            out = sec.forward(sec.batch(mb, outputs))
            sec.sync()
            t1 = time.perf_counter()
            if sec.section.trainable:
                sec.backward(out)
                sec.sync()
            t2 = time.perf_counter()
            del out
        if r:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            peak = max(peak, meter.grown_mb)
    sec.zero_grad()
    # Counted as the section's Cost charges them (fit_section recounts them if padding is detected).
    _, tokens, patches, frames = charged(sec.section.cost, mb)
    return {"micro_batch": len(mb), "samples": len(mb), "tokens": tokens, "patches": patches, "frames": frames,
            "sizes": [[s.num_tokens, s.num_patches, s.num_frames] for s in mb],
            "forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd) if sec.section.trainable else 0.0,
            "peak_mb": peak}


def profile_pipeline(path: str, options: ProfileOptions) -> dict[str, Any]:
    """Profile every section of the pipeline file `path` in a worker process of its own; write
    and return the cost file.

    The measurements run where a worker runs: a process started with spawn (none of the
    caller's threads, imports or allocator state), pinned to one core with `threads` torch
    threads, as `maestro run --pin-cpus` runs a worker that has a core of its own. Its progress
    lines and its result come back over a queue; an error in it is raised here (PipelineError
    for bad input, else RuntimeError with its traceback)."""
    import multiprocessing as mp
    import queue as queue_module

    log = options.log or (lambda _msg: None)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_profile_worker, args=(path, dataclasses.replace(options, log=None), results),
                        name="maestro-profile", daemon=True)
    child.start()
    try:
        while True:
            try:
                kind, body = results.get(timeout=1.0)
            except queue_module.Empty:
                if child.exitcode is not None:
                    raise RuntimeError(f"the profiling worker exited with code {child.exitcode} without a result") from None
                continue
            if kind == "log":
                log(body)
            elif kind == "input":
                raise PipelineError(body)
            elif kind == "error":
                raise RuntimeError(f"profiling failed in its worker process:\n{body}")
            else:
                data = body
                break
    finally:
        child.join(5.0)
        if child.exitcode is None:
            child.kill()
            child.join(5.0)
    write_cost_file(data["path"], {k: v for k, v in data.items() if k != "path"})
    if options.calibrate_steps > 0:
        from maestro_flow.runtime.calibration import calibrate

        data["calibration"] = calibrate(path, options.overrides, data["path"], steps=options.calibrate_steps, log=log)
        with open(data["path"]) as f:
            data["sections"] = json.load(f)["sections"]
    return data


def _profile_worker(path: str, options: ProfileOptions, results: Any) -> None:
    """The profiling worker process (see profile_pipeline)."""
    import traceback

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])
    try:
        data = _profile_here(path, dataclasses.replace(options, log=lambda msg: results.put(("log", msg))))
        results.put(("ok", data))
    except PipelineError as exc:
        results.put(("input", str(exc)))
    except Exception:
        results.put(("error", traceback.format_exc()))


def _profile_here(path: str, options: ProfileOptions) -> dict[str, Any]:
    """Profile in this process (the worker's body); return the cost file's data and its path."""
    log = options.log or (lambda _msg: None)
    pipeline, _ = load_pipeline(path, options.overrides)
    single = pipeline.override(**{f"sections.{s.name}.dp": 1 for s in pipeline.sections})
    checked = check_pipeline(single)
    graph = checked.graph
    sizes = {n: tuple(options.sizes) if options.sizes else default_sizes(graph.sections[n].micro_batch)
             for n in graph.order}
    # A pool per section spread over the size range: three micro-batches of the largest size.
    pools = {}
    for n in graph.order:
        mine = [s for s in checked.metadata if graph.sections[n].activates(s.modalities)]
        pools[n] = _spread(mine, 3 * max(sizes[n]))
    # A CPU worker runs with cpu_count // workers threads (worker.py); one thread measures the
    # cost of one worker on one core, which is what a budget of one core per worker gives.
    threads = options.threads or int(os.environ.get("MAESTRO_WORKER_THREADS", "0")) or 1
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        report = _profile(single, graph, checked, sizes, pools, options, log)
    finally:
        torch.set_num_threads(previous_threads)
    data = {"pipeline": pipeline.name, "machine": {**machine_info(), "torch_threads": threads,
                                                   "cores": len(os.sched_getaffinity(0))},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "repeats": options.repeats,
            "planning_s": _planning_s(pipeline, graph, list(checked.metadata), options.repeats),
            "sections": report}
    data["path"] = options.out or os.path.join("runs", f"costs-{pipeline.name}.json")
    return data


def _profile(single: Pipeline, graph: SectionGraph, checked: Any, sizes: dict[str, tuple[int, ...]],
             pools: dict[str, list[SampleMeta]], options: ProfileOptions, log: Any) -> dict[str, Any]:
    needed = {s.id: s for pool in pools.values() for s in pool}
    samples = sorted(needed.values(), key=lambda s: s.id)
    report: dict[str, Any] = {}
    outputs: dict[tuple[int, str], torch.Tensor | None] = {}
    with default_dtype(getattr(torch, single.dtype)):
        built = {}
        for n in graph.order:
            built[n] = sec = _Section(single, graph, n, checked.source)
            if graph.outputs(n):
                _produce(sec, samples, outputs)
        for n in graph.order:
            sec, pool = built[n], pools[n]
            if not pool:
                log(f"{n}: no sample in the dataset activates this section; keeping its cost")
                continue
            rows = []
            for m in sizes[n]:
                m = min(m, len(pool))
                starts = sorted({0, (len(pool) - m) // 2, len(pool) - m})
                mbs = [pool[start:start + m] for start in starts]
                if m > 1:  # and one of mixed lengths, spread over the pool: what padding costs
                    mbs.append(pool[::max(1, len(pool) // m)][:m])
                for mb in mbs:
                    rows.append(_measure(sec, mb, outputs, options.repeats))
                log(f"{n}: micro-batch {m}: forward {statistics.median(r['forward_s'] for r in rows[-len(mbs):]) * 1e3:.1f} ms")
            fitted = fit_section(sec.section.cost, rows, sec.section.trainable, sec.param_mb(),
                                 sec.section.optimizer, sec.param_mb(trained=True))
            pad = fitted["padding"]
            if pad["detected"] != pad["declared"]:
                follows = ("the longest sample of each micro-batch (padding)" if pad["detected"]
                           else "each sample's own length (no padding)")
                log(f"{n}: its time follows {follows}, not what its Cost says (padded={pad['declared']}): "
                    f"the cost file says padded={pad['detected']}")
            if sec.section.trainable:
                fitted["step_overhead_s"] = _time_optimizer_step(sec, pool[:sec.section.micro_batch], outputs,
                                                                 options.repeats)
                fitted["grad_mb"] = sec.param_mb(trained=True)
                log(f"{n}: optimizer step {fitted['step_overhead_s'] * 1e3:.1f} ms ({fitted['grad_mb']:.1f} MB of gradients)")
            else:
                fitted["step_overhead_s"], fitted["grad_mb"] = 0.0, 0.0
            fitted["param_mb"], fitted["tp_share"] = sec.param_mb(), tp_share(sec.stage, sec.section)
            fitted["unit_mb"] = largest_unit_bytes(sec.stage) / MB
            fitted["runtime_overhead_s"] = (RUNTIME_OVERHEAD_S if options.runtime_overhead_s is None
                                            else options.runtime_overhead_s)
            report[n] = {**fitted, "device": str(sec.device),
                         "memory_method": "cuda max_memory_allocated" if sec.device.type == "cuda"
                         else "process RSS peak (1 ms sampling, after malloc_trim)",
                         "measurements": rows}
    return report


def _time_optimizer_step(sec: _Section, mb: list[SampleMeta], outputs: dict, repeats: int) -> float:
    """The executor's end-of-step work on the real stage (optim.stepper, without a DP group):
    divide by the denominator, measure the norm, optimizer step, zero_grad, schedule."""
    from maestro_flow.optim.stepper import SectionOptimizer

    params = [p for p in sec.stage.parameters() if p.requires_grad]
    if not params:
        return 0.0
    optim = SectionOptimizer(dict(sec.section.optimizer), params, total_steps=repeats + 1)
    times = []
    for r in range(repeats + 1):
        sec.zero_grad()
        out = sec.forward(sec.batch(mb, outputs))
        sec.backward(out)
        del out
        sec.sync()
        t0 = time.perf_counter()
        optim.reduce()
        optim.divide(float(len(mb)))
        optim.sq_norm()
        optim.step()
        sec.sync()
        if r:
            times.append(time.perf_counter() - t0)
    sec.zero_grad()
    return statistics.median(times)


def _planning_s(pipeline: Pipeline, graph: SectionGraph, metadata: list[SampleMeta], repeats: int) -> float:
    """Seconds for one plan of a global batch (the coordinator plans every step)."""
    from maestro_flow.planner import make_planner
    from maestro_flow.planner.cost import CostModel

    if not metadata:
        return 0.0
    batch = metadata[:pipeline.global_batch]
    # The rules alone: a run's search (planner/refine.py) runs only on a core of its own, ahead of
    # the step (runtime/cpus.search_share; a plan held back at a checkpoint aside), so it is not
    # part of the step's planning time.
    planner = make_planner(pipeline.schedule, graph, CostModel(costs={s.name: s.cost for s in pipeline.sections}),
                           search=0.0)
    times = []
    for step in range(repeats + 1):
        t0 = time.perf_counter()
        planner.plan(step, batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def machine_info() -> dict[str, Any]:
    info = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
