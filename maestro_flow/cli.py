"""The `maestro` command line (click). Thin: parse, build options, call the runtime.

Errors a user can fix print one clear line and exit non-zero, with no Python traceback unless
`--debug` is given. Exit codes: 0 success, 1 a run failed (stage or system error), 2 bad input,
130 interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from maestro_flow.cli_signals import reopen_closed_streams

reopen_closed_streams()  # first: before anything opens a file on the descriptor of a closed stdout or stderr


def _interrupted_early(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM before a command runs (the imports below, click's parsing): nothing started.
    Found by the clean-clone CI: a Ctrl-C at 0.3 s gave a traceback and SIGINT (-2), not 130; in
    QA: a SIGTERM in `maestro run`'s first 2 s exited 143 in silence."""
    os.write(2, b"interrupted\n")
    os._exit(130)


# Only as the command itself (`maestro`, `python -m maestro_flow.cli`), not where it is imported
# (tests, a spawned worker: its command line is python -c ...).
# An ignored SIGINT (a background job of a script) stays ignored, as Python leaves it (and the
# command itself: cli_signals.interrupts_after_imports).
if __name__ == "__main__" or os.path.basename((getattr(sys, "orig_argv", []) + ["", ""])[1]) == "maestro":
    for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(signum) is default:
            signal.signal(signum, _interrupted_early)

import click  # noqa: E402 (after the handler: importing it takes a while)

from maestro_flow import cli_signals  # noqa: E402
from maestro_flow.cli_sets import set_options  # noqa: E402
from maestro_flow.cli_signals import interrupts_after_imports, outlive_readers, reader_gone  # noqa: E402
from maestro_flow.cli_usage import OptionalValueCommand  # noqa: E402
from maestro_flow.errors import (  # noqa: E402
    MaestroError,
    PipelineError,
    StageError,
    SystemFailure,
    first_line,
    notes_of,
)
from maestro_flow.overrides import parse_set  # noqa: E402
from maestro_flow.runtime.stops import WORKERS_STARTED  # noqa: E402

SETS = set_options("global_batch=8, dtype=float64")


def _fail(exc: BaseException, debug: bool, then: Callable[[], None] | None = None) -> None:
    """The error's line (after its traceback with --debug), then `then` (a note), then the exit."""
    if debug:  # the traceback, then the same line and exit code (found in review: --debug exited 1 on bad input)
        traceback.print_exception(exc, file=sys.stderr)
    click.echo(f"error: {exc}", err=True)
    for note in () if debug else notes_of(exc):  # what the runtime added (savedir.end_save; --debug showed them)
        click.echo(note, err=True)
    if then is not None:
        then()
    from maestro_flow.errors import exit_code_of  # (what `maestro top` exits with too: run.py records it)

    if isinstance(exc, StageError):
        sys.exit(1)
    _exit(exit_code_of(exc))


def _go_on_note(failed: bool = False, term_untaken: bool = False) -> None:
    """Where a stopped or failed run can go on from (checkpointer.go_on_note)."""
    from maestro_flow.checkpoint.checkpointer import go_on_note

    note = go_on_note(failed, term_untaken)
    if note:
        click.echo(note, err=True)


def _exit(code: int) -> None:
    """sys.exit, or os._exit where a store call was given up (a silent node 0: nodes.bounded)."""
    from maestro_flow.runtime.nodes import exit_code

    exit_code(code)
    sys.exit(code)


def _overrides(sets: tuple[str, ...], costs: str | None = None, pipeline: str | None = None,
               **fields: Any) -> dict[str, Any]:
    out = parse_set(sets)
    out.update({k: v for k, v in fields.items() if v is not None})
    if costs:  # a cost file from `maestro profile`: each section's cost as overrides
        from maestro_flow.runtime.build import load_pipeline
        from maestro_flow.runtime.costfile import file_overrides

        notes: list[str] = []
        out.update(file_overrides(load_pipeline(pipeline, out)[0], costs, notes))
        for note in notes:  # sections the file has no cost for keep the pipeline's: say so
            click.echo(f"note: {note}", err=True)
    return out


COSTS_HELP = "Section costs measured by `maestro profile` (a cost file) instead of the pipeline's."


