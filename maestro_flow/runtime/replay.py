"""`maestro stage PIPELINE SECTION`: run one section alone, in this process, and report on it.

The section's stage is built exactly as a run builds it (build_stage: the pipeline's seed, dtype
and device; as the replayed replica, its `ctx.replica` following each recorded micro-batch's
replica; replica 0 for synthetic inputs) and fed micro-batches that are either

  - recorded (`--replay RUN_DIR`): what the section received in `maestro run --record SECTION`
    (RUN_DIR/record/SECTION-REPLICA/, see runtime/record.py), with the weights it had at each
    recorded step when the run saved them; or
  - synthetic: a few real samples of the dataset for the section's columns, and, for each
    incoming edge, the tensors its producers compute on those samples, obtained by running the
    upstream sections' stages here (freshly initialised, as at step 0), or random normal tensors
    of a given per-sample shape (`--input-shape NAME=DxD`, D a number or T/P/F: each sample's
    tokens, patches or frames) when an upstream section cannot run.

Each micro-batch runs forward (under no_grad for a frozen section) and, for a trainable section,
backward: of the loss (summed) for a section returning "loss", else of the sum of its floating
outputs' squares / 2. Received inputs of gradient-carrying edges are leaves requiring grad, as in
the executor. The report gives, per micro-batch, each output's shapes, dtype and statistics, the
gradient norms per parameter group and of the inputs, and forward/backward times (median over
`repeat` runs); with `compare`, the largest differences from the recorded outputs.

Flags that do not apply to the chosen mode (--steps/--replica without --replay, --samples/
--input-shape with it, an --input-shape for a tensor the section does not receive) are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from safetensors import SafetensorError

from maestro_flow.config import Pipeline
from maestro_flow.errors import MaestroError, PipelineError, StageOutputError, brief
from maestro_flow.graph import SectionGraph
from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.record import (
    Steps,
    TextOnly,
    idle_steps,
    load_file,
    metric_rows,
    planned,
    recorded_failure,
    recorded_files,
    recorded_rng,
    recorded_weights,
    recording_dirs,
    steps_text,
    weights_name,
)
from maestro_flow.runtime.replay_report import _column_summary, _ms, compare_outputs, describe_value
from maestro_flow.runtime.replay_runner import SIZES, ReplayError, RunResult, SectionRunner, synthetic_batches
from maestro_flow.stage import MicroBatch

__all__ = ["ReplayOptions", "SectionRunner", "RunResult", "replay", "synthetic_batches", "compare_outputs",
           "Steps", "parse_steps", "parse_shapes"]


@dataclasses.dataclass(kw_only=True, slots=True)
class ReplayOptions:
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_dir: str | None = None  # recorded inputs; None: synthetic
    replica: int | None = None  # which replica's recording (default: all)
    steps: Steps | None = None  # recorded steps to replay (default: all)
    compare: bool = False
    atol: float = 1e-5
    rtol: float = 1e-4
    repeat: int = 1
    samples: int | None = None  # synthetic: number of samples (default: the section's micro_batch)
    input_shapes: dict[str, tuple[int | str, ...]] = dataclasses.field(default_factory=dict)
    weights: str | None = None  # a saved stage file (<save_dir>/<section>.safetensors) to load
    pdb: bool = False


@dataclasses.dataclass(kw_only=True, slots=True)
class _Work:
    """One micro-batch to run, with what the recording holds about it (nothing when synthetic)."""

    batch: MicroBatch
    want: dict[str, Any] | None = None  # recorded outputs
    replica: int | None = None
    weights: str | None = None  # recorded weights file of its step
    rng: dict[str, Any] = dataclasses.field(default_factory=dict)  # RNG states before its forward
    failed: str | None = None  # the phase in which the run's stage raised on it (the run's last micro-batch)


# -- recorded inputs ---------------------------------------------------------------------------

def _recorded(run_dir: str, name: str, options: ReplayOptions) -> list[tuple[int, int, int, str, str]]:
    """(step, replica, index, folder, file) of the recorded micro-batches to replay, in that
    order: a step's micro-batches replica by replica, so each replica's weights load once a step."""
    if not os.path.isdir(run_dir):
        raise ReplayError(f"--replay: no run folder {run_dir}")
    dirs = recording_dirs(run_dir, name)
    parts = os.path.normpath(run_dir).split(os.sep)
    if not dirs and ("record" in parts[-2:]):  # RUN_DIR/record or RUN_DIR/record/SECTION-R given?
        above = os.sep.join(parts[:len(parts) - parts[::-1].index("record") - 1]) or "."
        if recording_dirs(above, name):  # only then (found in review: a run folder named "record")
            raise ReplayError(f"--replay takes the run folder, not its recording: --replay {above}")
    if not dirs:
        idle, planned = idle_steps(run_dir, name)
        why = (f": no sample activated it at any of this run's {len(planned)} steps, so there was nothing to record"
               if planned and idle == planned else f" (record one with: maestro run PIPELINE.py --record {name}"
               + (f"; no sample activated it at {steps_text(idle)} of this run" if idle else "") + ")")
        raise ReplayError(f"--replay: no recording of section {name!r} in {os.path.join(run_dir, 'record')}{why}")
    replicas = [(int(os.path.basename(d).rsplit("-", 1)[1]), d) for d in dirs]
    if options.replica is not None:
        want = f"{name}-{options.replica}"
        replicas = [(r, d) for r, d in replicas if r == options.replica]
        if not replicas:
            raise ReplayError(f"--replica {options.replica}: no folder {want} in {os.path.join(run_dir, 'record')}")
    found = [(step, replica, index, d, path) for replica, d in replicas for step, index, path in recorded_files(d)]
    if options.steps is not None:
        have = sorted({f[0] for f in found})
        found = [f for f in found if f[0] in options.steps]
        if not found:
            idle = idle_steps(run_dir, name, options.steps)[0]
            raise ReplayError(f"--steps: none of {options.steps} recorded for {name!r} "
                              f"(recorded steps: {', '.join(map(str, have)) or 'none'}"
                              + (f"; no sample activated it at {steps_text(idle)}" if idle else "") + ")")
    if not found:
        raise ReplayError(f"--replay: the recording of {name!r} in {run_dir} holds no micro-batch")
    return sorted(found, key=lambda f: f[:3])


def _missing(run_dir: str, name: str, recorded: list[tuple[int, int, int, str, str]]) -> dict[tuple[int, int], list]:
    """(step, replica) -> the micro-batch indices the run ran there that the recording lacks, for
    the steps and replicas replayed (found in QA: a recording with a micro-batch removed replayed,
    and compared, as complete): at a step the run finished once, planned once (a row in
    RUN_DIR/metrics.jsonl, a line in the append-only RUN_DIR/plans.jsonl) those its plan gave it,
    else those below the last one recorded: a failed or interrupted step never ran the rest of its
    plan, and after a restart the metrics keep one row of a step planned twice (found in review)."""
    lines: dict[int, int] = {}
    plans, rows, have = planned(run_dir, name, lines), metric_rows(run_dir), {}
    for step, replica, index, _, _ in recorded:
        have.setdefault(step, {}).setdefault(replica, set()).add(index)
    finished = {s for s, n in rows.items() if n >= lines.get(s, 1)}
    replicas = {r for _, r, _, _, _ in recorded}
    out = {}
    for step, by_replica in have.items():
        counts = plans.get(step, []) if step in finished else []
        for replica in sorted(replicas):
            indices = by_replica.get(replica, set())
            total = counts[replica] if replica < len(counts) else max(indices, default=-1) + 1
            if set(range(total)) - indices:
                out[(step, replica)] = sorted(set(range(total)) - indices)
    return out


def _text_only(batch: MicroBatch) -> str | None:
    """What in `batch` was recorded as text only (a value the stage cannot be given), if anything."""
    for kind, values in (("column", batch.columns), ("input", batch.inputs)):
        for col, entries in values.items():
            for i, v in enumerate(entries):
                if isinstance(v, TextOnly):
                    return (f"{kind} {col!r} of sample {batch.sample_ids[i] if i < len(batch.sample_ids) else i} "
                            f"was recorded as text only ({str(v)[:60]!r}), not as a value the stage can be given")
    return None


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
    for key in ("dtype", "mixed_precision"):
        if recorded.get(key, getattr(pipeline, key)) != getattr(pipeline, key):
            differ.append(key)
    other = recorded.get("name", pipeline.name) != pipeline.name  # found in QA: unsaid, or "--set" advised
    if differ:
        return (f"note: the run used other settings for {name!r} ({', '.join(differ)} {'differs' if len(differ) == 1 else 'differ'} from {path}); "
                + (f"it ran pipeline {recorded['name']!r}, not {pipeline.name!r}: replay with its file"
                   if other else "pass the run's --set overrides to replay faithfully"))
    return f"note: the recording is of pipeline {recorded['name']!r}, this is {pipeline.name!r}" if other else None


# -- the command ---------------------------------------------------------------------------------

def parse_steps(text: str | None, flag: str = "--steps") -> Steps | None:
    """"3", "0,2,5", "4-7" or a mix ("0,4-7") -> the Steps they name (`flag`: for the errors); None
    where not given (an empty one names no step: refused)."""
    if text is None:
        return None
    ranges = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                ranges.append((lo, hi))
            elif part:
                ranges.append((int(part), int(part)))
        except ValueError:
            raise ReplayError(f"{flag}: {part!r} is not a step, a range A-B or a comma-separated list of them") from None
    if not ranges:
        raise ReplayError(f"{flag}: {text!r} names no step")
    return Steps(ranges=tuple(ranges))


def parse_shapes(items: tuple[str, ...] | list[str]) -> dict[str, tuple[int | str, ...]]:
    """("image_embeds=16x64", "hidden=Tx128") -> {"image_embeds": (16, 64), "hidden": ("T", 128)}: a
    dimension is a number, or T, P or F, each sample's own token, patch or frame count (found in
    review: a teacher's hidden states are [tokens, d], which no fixed shape fits)."""
    out = {}
    for item in items:
        name, sep, dims = item.partition("=")
        try:
            shape = tuple(d.strip().upper() if d.strip().upper() in SIZES else int(d)
                          for d in dims.lower().replace(",", "x").split("x") if d.strip())
            if not sep or not name or not shape or min((d for d in shape if isinstance(d, int)), default=0) < 0:
                raise ValueError
        except ValueError:
            raise ReplayError("--input-shape: expected NAME=DxD (per-sample shape; D a number, or T, P or F for each "
                              f"sample's tokens, patches or frames, e.g. hidden=Tx128), got {item!r}") from None
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
    _check_mode_flags(pipeline, name, options)
    from maestro_flow.runtime.checks import check_between
    from maestro_flow.runtime.replay_runner import ancestors

    # The sections this command runs: recorded inputs run none upstream, random ones not their producer.
    ran = [] if options.run_dir else ancestors(SectionGraph(pipeline), name, set(options.input_shapes))
    check_between(pipeline, {name, *ran})
    with post_mortem(options.pdb):
        return _replay(path, pipeline, name, options, echo)


