"""`maestro profile`, `maestro tune`, `maestro export` and `maestro top` (click commands registered by cli.py).

Thin: parse, call runtime/profiling.py, runtime/tuning.py, checkpoint/export.py or runtime/status.py, print. Errors a
user can fix print one line ("error: ...") and exit 2, as in cli.py; a profile that failed (ProfilingError) prints one line naming the
section, phase and exception and exits 1, its traceback (formatted in the profiling worker) shown with --debug.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from collections.abc import Sequence

import click

from maestro_flow.cli_sets import set_options
from maestro_flow.errors import MaestroError, PipelineError
from maestro_flow.overrides import parse_set, with_global_batch
from maestro_flow.runtime.calibration import WARMUP_STEPS

SETS = set_options("global_batch=8")


def _fail(ctx: click.Context, exc: MaestroError) -> None:
    if (ctx.obj or {}).get("debug"):
        raise exc
    click.echo(f"error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, PipelineError) else 1)


def _sizes(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:  # found in QA: '' and '1,,2' were taken (as the default sizes, and as 1,2)
        sizes = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        raise PipelineError(f"--sizes expects comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise PipelineError(f"--sizes must list integers >= 1, got {text!r}")
    return sizes


def _positive_gb(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not (0 < value < math.inf):  # NaN fails this too
        raise click.BadParameter(f"must be a finite number of GiB > 0, got {value!r}")
    return value


def _with_sets(pipeline: str, sets: Sequence[str], global_batch: int | None = None) -> str:
    """PIPELINE and the overrides it was given, as a command line's words (for the commands printed)."""
    return " ".join([shlex.quote(pipeline), *(f"--set {shlex.quote(s)}" for s in with_global_batch(sets, global_batch))])


@click.command()
@click.argument("pipeline", type=click.Path(dir_okay=False))
@SETS
@click.option("--out", type=click.Path(dir_okay=False), help="Cost file to write [default: runs/costs-NAME.json].")
@click.option("--sizes", metavar="1,2,4", help="Micro-batch sizes to time [default: 1, 2, 4, ... up to twice "
                                               "each section's micro_batch, at least 8].")