class _Main(click.Group):
    """Every command runs with Ctrl-C held during native imports, and an interrupt it does not
    catch itself ends it with one line and exit 130 (cli_signals.py)."""

    def invoke(self, ctx: click.Context) -> Any:
        from maestro_flow.runtime.build import imports_once

        if signal.getsignal(signal.SIGINT) is _interrupted_early:  # the command's own handling from here
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if signal.getsignal(signal.SIGTERM) is _interrupted_early:  # (run takes it its own way once it runs)
            signal.signal(signal.SIGTERM, cli_signals.term_as_interrupt)
        try:
            with interrupts_after_imports(), imports_once():
                return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # `| head` has read enough: a success, as for stage (QA: exit 1 at random)
            if not reader_gone():
                raise
            sys.exit(0)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
@click.version_option(package_name="maestro_flow", message="maestro_flow %(version)s")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """maestro_flow: train compound models (distillation, multimodal LLMs) as a graph of sections,
    each with its own worker processes, data-parallel degree and micro-batch size.

    \b
    Typical use:
      maestro data demo                      # build the demo datasets under data/demo
      maestro validate pipelines/distill.py  # check a pipeline without starting workers
      maestro run pipelines/distill.py       # train (section mode)
      maestro run pipelines/distill.py --colocated   # the one-process reference
    """
    ctx.obj = {"debug": debug}


@main.command(cls=OptionalValueCommand)
@click.argument("pipeline", type=click.Path(dir_okay=False))
@click.option("--steps", type=int, help="Number of steps in all [default: the pipeline's steps].")
@SETS
@click.option("--colocated", is_flag=True, help="Run all sections in one process (the correctness reference).")
@click.option("--schedule", type=click.Choice(["wavefront", "fifo"]),
              help="Sample ordering across sections [default: the pipeline's schedule, wavefront unless it says].")
@click.option("--metrics-out", type=click.Path(dir_okay=False), help="Write one JSON line of metrics per step, replacing the file (with --resume: go on "
              "with it, keeping the rows of the steps before the checkpoint).")
@click.option("--save-dir", type=click.Path(file_okay=False), help="Write <section>.safetensors per trainable section.")
@click.option("--trace", "trace", type=click.Path(dir_okay=False), default=None, is_flag=False, flag_value="",
              metavar="[FILE]", help="Write a Chrome/Perfetto timeline to FILE (no FILE: RUN_DIR/trace.json, or ./trace.json "
                   "with --no-run-dir).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Where plans, metrics and worker logs go (default runs/NAME-TIMESTAMP).")
@click.option("--no-run-dir", is_flag=True, help="Write no run directory.")
@click.option("--record", metavar="SECTION", help="Save what SECTION receives and produces (RUN_DIR/record/) "
              "for `maestro stage SECTION --replay RUN_DIR`.")
@click.option("--record-steps", metavar="STEPS", help="Steps to record, by index from 0 (the progress line's step N is index "
              "N-1), e.g. 0,5,9 or 0,3-5 (default: all).")
@click.option("--costs", type=click.Path(dir_okay=False, exists=True), help=COSTS_HELP)
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Write checkpoints here (DIR/step-N/); needs --checkpoint-every.")
@click.option("--checkpoint-every", type=int, metavar="N", help="Checkpoint after every N steps, and after the last.")
@click.option("--keep-last", type=int, metavar="K",
              help="Keep only the newest K complete checkpoints [default: keep all].")
@click.option("--checkpoint-errors", type=click.Choice(["stop", "continue"]),
              help="When a checkpoint cannot be written: stop the run cleanly, or report it and train on (the "
                   "one after the last step fails the run either way: it holds the run's final state) "
                   "[default: stop].")
@click.option("--checkpoint-on-term", is_flag=True,
              help="On SIGTERM (a scheduler's preemption), finish the steps already planned, checkpoint them, then "
                   "stop (exit 130); a second SIGTERM stops at once. Needs --checkpoint-dir and --checkpoint-every; "
                   "one node only.")
@click.option("--resume", type=click.Path(file_okay=False), metavar="DIR",
              help="Start from a checkpoint: DIR/step-N, or the newest complete one under DIR (--steps stays the "
                   "total).")