def _check_mode_flags(pipeline: Pipeline, name: str, options: ReplayOptions) -> None:
    """Refuse the flags that do not apply to this mode (recorded or synthetic) rather than ignore them."""
    mode_only = ((options.steps is not None, "--steps"), (options.replica is not None, "--replica"))
    if not options.run_dir:
        given = [flag for is_set, flag in mode_only if is_set]
        if given:
            raise ReplayError(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --replay RUN_DIR "
                              "(they choose recorded micro-batches; synthetic inputs have none)")
        names = sorted({t for e in SectionGraph(pipeline).inputs(name) for t in e.edge.tensors})
        unknown = sorted(set(options.input_shapes) - set(names))
        if unknown:
            valid = f"its inputs are {', '.join(names)}" if names else "it receives no tensor"
            raise ReplayError(f"--input-shape {', '.join(unknown)}: section {name!r} has no such input ({valid})")
        _check_input_widths(pipeline, name, options.input_shapes)
        return
    given = [flag for is_set, flag in ((options.samples is not None, "--samples"),
                                       (bool(options.input_shapes), "--input-shape")) if is_set]
    if given:
        raise ReplayError(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to synthetic inputs "
                          "only, not with --replay (which feeds the recorded ones)")


def _check_input_widths(pipeline: Pipeline, name: str, shapes: dict[str, tuple[int | str, ...]]) -> None:
    """An --input-shape whose last dimension is not the width the stage declares it reads
    (Stage.input_widths) is refused naming it (found in QA: `hidden=Tx64` for a student reading
    128 failed in torch's matmul, with a traceback)."""
    from maestro_flow.runtime.checks import declared_widths

    widths = declared_widths(pipeline.section(name), "input_widths")
    for t, shape in sorted(shapes.items()):
        if t in widths and shape and shape[-1] != widths[t][0]:
            width, key = widths[t]
            raise ReplayError(f"--input-shape {t}={'x'.join(map(str, shape))}: section {name!r} reads {t} {width} wide "
                              f"(sections.{name}.config.{key}); give {'x'.join(map(str, (*shape[:-1], width)))}")