@click.option("--repeats", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Timed calls per micro-batch (the median is kept), after one warm-up call.")
@click.option("--calibrate-steps", type=click.IntRange(0, 1000), default=14, show_default=True,
              help=f"Measured steps of a real calibration run (every section at dp 1, pinned workers; it runs "
                   f"{WARMUP_STEPS} warm-up steps more, not measured) whose busy time scales each section's costs "
                   f"(0: no calibration run).")
@click.pass_context
def profile(ctx: click.Context, pipeline: str, sets: tuple[str, ...], out: str | None, sizes: str | None,
            repeats: int, calibrate_steps: int) -> None:
    """Measure each section of PIPELINE: time per micro-batch and peak memory, in a worker process.

    Every section runs on real dataset rows (downstream sections on their producers' real
    outputs) at several micro-batch sizes and input sizes, in one worker process pinned to one
    core; the fitted costs (seconds per micro-batch, sample, token, patch, frame; backward
    factor) and a memory model go to a JSON cost file for `maestro tune --costs FILE` (and the
    planner). Then a short real run calibrates the costs against what the workers measure.
    """
    from maestro_flow.runtime.profiling import ProfileOptions, profile_pipeline

    try:
        data = profile_pipeline(pipeline, ProfileOptions(overrides=parse_set(sets), out=out, sizes=_sizes(sizes),
                                                         repeats=repeats, calibrate_steps=calibrate_steps,
                                                         log=lambda msg: click.echo(msg, err=True)))
    except MaestroError as exc:
        worker_traceback = getattr(exc, "traceback", None)  # ProfilingError: formatted where it was raised
        if worker_traceback and (ctx.obj or {}).get("debug"):
            click.echo(worker_traceback.rstrip(), err=True)
        elif worker_traceback:
            click.echo(f"error: {exc}\n(the traceback: maestro --debug profile ...)", err=True)
            sys.exit(1)
        _fail(ctx, exc)
        return
    for name, body in data["sections"].items():
        click.echo(profile_line(name, body))
    click.echo(f"planning: {data['planning_s'] * 1e3:.2f} ms per step")
    click.echo(f"wrote {data['path']}  (use: maestro tune {_with_sets(pipeline, sets)} --devices N --costs "
               f"{shlex.quote(data['path'])})")  # with the --sets (found in QA: a data.path given was dropped)


def profile_line(name: str, body: dict) -> str:
    """One section's measured costs as `maestro profile` prints them. A frozen section has no
    backward, so its backward_factor (the Cost default, not a measurement) is left out."""
    frozen = not body.get("profiled_with", {}).get("trainable", True)
    terms = ", ".join(("padded" if k == "padded" else f"{k}={v:.3g}") for k, v in body["cost"].items()
                      if v and not (frozen and k == "backward_factor"))
    step = f"; optimizer step {body['step_overhead_s'] * 1e3:.2f} ms" if body.get("step_overhead_s") else ""
    message = f", {body['message_s'] * 1e3:.2f} ms per message received" if body.get("message_s") else ""
    return (f"{name}: {terms}; overhead/micro-batch {body['micro_batch_overhead_s'] * 1e3:.2f} ms "
            f"+ runtime {body['runtime_overhead_s'] * 1e3:.2f} ms{message}{step}; "
            f"memory {body['memory_base_mb']:.0f} MiB + {body['peak_memory_mb_per_sample']:.1f} MiB/sample")


@click.command()
@click.argument("pipeline", type=click.Path(dir_okay=False))
@SETS
@click.option("--devices", type=int, required=True, help="Device budget: workers (CPU) or GPUs in all.")
@click.option("--memory-gb", type=float, callback=_positive_gb, help="Memory limit per device, in GiB (2**30 bytes; checked with a --costs memory model).")
@click.option("--costs", type=click.Path(dir_okay=False), help="Cost file from `maestro profile`.")
@click.option("--top", type=click.IntRange(1, 50), default=3, show_default=True, help="Configurations to show.")
@click.option("--global-batch", type=click.IntRange(min=1), help="Tune for this global batch instead of the pipeline's.")
@click.option("--trace-in", type=click.Path(dir_okay=False, exists=True),
              help="Sample metadata (JSON Lines of {id, modalities, num_tokens, and num_patches / num_frames "
                   "for a sample with an image / audio}) instead of the dataset's; resampled to the global batch.")
@click.option("--write", "write_to", type=click.Path(dir_okay=False),
              help="Write the best configuration's overrides here, one '--set KEY=VALUE' per line.")
@click.option("--cpu-cores", type=click.IntRange(min=1),
              help="Cores the CPU workers share (contention is modelled when workers exceed them) "
                   "[default: the cores this process may use when every section is on the CPU, else not "
                   "modelled].")
@click.option("--max-tp", type=click.IntRange(min=1),
              help="Largest tensor parallelism searched for sections whose stage has a tp_plan (1: none) "
                   "[default: 8 for sections on GPUs, 1 for sections on the CPU, where gloo's all-reduces "
                   "cost more than tp saves].")
@click.option("--tp-efficiency", type=click.FloatRange(0.05, 1.0),
              help="Speed of a tp-rank replica relative to tp single ranks (its all-reduces cost the rest) "
                   "[default: 0.8 for sections on GPUs; on the CPU a replica counts as no faster than one rank].")
@click.option("--batches", type=click.IntRange(1, 1000),
              help="Representative global batches each configuration is simulated on (their mean is its "
                   "step) [default: enough for 256 samples, at most 16].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def tune(ctx: click.Context, pipeline: str, sets: tuple[str, ...], devices: int, memory_gb: float | None,
         costs: str | None, top: int, global_batch: int | None, trace_in: str | None, write_to: str | None,
         cpu_cores: int | None, max_tp: int | None, tp_efficiency: float | None, batches: int | None,
         as_json: bool) -> None:
    """Search each section's dp, micro-batch size, tp and fsdp for PIPELINE within a device budget.

    Every configuration that fits the budget, the memory limit and integral fan-out/fan-in across
    each edge is a candidate (tp for sections whose stage has a tp_plan; FSDP where a section
    does not fit the memory limit without it); the best (shortest simulated step, planned with
    the pipeline's schedule) are shown side by side with each section's utilisation, next to
    the best uniform configuration (one dp and micro-batch for every section). --write saves the
    winner for `maestro run` (give it the same --costs, so that it plans with what tune predicted):

    \b
      maestro tune pipelines/vlm.py --devices 4 --costs runs/costs-vlm.json --write best.txt
      maestro run pipelines/vlm.py --set-file best.txt --costs runs/costs-vlm.json
    """
    import json

    from maestro_flow.runtime.tuning import TuneOptions, format_result, tune_pipeline, write_overrides

    try:
        if write_to:  # before the search, not after (found in review: a traceback once it was done)
            from maestro_flow.runtime.outputs import check_writable

            check_writable(write_to, "--write", folder=False)
        result, notes = tune_pipeline(pipeline, TuneOptions(overrides=parse_set(sets), devices=devices,
                                                            memory_gb=memory_gb, costs=costs,
                                                            global_batch=global_batch, trace_in=trace_in, top=top,
                                                            cpu_cores=cpu_cores, max_tp=max_tp,
                                                            tp_efficiency=tp_efficiency, batches=batches))
        if write_to:
            try:
                write_overrides(write_to, result.best[0], global_batch, sets)
            except OSError as exc:  # the disk filled, or the folder went away, meanwhile
                raise PipelineError(f"--write {write_to}: {exc.strerror or exc}") from None
    except MaestroError as exc:
        _fail(ctx, exc)
        return
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(json.dumps({**result.to_json_dict(), "notes": notes}, indent=1))
    else:
        click.echo(format_result(result, path=_with_sets(pipeline, sets, global_batch)))
    if write_to:
        with_costs = f" --costs {shlex.quote(costs)}" if costs else ""  # found in QA: run planned with declared costs
        click.echo(f"wrote {write_to}; run it with: maestro run {shlex.quote(pipeline)} "
                   f"--set-file {shlex.quote(write_to)}{with_costs}", err=True)


@click.command()
@click.argument("source")  # checked by export_section, which names the checkpoints there when it is missing
@click.option("--section", required=True, help="The trainable section to export.")
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="Folder to write (created if needed).")
@click.pass_context
def export(ctx: click.Context, source: str, section: str, out: str) -> None:
    """Write SECTION's trained parameters from SOURCE — a checkpoint (a step-N folder, e.g. ckpt/step-200,
    or a folder of them: the newest complete one) or a --save-dir — to OUT/SECTION.safetensors.

    A section whose stage owns a Hugging Face model (stages.hf:HFCausalLM) is also written as a
    Hugging Face folder: config.json and model.safetensors, which
    transformers.AutoModelForCausalLM.from_pretrained(OUT) loads.
    """
    from maestro_flow.checkpoint.export import export_section

    try:
        done = export_section(source, section, out)
    except MaestroError as exc:
        _fail(ctx, exc)
        return
    except OSError as exc:  # a full disk (a traceback before)
        _fail(ctx, MaestroError(f"-o {out}: cannot write the export: {exc.strerror or exc}"))
        return
    click.echo(f"from {done.source}:")
    for path in done.files:
        click.echo(f"wrote {path}")
    if done.note:
        click.echo(f"note: {done.note}", err=True)