@click.option("--max-restarts", type=int, default=0, show_default=True, metavar="N",
              help="When a worker dies or hangs, or a node is lost, stop all workers and restart from the newest "
                   "checkpoint, up to N times (each restart waits up to MAESTRO_STARTUP_S for a lost node).")
@click.option("--tensorboard", "tensorboard", type=click.Path(file_okay=False), metavar="DIR",
              help="Log loss, lr, grad norm, throughput and each section's busy share per step for TensorBoard, "
                   "in DIR/NAME-TIMESTAMP (one folder per run: `tensorboard --logdir DIR` compares them; needs the "
                   "tensorboard package).")
@click.option("--nnodes", type=int, help="Nodes the run spans (default 1; torchrun's convention; every node needs the "
              "same secret, and node 0 waits MAESTRO_STARTUP_S, 120 s, for the others).")
@click.option("--node-rank", type=int, help="This node's index, 0 to NNODES-1 (node 0 runs the coordinator; default: "
                                             "SLURM_NODEID under Slurm).")
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Where the nodes meet: node 0 listens there (a TCPStore) "
                                                             "[default: none; needed with --nnodes > 1].")
@click.option("--nproc-per-node", type=int, help="At most this many ranks on a node, e.g. its GPUs; a tensor-parallel "
                                                  "group stays on one node [default: the ranks spread evenly].")
@click.option("--host", help="Address the control plane and the rendezvous store listen on (default 127.0.0.1; "
                             "with several nodes, the address node 0 is reached at; the status endpoint stays on "
                             "loopback). Anything but loopback needs a shared secret (MAESTRO_SECRET or "
                             "--secret-file), and its ZeroMQ sockets then take only CurveZMQ peers of the run.")
@click.option("--interface", metavar="IFACE", help="Network interface gloo and NCCL use (default: lo while --host "
                                                    "is loopback).")
@click.option("--secret-file", type=click.Path(dir_okay=False), metavar="FILE",
              help="The run's shared secret (at least 16 bytes; or set MAESTRO_SECRET). Every control message is "
                   "authenticated with it; without one a one-node run generates its own.")
@click.option("--baseline", type=click.Choice(["monolithic"]),
              help="Run the Megatron-style comparison instead of section mode: --devices data-parallel ranks, "
                   "each running every section in graph order on its share of each global batch, one micro-batch "
                   "size for all, one gradient reduction per step (same maths as --colocated).")
@click.option("--devices", type=int, help="--baseline monolithic: data-parallel ranks (default: as many as section "
                                          "mode's workers; at most global_batch).")
@click.option("--micro-batch", "micro_batch", type=int,
              help="--baseline monolithic: the micro-batch every section runs (default: the loss section's).")
@click.option("--pin-cpus", is_flag=True, help="Pin each CPU worker to its own cores (shared by all when there are "
                                               "more workers than cores); the cores are those `maestro run` may use "
                                               "(e.g. under taskset). The coordinator, and the busiest section's "
                                               "message threads, then keep to the cores of the sections with time "
                                               "to spare in the last step (node 0's).")
@click.option("--stop-on-nan", is_flag=True,
              help="Stop the run (exit 1) at the first step whose loss or gradient norm is NaN or inf, writing no "
                   "checkpoint or --save-dir of that step [default: warn once and train on].")
