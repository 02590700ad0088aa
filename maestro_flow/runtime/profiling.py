"""`maestro profile`: measure each section's time per micro-batch and its peak memory, fit costs.

Runs in a worker process the CLI process starts (spawn, pinned to one core: `profile_pipeline`),
every section in that one process (like colocated mode): each section's stage is built with
dp=1 on its own device, fed real dataset rows (entry sections) or
the real outputs of its producers (run first on the same samples; detached, and marked
requires_grad where the edge carries gradients, as the executor does).

What is measured, per section and per micro-batch size: the micro-batches profile_fit picks
(default_sizes, spread, micro_batches: smallest, middle, largest and mixed lengths from a pool
spread over the dataset's size range), each timed `repeats` times after one warm-up call,
keeping the median, counted as the cost model charges it (planner/cost.charged):
  - forward: building the micro-batch (reading and converting its rows, as the executor's
    timing does) + `stage.forward` (under no_grad for frozen sections);
  - backward (trainable sections): the loss's backward for a loss section, else the backward of
    the sum of the section's outgoing tensors.
The fit (costs, fixed cost, padding detected from the times, memory): runtime/profile_fit.py.

Peak memory per micro-batch (runtime/memory_peak.py): on CUDA, torch.cuda.max_memory_allocated
above the allocation before the call; on CPU, the process RSS sampled every millisecond during
the call, above the RSS before it (approximate). param_mb and tp_share (the share of it the
stage's tp_plan shards) let `maestro tune` model tp and FSDP.

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
  - message_s (CPU sections): the worker's own time per tensor message it receives, which the
    tuner charges per message (planner/simulate.message_counts); MESSAGE_S, scaled by the
    calibration like runtime_overhead_s, and 0 on a GPU;
  - calibration (calibrate_steps > 0): a short real run scales each section's costs
    (runtime/calibration.py);
  - planning_s: one wavefront plan of the global batch, which the coordinator computes every step.

Failures: MAESTRO_WORKER_THREADS and --out are checked before the worker starts; an exception in
the worker comes back as data (ProfilingError: the section, what it was doing, the traceback
formatted there), a forward whose outputs a run would refuse (stage.output_problem) included;
the cost file is written (runtime/costfile.staged) only when the profile and its calibration
both succeeded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from maestro_flow.config import Pipeline
from maestro_flow.errors import MaestroError, PipelineError, StageError, SystemFailure, traceback_tail
from maestro_flow.graph import SectionGraph
from maestro_flow.parallel.fsdp import largest_unit_bytes
from maestro_flow.parallel.tp import tp_share
from maestro_flow.planner.cost import charged
from maestro_flow.runtime import cpus
from maestro_flow.runtime.build import default_dtype, load_pipeline
from maestro_flow.runtime.checks import check_pipeline
from maestro_flow.runtime.costfile import check_out, profiled_with, staged, write_cost_file
from maestro_flow.runtime.memory_peak import MB, peak_meter
from maestro_flow.runtime.profile_fit import default_sizes, fit_section, micro_batches, planning_s, spread
from maestro_flow.runtime.replay_runner import SectionRunner
from maestro_flow.samples import SampleMeta
from maestro_flow.stage import MicroBatch

__all__ = ["ProfileOptions", "ProfilingError", "profile_pipeline"]  # the cost file itself: runtime/costfile.py

# The executor's fixed cost per micro-batch beyond the stage's compute, measured on the 2-core CPU
# VM of tools/bench/RESULTS.md (2026-11-22): the median over the busy time of real runs of
# pipelines/distill.py and vlm.py minus the profiled compute of the micro-batches they ran,
# divided by the micro-batches (see tools/bench/tune_report.py --calibrate).
RUNTIME_OVERHEAD_S = 0.5e-3
# A CPU worker's own time per tensor message it receives (its header thread on the worker's
# core, the executor gathering a micro-batch's inputs from it), measured on the same VM
# (2026-11-30, tools/bench/RESULTS.md 11.6): pipelines/vlm.py at llm dp 1 x 8, the encoder's
# micro-batch 1 or 2 alternated with 8, the LLM's CPU time per step grew 0.25-0.39 ms per extra
# message it received (pooled means over the steps; per-run medians 0.17-0.33 ms; 4 against 8,
# only 0.8 messages apart, was within noise). RUNTIME_OVERHEAD_S was fitted on busy time that
# held some of this already, so the two may overlap a little; the calibration scales both.
# The tuner charges it where messages are counted (planner/simulate.py). On a GPU section it
# is taken as 0 (the host's receiving assumed to overlap the device's compute; not measured).
MESSAGE_S = 0.3e-3
PROGRESS_S = 10.0  # a size whose micro-batches take longer says how many of them are measured


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    overrides: dict[str, Any]
    out: str | None = None  # default runs/costs-NAME.json
    sizes: tuple[int, ...] | None = None  # micro-batch sizes; default per section (default_sizes)
    repeats: int = 3
    threads: int | None = None  # torch CPU threads; default MAESTRO_WORKER_THREADS or 1 (worker_threads)
    log: Any = None  # callable(str) for progress lines, or None
    runtime_overhead_s: float | None = None  # per micro-batch; default RUNTIME_OVERHEAD_S
    calibrate_steps: int = 14  # measured steps of a real run (after its warm-up) calibrate the costs; 0: none


class ProfilingError(MaestroError):
    """Profiling failed: in `section` (None: outside any section) during `phase` ("forward at
    micro-batch 4"), with `traceback` formatted as text in the process that raised. Its message
    is one line: where, and the exception with its notes (errors.traceback_tail: a note such as
    the vision stage's ways out of a corrupt image is a line of its own)."""

    def __init__(self, *, section: str | None, phase: str, traceback: str) -> None:
        self.section, self.phase, self.traceback = section, phase, traceback
        where = f"section {section!r} during {phase}" if section else phase
        super().__init__(f"profiling failed in {where}: {traceback_tail(traceback) or 'no traceback'}")


def worker_threads(threads: int | None) -> int:
    """The profiling worker's torch threads: `threads`, else MAESTRO_WORKER_THREADS, else 1."""
    if threads:
        return threads
    try:
        return cpus.env_threads() or 1
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


class _Section(SectionRunner):
    """One section's stage, built and run as replay's runner builds and runs it, plus how to feed
    it (columns from the dataset, inputs from producers) and what profiling measures of it."""

    def __init__(self, pipeline: Pipeline, graph: SectionGraph, name: str, source: Any) -> None:
        super().__init__(pipeline, name, graph)
        self.source = source
        self.at: dict[str, Any] = {"section": name, "phase": ""}  # what it is doing (profile_to reports it)
        self.out_names = list(self.carried)

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

    def backward(self, out: dict[str, Any]) -> None:
        self.at["phase"] = self.at["phase"].replace("forward", "backward")
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
    for i in range(0, len(mine), sec.section.micro_batch):
        mb = mine[i:i + sec.section.micro_batch]
        out = sec.forward(sec.batch(mb, outputs), grad=False)
        for t in sec.out_names:
            for s, x in zip(mb, out[t], strict=True):
                outputs[(s.id, t)] = None if x is None else x.detach()


def _measure_size(name: str, sec: _Section, mbs: list[list[SampleMeta]], outputs: dict, repeats: int, log: Any,
                  progress_s: float = PROGRESS_S) -> list[dict[str, Any]]:
    """`_measure` of each of one size's micro-batches, saying how many are done when one took
    more than `progress_s` since the last line (found in QA: `--sizes 100000` measured for
    minutes with no line between sizes)."""
    rows, said = [], time.monotonic()
    for i, mb in enumerate(mbs, 1):
        rows.append(_measure(sec, mb, outputs, repeats))
        if i < len(mbs) and time.monotonic() - said > progress_s:
            log(f"{name}: micro-batch {len(mb)}: {i} of {len(mbs)} measured")
            said = time.monotonic()
    return rows


def _measure(sec: _Section, mb: list[SampleMeta], outputs: dict, repeats: int) -> dict[str, Any]:
    fwd, bwd, peak = [], [], 0.0
    # The first call warms up (allocator, lazy init, the gradients' memory) and is not kept: the
    # peaks kept are what a micro-batch adds to the training state (fit_section counts the state).
    for r in range(repeats + 1):
        sec.at["phase"] = f"forward at micro-batch {len(mb)}"
        sec.zero_grad(keep=True)
        meter = peak_meter(sec.device)
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
    for bad input, else ProfilingError). The file appears only once all succeeded."""
    import multiprocessing as mp
    import queue as queue_module

    log = options.log or (lambda _msg: None)
    options = dataclasses.replace(options, threads=worker_threads(options.threads))
    # Before minutes of work, not after (found in QA: runs/costs.json was checked, not the file written)
    check_out(options.out or default_out(load_pipeline(path, options.overrides)[0].name))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_profile_worker, args=(path, dataclasses.replace(options, log=None), results,
                                                      os.getpid()), name="maestro-profile", daemon=True)
    from maestro_flow.runtime.launcher import ctrl_c_ignored_by_children

    with ctrl_c_ignored_by_children():  # Ctrl-C is the parent's, which kills it (found in review: with SIGINT
        child.start()  # ignored, as a script's background job, a Ctrl-C to the group killed it alone)
    try:
        while True:
            try:
                kind, body = results.get(timeout=1.0)
            except queue_module.Empty:
                if child.exitcode is not None:
                    raise SystemFailure(f"the profiling worker exited with code {child.exitcode} without a "
                                        "result") from None
                continue
            if kind == "log":
                log(body)
            elif kind == "input":
                raise PipelineError(body)
            elif kind == "error":
                raise ProfilingError(**body)
            else:
                data = body
                break
    except KeyboardInterrupt:  # Ctrl-C, or a SIGTERM to this process alone: no result will come (review: 3 s)
        child.kill()
        raise
    finally:
        child.join(5.0)
        if child.exitcode is None:
            child.kill()
            child.join(5.0)
    try:
        return _write(path, data, options, log)
    except OSError as exc:
        if exc.filename is None or os.path.basename(data["path"]) not in os.path.basename(str(exc.filename)):
            raise
        # Found in review: after all the profiling, a traceback (the up-front check cannot foresee
        # every refusal, e.g. /sys for root).
        raise PipelineError(f"--out {data['path']}: cannot write it ({exc.strerror or exc})") from None


def _write(path: str, data: dict[str, Any], options: ProfileOptions, log: Any) -> dict[str, Any]:
    """Write the cost file, calibrated (calibrate_steps > 0), at once; return its data."""
    with staged(data["path"]) as tmp:
        write_cost_file(tmp, {k: v for k, v in data.items() if k != "path"})
        if options.calibrate_steps > 0:
            from maestro_flow.runtime.calibration import calibrate

            try:
                data["calibration"] = calibrate(path, options.overrides, tmp, steps=options.calibrate_steps, log=log)
            except StageError as exc:
                at = "" if exc.step is None else f" at step {exc.step + 1}"
                raise ProfilingError(section=exc.section, phase=f"the calibration run ({exc.phase}{at})",
                                     traceback=exc.traceback) from None
            with open(tmp) as f:
                data["sections"] = json.load(f)["sections"]
    return data


def _profile_worker(path: str, options: ProfileOptions, results: Any, parent_pid: int) -> None:
    """The profiling worker process (see profile_pipeline). It ignores Ctrl-C: its parent takes it
    and kills the worker (found in review: with SIGINT ignored, as in a script's background job, a
    Ctrl-C to the group killed the worker alone); it dies with its parent, as a run's workers do
    (found in review: orphaned by a kill -9, nothing stopped it)."""
    from maestro_flow.runtime.worker import die_with_parent

    die_with_parent(parent_pid)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])
    try:
        profile_to(results.put, path, options, cores=len(cores))
    except KeyboardInterrupt:
        pass


def profile_to(put: Any, path: str, options: ProfileOptions, *, cores: int) -> None:
    """Profile in this process and `put` its messages: ("log", line)..., then ("ok", data), or
    ("input", message) for bad input, or ("error", ProfilingError's fields) for any other
    exception, with the section and phase it was in (`at`, kept up to date as it goes)."""
    import traceback

    at: dict[str, Any] = {"section": None, "phase": "loading and checking the pipeline"}
    try:
        put(("ok", _profile_here(path, dataclasses.replace(options, log=lambda msg: put(("log", msg))), at, cores)))
    except PipelineError as exc:
        put(("input", str(exc)))
    except Exception:
        put(("error", {**at, "traceback": traceback.format_exc()}))


def _profile_here(path: str, options: ProfileOptions, at: dict[str, Any], cores: int) -> dict[str, Any]:
    """Profile in this process (the worker's body); return the cost file's data and its path.
    `cores`: the machine's (this process's, before it was pinned)."""
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
        pools[n] = spread(mine, 3 * max(sizes[n]))
        _note_sizes(n, sizes[n], len(pools[n]), log)
    # A CPU worker runs with cpu_count // workers threads (worker.py); one thread measures the
    # cost of one worker on one core, which is what a budget of one core per worker gives.
    threads = worker_threads(options.threads)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        report, unmeasured = _profile(single, graph, checked, sizes, pools, options, log, at)
    finally:
        torch.set_num_threads(previous_threads)
    at.update(section=None, phase="timing the planner")
    data = {"pipeline": pipeline.name, "machine": {**machine_info(), "torch_threads": threads, "cores": cores},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "repeats": options.repeats,
            "planning_s": planning_s(pipeline, graph, list(checked.metadata), options.repeats),
            "sections": report, "unmeasured": unmeasured}
    data["path"] = options.out or default_out(pipeline.name)
    return data


def default_out(name: str) -> str:
    """The cost file of pipeline `name` where --out is not given."""
    return os.path.join("runs", f"costs-{name}.json")


def _note_sizes(name: str, sizes: tuple[int, ...], available: int, log: Any) -> None:
    """Say when the sizes asked for are not what gets measured (found in review: silently)."""
    if not available:
        return  # said where the section is skipped
    if max(sizes) > available:
        log(f"note: {name}: {available} samples activate it, so micro-batch sizes above {available} are measured "
            f"at {available}")
    if len({min(m, available) for m in sizes}) < 2:
        log(f"note: {name}: one micro-batch size measured, so its fixed cost per micro-batch cannot be told from "
            "its cost per sample and is fitted as 0 (give --sizes two or more sizes)")


def _profile(single: Pipeline, graph: SectionGraph, checked: Any, sizes: dict[str, tuple[int, ...]],
             pools: dict[str, list[SampleMeta]], options: ProfileOptions, log: Any, at: dict[str, Any]
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(section -> its report, section -> why it was not measured); `at` follows the work."""
    needed = {s.id: s for pool in pools.values() for s in pool}
    samples = sorted(needed.values(), key=lambda s: s.id)
    report: dict[str, Any] = {}
    unmeasured: dict[str, Any] = {}
    outputs: dict[tuple[int, str], torch.Tensor | None] = {}
    with default_dtype(getattr(torch, single.dtype)):
        built = {}
        for n in graph.order:
            at.update(section=n, phase="building its stage")
            built[n] = sec = _Section(single, graph, n, checked.source)
            sec.at = at
            if graph.outputs(n):
                at["phase"] = f"forward, producing its outputs (micro-batch {sec.section.micro_batch})"
                _produce(sec, samples, outputs)
        for n in graph.order:
            sec, pool = built[n], pools[n]
            at.update(section=n, phase="measuring")
            if not pool:
                log(f"{n}: no sample in the dataset activates this section; keeping its cost")
                unmeasured[n] = {"reason": "no sample in the dataset activates it",
                                 "profiled_with": profiled_with(single, sec.section)}
                continue
            rows = []
            for m in sizes[n]:
                mbs = micro_batches(pool, m)
                rows += _measure_size(n, sec, mbs, outputs, options.repeats, log)
                log(f"{n}: micro-batch {len(mbs[0])}: forward {statistics.median(r['forward_s'] for r in rows[-len(mbs):]) * 1e3:.1f} ms")
            fitted = fit_section(sec.section.cost, rows, sec.section.trainable, sec.param_mb(),
                                 sec.section.optimizer, sec.param_mb(trained=True))
            pad = fitted["padding"]
            if pad["detected"] != pad["declared"]:
                follows = ("the longest sample of each micro-batch (padding)" if pad["detected"]
                           else "each sample's own length (no padding)")
                log(f"{n}: its time follows {follows}, not what its Cost says (padded={pad['declared']}): "
                    f"the cost file says padded={pad['detected']}")
            if sec.section.trainable:
                at["phase"] = "the optimizer step"
                fitted["step_overhead_s"] = _time_optimizer_step(sec, pool[:sec.section.micro_batch], outputs,
                                                                 options.repeats)
                fitted["grad_mb"] = sec.param_mb(trained=True)
                log(f"{n}: optimizer step {fitted['step_overhead_s'] * 1e3:.1f} ms "
                    f"({fitted['grad_mb']:.1f} MiB of gradients)")
            else:
                fitted["step_overhead_s"], fitted["grad_mb"] = 0.0, 0.0
            fitted["param_mb"], fitted["tp_share"] = sec.param_mb(), tp_share(sec.stage, sec.section)
            fitted["unit_mb"] = largest_unit_bytes(sec.stage) / MB
            fitted["runtime_overhead_s"] = (RUNTIME_OVERHEAD_S if options.runtime_overhead_s is None
                                            else options.runtime_overhead_s)
            fitted["message_s"] = MESSAGE_S if sec.device.type == "cpu" else 0.0
            report[n] = {"profiled_with": profiled_with(single, sec.section), **fitted, "device": str(sec.device),
                         "memory_method": "cuda max_memory_allocated" if sec.device.type == "cuda"
                         else "process RSS peak (1 ms sampling, after malloc_trim)",
                         "measurements": rows}
    return report, unmeasured


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


def machine_info() -> dict[str, Any]:
    info = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