@click.command()
@click.argument("run_dir", required=False, type=click.Path(file_okay=False))
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit (at once, exit 2, when no run is there to answer).")
@click.option("--json", "as_json", is_flag=True,
              help="Print each snapshot as one line of JSON (the run's own status snapshot, its fields listed "
                   "above) instead of the screen; the end as {\"ended\": ..., \"code\": ...}.")
def top(run_dir: str | None, interval: float, once: bool, as_json: bool) -> None:
    """Watch a running pipeline: step, loss, step time, and what each worker is doing now.

    RUN_DIR is the run's directory (printed by maestro run); by default the most recent running
    one under runs/. With no run there yet, or one that has ended (said how), top waits up to a
    minute for one to start there. Read-only: attaching and detaching (Ctrl-C) never disturbs the run.
    When the run it watches ends, top says how and exits as the run did: 0 finished, 1 failed or
    killed, 130 interrupted (Ctrl-C on top itself exits 0).

    \b
    --json snapshot fields (a field may be missing or null where not known yet):
      starting      true while no worker has reported yet (the only field then)
      pipeline, steps, restarts   its name, its steps in all, this run's automatic restarts
      step          the steps done (the index, from 0, of the step the coordinator awaits)
      loss          the last step's loss (a number, or one per loss term); step_time_s its seconds
      phase         during startup: what the workers are awaited for
      workers       one per rank: name, rank, state, step (index, from 0), mb, busy_fraction,
                    buffered (inputs held), in_flight, status_s (its last report's age), seen_s
    While a restarting run does not answer: {"waiting": "..."}.
    """
    from maestro_flow.runtime.report import json_line
    from maestro_flow.runtime.status import START_WAIT_S, end_code, ended, find_run, query, render

    try:
        path = find_run(run_dir, wait_s=0 if once else START_WAIT_S, say=lambda text: click.echo(text, err=True))
        shown = False
        while True:
            try:
                snapshot = query(path)
                try:
                    text = render(snapshot)
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    raise FileNotFoundError(f"{path}: the run's answer is not a status snapshot top can show "
                                            f"({type(exc).__name__}: {exc})") from None
            except (FileNotFoundError, TimeoutError) as exc:
                if shown and (done := ended(path)) is not None:  # it finished (or failed) while watched
                    code = end_code(path)
                    click.echo(json.dumps({"ended": done, "code": code}) if as_json else done)
                    sys.exit(code)
                if once or not shown or not isinstance(exc, TimeoutError):
                    raise
                text = f"waiting for the run to answer: {exc}"  # its coordinator lives: keep watching
                snapshot = {"waiting": text}
            if as_json:  # strict JSON: a diverged loss is null, as in metrics.jsonl (found in review: NaN)
                click.echo(json_line(snapshot).decode().rstrip("\n"))
                if once:
                    return
            elif once:
                click.echo(text)
                return
            else:
                click.echo("\x1b[2J\x1b[H" + f"{path}\n" + text)
            shown = True
            time.sleep(interval)
    except (FileNotFoundError, TimeoutError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        return