@click.option("--quiet", is_flag=True, help="No progress output.")
@click.pass_context
def run(ctx: click.Context, pipeline: str, steps: int | None, sets: tuple[str, ...], colocated: bool,
        schedule: str | None, metrics_out: str | None, save_dir: str | None, trace: str | None,
        run_dir: str | None, no_run_dir: bool, record: str | None, record_steps: str | None, costs: str | None,
        checkpoint_dir: str | None, checkpoint_every: int | None, keep_last: int | None, checkpoint_errors: str | None,
        checkpoint_on_term: bool,
        resume: str | None, max_restarts: int, tensorboard: str | None, nnodes: int | None, node_rank: int | None,
        rdzv_endpoint: str | None, nproc_per_node: int | None, host: str | None, interface: str | None,
        secret_file: str | None, baseline: str | None, devices: int | None, micro_batch: int | None,
        pin_cpus: bool, stop_on_nan: bool, quiet: bool) -> None:
    """Train PIPELINE (a Python file defining pipeline(**overrides)).

    Every run writes a run directory (runs/NAME-TIMESTAMP unless --run-dir or --no-run-dir): the
    resolved pipeline.json, metrics.jsonl, plans.jsonl, events.jsonl (what happens besides steps:
    restarts and their causes, checkpoints, and how the run ended) and each worker's log
    (workers/*.log, every line prefixed with its section and replica).

    \b
    A long job: checkpoints every 100 steps, the newest 3 kept, restarts after a lost worker:
      maestro run PIPE --checkpoint-dir ckpt --checkpoint-every 100 --keep-last 3 --max-restarts 2
    and after a crash, the same command with --resume ckpt.

    \b
    The Megatron-style comparison (every rank runs every section), on the same data:
      maestro run PIPE --baseline monolithic --devices 2 --pin-cpus

    \b
    Two nodes (the same command on each, with the same MAESTRO_SECRET; under Slurm one
    `srun maestro run ...` per node, the node rank from SLURM_NODEID):
      maestro run PIPE --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400
      maestro run PIPE --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400
    """
    ctx.call_on_close(outlive_readers())  # a closed output pipe does not stop the training
    if (nnodes or 1) > 1 and node_rank != 0 and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        # An agent notices a lost node 0 by its store failing; c10d would log each failed call with a
        # C++ stack first. The agent's own message says what happened (workers: runtime/agent.py).
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        os.environ["MAESTRO_AGENT_QUIETED_TORCH"] = "1"
    created = None  # the default run dir made here: removed again if the run is refused before writing to it
    made = []  # and the folder holding it, where this run made that too (found in QA: an empty runs/ stayed)
    try:
        from maestro_flow.checkpoint.checkpointer import CheckpointOptions
        from maestro_flow.optim.build import pipeline_schedule_warnings
        from maestro_flow.runtime.build import load_pipeline
        from maestro_flow.runtime.checks import pipeline_warnings
        from maestro_flow.runtime.run import RunOptions, run_pipeline
        from maestro_flow.runtime.rundir import RUNS, default_run_dir

        if no_run_dir and run_dir is not None:  # found in review: --run-dir was dropped without a word
            raise PipelineError("--run-dir names the run directory and --no-run-dir asks for none: give one of them")
        overrides = _overrides(sets, costs, pipeline, steps=steps, schedule=schedule)
        loaded = load_pipeline(pipeline, overrides)[0]
        if not no_run_dir and run_dir is None:
            loaded.check_name()  # the run folder is named after it: a bad name is refused before mkdir
            made = [] if os.path.isdir(RUNS) else [RUNS]
            run_dir = created = default_run_dir(loaded)
        # (the baseline sets its own dp and micro-batch: only what it keeps is warned of; review)
        for warning in pipeline_warnings(loaded) if baseline is None else pipeline_schedule_warnings(loaded):
            click.echo(f"warning: {warning}", err=True)
        steps_to_record = None
        if record_steps is not None and not record:
            raise PipelineError("--record-steps says which steps --record SECTION saves: give --record too")
        if record_steps is not None:  # (found in QA: "" recorded every step, as an unset shell variable gives)
            from maestro_flow.runtime.replay import ReplayError, parse_steps

            try:
                steps_to_record = parse_steps(record_steps, "--record-steps")
            except ReplayError as exc:
                raise PipelineError(str(exc)) from None
        checkpoint = CheckpointOptions(dir=checkpoint_dir, every=checkpoint_every, keep_last=keep_last,
                                       on_error=checkpoint_errors, resume=resume, max_restarts=max_restarts,
                                       on_term=checkpoint_on_term)
        options = RunOptions(overrides=overrides, colocated=colocated, metrics_out=metrics_out, save_dir=save_dir,
                             show_progress=not quiet, run_dir=None if no_run_dir else run_dir, trace=trace,
                             record=record, record_steps=steps_to_record, checkpoint=checkpoint,
                             tensorboard=tensorboard, host=host, interface=interface, secret_file=secret_file,
                             nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                             nproc_per_node=nproc_per_node, baseline=baseline, devices=devices,
                             micro_batch=micro_batch, pin_cpus=pin_cpus, stop_on_nan=stop_on_nan)
        from maestro_flow.runtime.reaper import subreaper

        with subreaper():  # what a worker killed by a signal leaves running is stopped with the run
            run_pipeline(pipeline, options)
    except KeyboardInterrupt as exc:  # "workers stopped" only where some had (review: said at the checks)
        click.echo("interrupted: workers stopped" if WORKERS_STARTED.is_set() else "interrupted", err=True)
        if isinstance(exc.__context__, MaestroError):  # found in QA: a failure it cut short went unsaid
            click.echo(f"(while the run was stopping after: {first_line(exc.__context__)})", err=True)
        for note in notes_of(exc):
            click.echo(note, err=True)
        _go_on_note(term_untaken=checkpoint_on_term and cli_signals.TERMINATED.is_set())  # before run took it
        _exit(130)
    except MaestroError as exc:
        started = isinstance(exc, (StageError, SystemFailure))  # a run that started, then failed
        _fail(exc, ctx.obj["debug"], then=(lambda: _go_on_note(failed=True)) if started else None)
    except Exception:
        from maestro_flow.runtime.nodes import ABANDONED

        if not ABANDONED.is_set():
            raise
        # a bug, after a store call was given up: shown, then os._exit (see _exit)
        traceback.print_exc()
        _exit(1)
    finally:
        for folder in ([created] + made) if created else ():
            with contextlib.suppress(OSError):  # another run may have just written there
                if not os.listdir(folder):
                    os.rmdir(folder)
    from maestro_flow.runtime.nodes import exit_code

    exit_code(0)  # a node whose agent gave up a store call at the end (nodes.bounded)