def _replay(path: str, pipeline: Pipeline, name: str, options: ReplayOptions, echo: Callable[[str], None]) -> int:
    graph = SectionGraph(pipeline)
    section = graph.sections[name]
    is_loss = name in graph.loss_sections()
    kind = "trainable" if section.trainable else "frozen"
    recorded = _recorded(options.run_dir, name, options) if options.run_dir else None
    try:
        # found in QA: always replica 0, so a stage reading ctx.replica replayed replica 1 wrongly
        runner = SectionRunner(pipeline, name, replica=recorded[0][1] if recorded else 0)
    except MaestroError:
        raise
    except Exception as exc:  # a config the stage refuses: one line, exit 2, as validate says it (found in QA)
        raise PipelineError(f"sections.{name}.config: building {section.stage} from it failed: {brief(exc)} "
                            "(--pdb to debug it)") from exc  # post_mortem debugs the cause
    params = sum(p.numel() for p in runner.stage.parameters())
    echo(f"section {name} ({section.stage}): {kind}{', loss section' if is_loss else ''}, "
         f"{params:,} parameters, device {runner.device}, dtype {pipeline.dtype}")
    if section.tp > 1 or section.fsdp:  # found in QA: said nowhere
        layout = ", ".join([f"tp={section.tp}"] * (section.tp > 1) + ["fsdp"] * section.fsdp)
        echo(f"layout: a run shards this section ({layout}); here it runs whole, in one process: the same model, "
             "not the run's memory, timings or exact rounding")
    if options.weights:
        runner.load_weights(options.weights)
        echo(f"weights: {options.weights}")
    work: list[_Work] = []
    unrecorded: dict[tuple[int, int], list] = {}
    if recorded is not None:
        note = _run_settings_note(options.run_dir, pipeline, name)
        if note:
            echo(note)
        steps = sorted({r[0] for r in recorded})
        echo(f"inputs: recorded in {os.path.join(options.run_dir, 'record')} — {len(recorded)} micro-batch(es), "
             f"step(s) {', '.join(map(str, steps))}")
        unrecorded = _missing(options.run_dir, name, recorded)
        for (step, replica), indices in sorted(unrecorded.items()):
            echo(f"warning: step {step} replica {replica}: the recording lacks micro-batch(es) "
                 f"{', '.join(map(str, indices))} of those the run ran (the recording stopped: see the worker's log; "
                 "or files were removed): not replayed")
        for step, replica, _index, folder, file in recorded:
            try:
                batch, outputs = load_file(file)
                rng, failed = recorded_rng(file), recorded_failure(file)
            except (ValueError, KeyError, OSError, SafetensorError) as exc:  # a recording we cannot read
                raise ReplayError(f"--replay {options.run_dir}: cannot read {file}: {exc}") from None
            text = _text_only(batch)
            if text:
                raise ReplayError(f"--replay: cannot replay step {step} micro-batch {batch.index} of replica "
                                  f"{replica} ({file}): its {text}")
            weights = recorded_weights(folder, step) if not options.weights else None
            work.append(_Work(batch=batch, want=outputs, replica=replica, weights=weights, rng=rng, failed=failed))
        recorded = any(w.weights for w in work)
        lacking = sorted({w.batch.step for w in work if not w.weights}) if recorded else []
        if options.weights:
            pass
        elif lacking:  # found in review: such a step ran with an earlier step's weights, and --compare blamed the stage
            raise ReplayError(f"--replay {options.run_dir}: the recording holds no weights for step(s) "
                              f"{', '.join(map(str, lacking))} ({weights_name(lacking[0])} missing), and those of "
                              "other steps would give other outputs: replay the other steps (--steps), or pass "
                              "--weights with the section's weights at that step")
        elif recorded:
            echo("weights: as recorded at each step (RECORDING/weights-stepNNNNNN.safetensors)")
        elif not section.trainable:  # found in QA: told to export a frozen section's weights, which export refuses
            echo("weights: as built from the section's config (it is frozen: the run's weights at every step)")
        elif options.compare and any(w.batch.step > 0 for w in work):  # (trainable: the branch above took frozen)
            # found in QA: compared anyway, exit 1 on every later step (where only some steps lack
            # weights the replay was refused: now both ways agree)
            later = sorted({w.batch.step for w in work if w.batch.step > 0})
            raise ReplayError(f"--replay {options.run_dir}: the recording holds no weights (a sharded section, fsdp "
                              "or tp, records none), so step(s) "
                              f"{', '.join(map(str, later))} would run with fresh weights and --compare could only "
                              "differ: pass --weights with the weights step N ran with (maestro export "
                              f"CKPT/step-N --section {name} -o OUT), or replay step 0 alone (--steps 0)")
        else:
            echo("weights: freshly initialised (the recording holds no weights; outputs of steps after 0 "
                 "differ from the run's — pass --weights with the weights step N ran with: checkpoint step-N, "
                 "exported (maestro export CKPT/step-N --section NAME -o OUT); a --save-dir's file holds those "
                 "after the last step, which no step ran with)")  # found in QA: it was offered for the last step
        missing = sum(not w.rng for w in work)
        if not missing:
            echo("random state: as recorded before each forward (dropout draws the run's masks)")
        else:
            echo(f"random state: not recorded{'' if missing == len(work) else f' for {missing} micro-batch(es)'} "
                 "(a stage drawing random numbers, e.g. dropout, draws other ones than the run did)")
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
        work = [_Work(batch=b) for b in batches]

    failed = unraised = reraised = 0
    uncompared: set[str] = set()
    loaded_weights = None
    for number, item in enumerate(work):
        batch, want, weights = item.batch, item.want, item.weights
        if item.replica is not None and runner.stage.ctx.replica != item.replica:
            runner.stage.ctx = dataclasses.replace(runner.stage.ctx, replica=item.replica)
        if weights and weights != loaded_weights:
            runner.load_weights(weights, source=f"recorded weights of step {batch.step} ({weights})")
            loaded_weights = weights
        echo("")
        mods = sorted({m for ms in batch.modalities for m in ms})
        where = f" (replica {item.replica})" if item.replica is not None else ""
        echo(f"step {batch.step} micro-batch {batch.index}{where}: {len(batch)} sample(s) {batch.sample_ids} "
             f"({', '.join(mods) or 'no modality'})" + (f", weights of step {batch.step}" if weights else ""))
        for col, values in batch.columns.items():
            echo(f"  column {col:<16} {_column_summary(values)}")
        for inp, values in batch.inputs.items():
            echo(f"  input  {inp:<16} {describe_value(values)}")
        if item.failed:
            echo(f"  the run's {item.failed} raised on this micro-batch (its step {batch.step + 1}, counted from 1 "
                 "as the run counts; the run stopped there); replaying it:")
        try:
            result = runner.run(batch, options.repeat, rng=item.rng)
        except Exception as exc:  # found in review: raising again ended the replay of every later micro-batch
            if not item.failed or options.pdb or (isinstance(exc, MaestroError)
                                                  and not isinstance(exc, StageOutputError)):
                raise
            for line in "".join(traceback.format_exception(exc)).rstrip().splitlines():
                echo("    " + line)
            echo(f"  raised as the run did: {brief(exc)}")
            reraised += 1
            continue
        if item.failed:  # found in QA: "all outputs match" for a run that failed on this very micro-batch
            echo(f"  the replay's {item.failed} did not raise, the run's did: what made it fail is not in the "
                 "recording (another rank's state, the device, memory, a random draw the seed does not fix)")
            unraised += 1
        for out_name, value in result.outputs.items():
            echo(f"  output {out_name:<16} {describe_value(value)}")
        if section.trainable:
            if result.backward_of:
                total = math.sqrt(sum(v * v for v in result.param_grads.values()))
                echo(f"  backward of {result.backward_of}: parameter grad norm {total:.4g} (this micro-batch alone, "
                     "unscaled: a run's grad_norm is its whole step's, after scaling; found in QA: ~100x apart)")
                for group, norm in result.param_grads.items():
                    echo(f"    {group:<28} {norm:.4g}")
                for inp, (norm, with_grad, leaves) in result.input_grads.items():
                    echo(f"  input grad {inp:<10} norm {norm:.4g} ({with_grad} of {leaves} received tensors got a gradient)")
            else:
                echo("  backward: nothing to backward (no output requires grad)")
        timing = f"  time: forward {_ms(result.forward_s)}"
        if result.backward_s:
            timing += f", backward {_ms(result.backward_s)}"
        once = " (one run; --repeat 3 or more for steady timings)" if number else \
            " (one run: the first call, with its one-time setup; --repeat 3 or more for steady timings)"
        echo(timing + (f" (median of {len(result.forward_s)})" if len(result.forward_s) > 1 else once))
        if options.compare and want is not None:
            diffs = compare_outputs(result.outputs, want, options.atol, options.rtol)
            for d in diffs:
                verdict = "MISMATCH" if not d.ok else "ok" if d.compared else "not compared"
                extra = f"  {d.problem}" if d.problem else ""
                echo(f"  compare {d.name:<15} max abs {d.max_abs:.3g}  max rel {d.max_rel:.3g}  {verdict}{extra}")
            extra_names = [k for k in result.outputs if k not in want]
            if extra_names:
                echo(f"  compare: not recorded: {', '.join(extra_names)}")
            failed += sum(not d.ok for d in diffs)
            uncompared |= {d.name for d in diffs if not d.compared}
    echo("")
    if reraised:
        echo(f"replay: {reraised} micro-batch(es) raised as the run did (tracebacks above; --pdb stops at the "
             "error): exit code 3")
    if unraised:
        echo(f"replay: {unraised} micro-batch(es) the run failed on ran without error here"
             + ("" if options.compare else " (with --compare: exit code 1)"))
    if options.compare and failed:
        echo(f"compare: {failed} output(s) differ from the recording beyond atol={options.atol:g} "
             f"rtol={options.rtol:g}")
    elif options.compare and not unraised:
        echo(f"compare: all outputs match the recording (atol={options.atol:g}, rtol={options.rtol:g})"
             + (f"; not compared, recorded as text only: {', '.join(sorted(uncompared))}" if uncompared else "")
             + (f"; {sum(map(len, unrecorded.values()))} micro-batch(es) the run ran were not recorded (above)"
                if unrecorded else ""))
    return 3 if reraised else 1 if options.compare and (failed or unraised) else 0