@main.command()
@click.argument("pipeline", type=click.Path(dir_okay=False))
@SETS
@click.option("--schedule", type=click.Choice(["wavefront", "fifo"]),
              help="Sample ordering across sections [default: the pipeline's schedule].")
@click.option("--step", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which step's global batch to plan, by index from 0 (the run's step N is index N-1). With "
                   "--trace-in the trace is the batch: the step then only decides whether the plan is searched "
                   "(not at step 0, nor without a core to spare), as in a run.")
@click.option("--trace-in", type=click.Path(dir_okay=False, exists=True),
              help="Plan these samples (JSON Lines of {id, modalities, num_tokens, and num_patches / num_frames "
                   "for a sample with an image / audio}) as one global batch instead of the dataset's.")
@click.option("--costs", type=click.Path(dir_okay=False, exists=True), help=COSTS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON: schedule, step, each section's replicas' micro-batches (sample ids), "
                   "the simulated seconds, the run-ahead gates.")
@click.pass_context
def plan(ctx: click.Context, pipeline: str, sets: tuple[str, ...], schedule: str | None, step: int,
         trace_in: str | None, costs: str | None, as_json: bool) -> None:
    """Print the plan of one step of PIPELINE and its simulated timing under the sections' costs.

    It is the plan a run of PIPELINE on this machine makes for that step, searching as the run
    would (not for step 0, which the workers wait for, nor where it would take a worker's core;
    the same with checkpoints or resumed), with the costs given (the
    sections' `cost`, or --costs). A run also refines its costs from its own timings as it goes
    (adapt_costs), so its later steps can differ unless --set adapt_costs=false. The timing is
    one step alone, each worker on a device of its own: `maestro tune` predicts a run's steady
    step (steps overlapping, CPU workers sharing cores, per-step overheads), so it differs."""
    from maestro_flow.runtime.planning import plan_one_step

    try:
        result = plan_one_step(pipeline, _overrides(sets, costs, pipeline, schedule=schedule), step=step,
                               trace_in=trace_in, warn=lambda text: click.echo(f"warning: {text}", err=True))
        if as_json:
            click.echo(json.dumps(result.to_json_dict(), indent=1))
        else:
            sim = result.simulated
            click.echo(result.describe())
            click.echo(f"simulated: makespan {sim['makespan_s']:.4g}s, lower bound {sim['lower_bound_s']:.4g}s, "
                       f"critical section {sim['critical_section']} busy {sim['critical_busy_fraction']:.1%}")
    except MaestroError as exc:
        _fail(exc, ctx.obj["debug"])


@main.command()
@click.argument("pipeline", type=click.Path(dir_okay=False))
@SETS
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Also draw the graph to this file: .dot/.gv (DOT), or .svg/.png (needs Graphviz's `dot`; "
                   "without it the DOT is written to FILE.dot instead).")
@click.pass_context
def graph(ctx: click.Context, pipeline: str, sets: tuple[str, ...], output: str | None) -> None:
    """Show the section graph of PIPELINE: each section (trainable/frozen, activates_on, dp, micro-batch,
    device) and each edge (tensors, fan-out/fan-in, gradients), as text; -o FILE also draws it."""
    from maestro_flow.graph import SectionGraph
    from maestro_flow.render import check_suffix, render, text_form, to_dot
    from maestro_flow.runtime.build import load_pipeline, unresolved

    try:
        if output:  # a bad suffix or path fails before anything is loaded or printed
            from maestro_flow.runtime.outputs import check_writable

            check_suffix(output)
            check_writable(output, "--output", folder=False)
        p, _ = load_pipeline(pipeline, _overrides(sets))
        p.validate()
        g = SectionGraph(p)
        click.echo(text_form(g))
        for problem in unresolved(p):  # found in QA: a stage that does not exist was drawn in silence
            click.echo(f"warning: {problem} (drawn as written; `maestro validate` checks the pipeline)", err=True)
        if output:
            done = render(to_dot(g), output)
            if done.note:
                click.echo(f"warning: {done.note}", err=True)
            click.echo(f"wrote {done.path}")
    except MaestroError as exc:
        _fail(exc, ctx.obj["debug"])


@main.group()
def data() -> None:
    """Build datasets."""


@data.command("demo")
@click.option("--out", "out_dir", default="data/demo", show_default=True, type=click.Path(file_okay=False),
              help="Folder the datasets are written to.")
@click.option("--samples", "num_samples", default=2048, show_default=True, type=click.IntRange(min=1),
              help="Text samples (text.arrow).")
@click.option("--vlm-samples", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Image-text samples (vlm.arrow).")
@click.option("--image-share", default=0.33, show_default=True, type=click.FloatRange(0, 1),
              help="Share of vlm.arrow samples with an image.")
@click.option("--mm-samples", default=512, show_default=True, type=click.IntRange(min=1),
              help="Text/image/audio samples (mm.arrow).")
@click.option("--only", type=click.Choice(["text", "vlm", "mm"]), multiple=True, help="Build only these.")
@click.option("--seed", default=0, show_default=True, help="Seed of the sampling (the same seed, the same files).")
def data_demo(out_dir: str, num_samples: int, vlm_samples: int, image_share: float, mm_samples: int,
              only: tuple[str, ...], seed: int) -> None:
    """Build the demo datasets from data that ships with Python and scikit-learn.

    \b
    text.arrow (+ .parquet)  standard-library docstrings, byte tokens
    vlm.arrow                scikit-learn photos (crops) and digits with captions, mixed with text
    mm.arrow                 text, images and generated audio (captions spoken as tones)
    """
    from maestro_flow.runtime.build import add_paths, resolve, search_paths

    add_paths(search_paths(None))
    builders = {"text": ("build_text_demo", num_samples, {}), "mm": ("build_multimodal_demo", mm_samples, {}),
                "vlm": ("build_image_demo", vlm_samples, {"image_share": image_share})}
    for name in only or ("text", "vlm", "mm"):
        function, samples, extra = builders[name]
        try:
            path = resolve(f"loaders.demo:{function}", "data demo")(out_dir, num_samples=samples, seed=seed, **extra)
            parquet = path.with_suffix(".parquet") if name == "text" else None  # found in review: unsaid
            click.echo(f"wrote {path}" + (f" and {parquet}" if parquet is not None and parquet.is_file() else ""))
        except (ValueError, OSError) as exc:  # a builder's own check, or a folder it cannot write
            _fail(PipelineError(f"data demo ({name}): {exc}"), debug=False)


def _register_tools() -> None:
    """Commands defined in their own modules (their imports stay lazy)."""
    from maestro_flow.cli_stage import stage
    from maestro_flow.cli_tools import export, profile, top, tune
    from maestro_flow.cli_validate import validate

    for command in (export, profile, stage, top, tune, validate):
        main.add_command(command)


_register_tools()


if __name__ == "__main__":
    main()
