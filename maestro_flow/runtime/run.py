"""`maestro run` as a function: load, check, then train in section or colocated mode.

Runs in the coordinator process. Returns the metrics rows; raises PipelineError (bad input,
found before any worker starts), StageError, SystemFailure or CheckpointError. Section mode
resumes from a checkpoint when asked, and restarts from the newest one after a worker failure
when allowed (runtime/restart.py). With several nodes (runtime/nodes.py), node 0 runs the
coordinator and hosts the rendezvous; every other node runs an agent (runtime/agent.py) and
returns no rows. The control plane's secret and listening address are settled here, before
anything starts.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import dataclass
from typing import Any

from maestro_flow.checkpoint import digest
from maestro_flow.checkpoint import manifest as mf
from maestro_flow.checkpoint.checkpointer import Checkpointer, CheckpointOptions, resume_point
from maestro_flow.checkpoint.savedir import end_save
from maestro_flow.errors import CheckpointError, PipelineError, Terminated, exit_code_of, first_line, traceback_tail
from maestro_flow.runtime import cpus
from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.checks import check_pipeline
from maestro_flow.runtime.coordinator import placement_for
from maestro_flow.runtime.meeting import REFUSED_RUN, Meeting
from maestro_flow.runtime.nodes import Nodes
from maestro_flow.runtime.observe import RunObserver
from maestro_flow.runtime.outputs import check_outputs, release_outputs
from maestro_flow.runtime.record import Steps, idle_steps, steps_text
from maestro_flow.runtime.report import RunReport
from maestro_flow.runtime.rundir import RunDir, default_run_dir, node_run_dir
from maestro_flow.runtime.sampler import EpochSampler, data_fingerprint
from maestro_flow.runtime.stops import catch_stops, release
from maestro_flow.timeouts import Timeouts, env_flag
from maestro_flow.transport import cuda_ipc
from maestro_flow.wording import count, skipped_note


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    overrides: dict[str, Any]
    colocated: bool = False
    metrics_out: str | None = None
    save_dir: str | None = None
    show_progress: bool = True
    run_dir: str | None = None  # where plans, metrics, worker logs (and the trace) go; None: nowhere
    trace: str | None = None  # write the Chrome/Perfetto timeline here ("" = run_dir/trace.json)
    record: str | None = None  # a section whose inputs and outputs are saved (run_dir/record/) for replay
    record_steps: Steps | None = None  # which steps (None: all)
    checkpoint: CheckpointOptions = CheckpointOptions()
    tensorboard: str | None = None  # write TensorBoard curves here
    host: str | None = None  # where the control plane and the store listen (None: loopback,
    # or with several nodes the address node 0 is reached at)
    interface: str | None = None  # gloo's and NCCL's network interface (None: lo on loopback)
    secret_file: str | None = None  # the shared secret (else MAESTRO_SECRET, else generated)
    nnodes: int | None = None  # torchrun's conventions (runtime/nodes.py; None: not given, one node)
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    nproc_per_node: int | None = None
    baseline: str | None = None  # "monolithic": the Megatron-style comparison (baseline/monolithic.py)
    devices: int | None = None  # the baseline's data-parallel ranks (None: as many as section mode's workers)
    micro_batch: int | None = None  # the baseline's one micro-batch size (None: the loss section's)
    pin_cpus: bool = False  # each CPU worker on its own cores (runtime/cpus.py)
    stop_on_nan: bool = False  # stop at the first step whose loss or gradient norm is NaN or inf (else warn)


def resolve_host(options: RunOptions, nodes: Nodes) -> str:
    """Where this node listens: --host, else loopback on one node or a loopback rendezvous, else
    node 0's rendezvous address on node 0 and the address other nodes reach node 0 from."""
    from maestro_flow.transport.zmq_link import LOOPBACK, is_loopback

    try:
        if nodes.multi and nodes.node_rank != 0:  # node 0 finds out when it listens there
            socket.getaddrinfo(*nodes.endpoint)
        if options.host:
            return options.host
        if not nodes.multi or is_loopback(nodes.endpoint[0]):
            return LOOPBACK
        if nodes.node_rank == 0:
            return nodes.endpoint[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
            probe.connect(nodes.endpoint)
            return probe.getsockname()[0]
    except OSError as exc:  # found in QA: a mistyped host gave node 1 a traceback (node 0 a line)
        raise PipelineError(f"--rdzv-endpoint {nodes.endpoint[0]}:{nodes.endpoint[1]}: node {nodes.node_rank} "
                            f"cannot reach it ({exc.strerror or exc})") from None


def check_interface(interface: str | None) -> None:
    """--interface names interfaces of this node, as gloo takes them (QA: else each worker failed)."""
    if not interface:
        return
    names = sorted(name for _, name in socket.if_nameindex())
    wrong = [name for name in interface.split(",") if name not in names]  # as gloo reads it: no spaces
    if wrong:
        raise PipelineError(f"--interface {interface}: this node has no network interface {wrong[0]!r} (it has "
                            f"{', '.join(names)})")


def control_secret(options: RunOptions, host: str = "127.0.0.1", nodes: Nodes | None = None) -> bytes | None:
    """The run's secret, refused before anything starts when unusable or missing where needed."""
    from maestro_flow.protocol.auth import load_secret
    from maestro_flow.transport.zmq_link import is_loopback

    try:
        secret = load_secret(options.secret_file)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    if secret is None and nodes is not None and nodes.multi:
        raise PipelineError("--nnodes > 1: every node needs the run's shared secret (the same MAESTRO_SECRET or "
                            "--secret-file on each node)")
    if secret is None and not is_loopback(host):
        raise PipelineError(f"--host {host} is not loopback: a control plane on a network needs a shared "
                            f"secret (set MAESTRO_SECRET or pass --secret-file), or keep --host 127.0.0.1")
    return secret


def _end_wait_s() -> float:  # how long node 0 waits, once the job has ended, for the others to read its outcome
    return Timeouts.from_env().shutdown_grace_s + 5


def _outcome(exc: BaseException, who: str = "node 0") -> str:
    """Why the run failed, in one line, as the other nodes and `maestro top` show it (found in QA:
    the nodes said "node 0 says: KeyboardInterrupt", and of a worker's traceback only its first line)."""
    there = " there" if who == "node 0" else ""
    if isinstance(exc, Terminated):
        return f"{who} was terminated (SIGTERM or SIGHUP{there})"
    if isinstance(exc, KeyboardInterrupt):
        return f"{who} was interrupted (Ctrl-C{there})"
    text = str(exc).strip()
    return f"{first_line(exc)} ... {traceback_tail(text)}" if "\n" in text else first_line(exc)


def _resume_from(options: RunOptions, pipeline: Any, metadata: Any) -> tuple[str, mf.Manifest] | None:
    """The checkpoint to start from, checked against the pipeline before any worker starts."""
    if options.checkpoint.resume is None:
        return None
    folder, manifest = resume_point(options.checkpoint.resume)
    problems = mf.incompatibilities(manifest, pipeline.to_dict())
    if problems:
        raise PipelineError(f"--resume {folder}: the checkpoint does not fit this pipeline: " + "; ".join(problems))
    mf.check_samples(manifest, len(metadata), data_fingerprint(metadata), data_fingerprint(metadata, sizes=True))
    for warning in mf.resume_warnings(manifest, pipeline.to_dict()):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if manifest.step >= pipeline.steps:
        raise PipelineError(f"--resume {folder}: the checkpoint is at step {manifest.step}, and the run has "
                            f"steps={pipeline.steps} in all (--steps is the total; raise it to train further)")
    took = digest.check(folder, manifest.files, f"--resume {folder}", mf.earlier(folder))  # after the cheap checks
    if took >= 2 and options.show_progress:  # (reading a large checkpoint back takes a while: said)
        print(f"checked the checksums of the checkpoint's {len(manifest.files)} files in {took:.0f}s", file=sys.stderr)
    return folder, manifest


def node0_given(options: RunOptions) -> tuple[str, ...]:
    """The options given of those node 0 acts on and must have where another node has them (a
    checkpoint not written, a run trained from step 0 otherwise): node 0 publishes its own with
    each attempt, and each other node's agent compares its own with them."""
    ckpt = options.checkpoint
    return tuple(flag for flag, given in (("--checkpoint-dir", ckpt.dir), ("--resume", ckpt.resume),
                                          ("--save-dir", options.save_dir), ("--record", options.record),
                                          ("--stop-on-nan", options.stop_on_nan)) if given)


def _run_agent(pipeline: Any, options: RunOptions, nodes: Nodes, host: str, secret: bytes,
               files: dict[str, Any]) -> list[dict[str, Any]]:
    """Node I > 0: start and watch this node's workers for node 0's coordinator (runtime/agent.py)."""
    from maestro_flow.runtime.agent import Agent

    ckpt = options.checkpoint
    # Found in review: --resume, --record and --save-dir here were refused before this node reached
    # the store, so node 0 waited out its startup timeout and blamed a missing node; node 0's to give.
    # Those of `node0_given` node 0 must have been given too (the agent refuses the attempt otherwise).
    checked = node0_given(options)
    node0 = [flag for flag, given in (("--metrics-out", options.metrics_out), ("--trace", options.trace is not None),
                                      ("--tensorboard", options.tensorboard), ("--max-restarts", ckpt.max_restarts),
                                      ("--pin-cpus", options.pin_cpus)) if given] + list(checked)
    if node0 and options.show_progress:  # the same command on every node stays valid (found in QA: it said
        # "take effect as node 0 was given them" of options node 0 was not given)
        print(f"node {nodes.node_rank}: {', '.join(node0)} {'acts' if len(node0) == 1 else 'act'} on node 0 "
              "(it runs the coordinator): node 0's own options count, not those given here", file=sys.stderr)
    # Its own folder inside the run dir: the same command on every node, with a run dir on a
    # filesystem they share, gives one tree (node 0's files, and node-I/ for each other node).
    run_dir = RunDir(node_run_dir(options.run_dir, nodes.node_rank), pipeline, options.overrides) \
        if options.run_dir else None
    if options.show_progress:
        print(f"{pipeline.name}: node {nodes.node_rank} of {nodes.nnodes}, joining node 0 at "
              f"{nodes.endpoint[0]}:{nodes.endpoint[1]}" + (f"; run directory: {run_dir.path}" if run_dir else ""),
              file=sys.stderr)
    previous = catch_stops()
    try:
        Agent(nodes, secret=secret, host=host, interface=options.interface, timeouts=Timeouts.from_env(),
              pipeline=pipeline.to_dict(), files=files, given=checked, worker_log=run_dir.worker_log if run_dir else (lambda name: None),
              log=(lambda text: print(text, file=sys.stderr, flush=True)) if options.show_progress else
              (lambda text: None)).run()
    except Terminated:  # found in QA: said "interrupted" only, though the run may go on without this node
        print(f"node {nodes.node_rank}: terminated (SIGTERM or SIGHUP): node 0 takes it as a lost node and, with "
              "--max-restarts left, restarts the run, which waits for this node: start this command again to "
              "rejoin", file=sys.stderr)
        raise
    finally:
        release(previous)
        if run_dir is not None:
            run_dir.close()
    if options.show_progress:
        print(f"node {nodes.node_rank}: the run is done", file=sys.stderr)
    return []


def _as_baseline(pipeline: Any, checked: Any, options: RunOptions) -> tuple[Any, Any]:
    """The monolithic baseline's one-section pipeline (and its checks), refusing what it cannot do."""
    import dataclasses

    from maestro_flow.baseline.monolithic import monolithic_pipeline
    from maestro_flow.graph import SectionGraph

    if options.baseline != "monolithic":
        raise PipelineError(f"--baseline must be 'monolithic', got {options.baseline!r}")
    ckpt = options.checkpoint  # every checkpoint flag (found in QA: --checkpoint-every alone asked for a dir)
    refused = [flag for flag, given in (("--colocated", options.colocated), ("--nnodes", (options.nnodes or 1) > 1),
                                        ("--record", options.record), ("--checkpoint-dir", ckpt.dir),
                                        ("--checkpoint-every", ckpt.every is not None),
                                        ("--keep-last", ckpt.keep_last is not None),
                                        ("--checkpoint-errors", ckpt.on_error is not None),
                                        ("--checkpoint-on-term", ckpt.on_term), ("--resume", ckpt.resume),
                                        ("--max-restarts", ckpt.max_restarts)) if given]
    if refused:
        raise PipelineError(f"--baseline monolithic is a one-node comparison run in its own layout, without checkpoints "
                            f"or recordings: drop {', '.join(refused)}")
    devices = options.devices if options.devices is not None else sum(s.dp * s.tp for s in pipeline.sections)
    if options.devices is None and devices > pipeline.global_batch:
        raise PipelineError(f"--devices defaults to the {devices} ranks of the pipeline's sections, more than "
                            f"global_batch={pipeline.global_batch} (a rank of the baseline takes a share of every "
                            f"global batch): pass --devices {pipeline.global_batch} or fewer")
    fused = monolithic_pipeline(pipeline, devices, options.micro_batch)
    fused.validate()
    sharded = [f"sections.{s.name}" for s in pipeline.sections if s.tp > 1 or s.fsdp]
    if sharded and options.show_progress:  # found in QA: dropped in silence (the README says so)
        print(f"note: --baseline monolithic holds every section whole on each rank: the tp and fsdp of "
              f"{', '.join(sharded)} are not used", file=sys.stderr)
    if options.overrides.get("schedule") == "wavefront" and options.show_progress:  # (found in QA: in silence)
        print("note: --baseline monolithic runs each rank's share of a batch in data order, as a Megatron-style "
              "trainer does: --schedule wavefront is not used", file=sys.stderr)
    return fused, dataclasses.replace(checked, graph=SectionGraph(fused))


def _trace_path(options: RunOptions) -> str | None:
    """Where the trace goes: --trace's file; "" (the flag alone): the run dir's trace.json."""
    if options.trace == "":
        return os.path.join(options.run_dir, "trace.json") if options.run_dir else "trace.json"
    return options.trace


def run_pipeline(path: str, options: RunOptions) -> list[dict[str, Any]]:
    pipeline, paths = load_pipeline(path, options.overrides)
    checked = check_pipeline(pipeline)  # bad input is refused here, before any worker starts
    for warning in checked.data_warnings:  # the CLI printed the others; like them, even with --quiet
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    original = pipeline
    if options.baseline is not None:
        pipeline, checked = _as_baseline(pipeline, checked, options)
    elif options.devices is not None or options.micro_batch is not None:
        given = " and ".join(f for f, v in (("--devices", options.devices), ("--micro-batch", options.micro_batch))
                             if v is not None)
        raise PipelineError(f"{given} {'set' if ' and ' in given else 'sets'} the monolithic baseline (--baseline "
                            "monolithic), " + (
            "which is not --colocated: drop " + given if options.colocated else "so add --baseline monolithic")
            + " (section mode takes each section's dp and micro_batch, e.g. --set sections.NAME.dp=2)")
    nodes = Nodes.from_options(options.nnodes, options.node_rank, options.rdzv_endpoint, options.nproc_per_node)
    if nodes.multi and options.checkpoint.on_term:  # each node's agent takes SIGTERM as its node lost
        raise PipelineError("--checkpoint-on-term works on one node for now: with several, a SIGTERM to a node "
                            "stops that node's workers, so the checkpoint could not be written; drop it")
    if options.colocated:
        ignored = [flag for flag, given in (("--nnodes", nodes.multi), ("--pin-cpus", options.pin_cpus),
                                            ("--host", options.host), ("--secret-file", options.secret_file),
                                            ("--nproc-per-node", options.nproc_per_node)) if given]
        if ignored:
            raise PipelineError(f"--colocated runs in one process, with no workers or control plane: drop "
                                f"{', '.join(ignored)}")
    try:
        cuda_ipc.wait_mode()  # read by each worker of this node; bad values are refused before any starts
        cpus.env_threads(), Timeouts.from_env(), env_flag("MAESTRO_SHM"), env_flag("MAESTRO_CUDA_IPC")
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    host = resolve_host(options, nodes)
    check_interface(options.interface)
    secret = None if options.colocated else control_secret(options, host, nodes)
    files = None  # what node 0 and the others compare beyond the settings (runtime/fingerprint.py)
    if nodes.multi:
        from maestro_flow.runtime.fingerprint import fingerprint

        files = fingerprint(pipeline, path, checked.source)
    if nodes.node_rank != 0:
        return _run_agent(pipeline, options, nodes, host, secret, files)
    # Hosted from here: a refusal below reaches the other nodes, as the job's outcome (runtime/meeting.py).
    meeting = Meeting(nodes, secret, Timeouts.from_env().startup_s) if nodes.multi else None
    try:
        return _lead(pipeline, original, checked, paths, options, nodes, host, secret, files, meeting)
    except BaseException as exc:
        release_outputs()  # before node 0 waits to tell the other nodes (found in review)
        if meeting is not None and not meeting.ended:
            wait_s = _end_wait_s()
            if isinstance(exc, KeyboardInterrupt):  # (and Terminated, once caught): not waiting for nodes to join
                meeting.end(f"failed: {_outcome(exc)}", wait_s)
            else:
                refused = isinstance(exc, (PipelineError, CheckpointError))
                previous = catch_stops()  # found in review: SIGTERM while waiting lost the reason (default action)
                try:
                    meeting.refuse(REFUSED_RUN + _outcome(exc) if refused else _outcome(exc), wait_s)
                finally:
                    release(previous)
        raise
    finally:
        release_outputs()  # what check_outputs held (a --metrics-out: for a run refused before its report)
        if meeting is not None:  # every agent has said goodbye, or will not
            meeting.close()


def _lead(pipeline: Any, original: Any, checked: Any, paths: Any, options: RunOptions, nodes: Nodes, host: str,
          secret: bytes | None, files: dict[str, Any] | None, meeting: Meeting | None) -> list[dict[str, Any]]:
    """Node 0 (or the only node): the coordinator's run, from the checks of what only it is given."""
    nodes.assign(placement_for(checked.graph))  # refused here when the ranks cannot be placed on the nodes
    ckpt = options.checkpoint
    if options.colocated and (ckpt.dir or ckpt.resume or ckpt.max_restarts or ckpt.on_term):  # before what else
        raise PipelineError("checkpoints, --resume, --max-restarts and --checkpoint-on-term are for section mode; "
                            "drop --colocated")  # they need (found in QA)
    ckpt.validate()
    check_outputs(options, original, _trace_path(options))  # (the baseline saves the original sections: their files)
    resume = _resume_from(options, pipeline, checked.metadata)
    if resume is not None and not ckpt.dir:  # found in QA: a resumed long job went on saving nothing, silently
        parent = os.path.dirname(os.path.abspath(resume[0]))
        # Its own folder takes the checkpoints that follow only where none is past the one resumed.
        there = f"--checkpoint-dir {shlex.quote(parent)}" if mf.latest(parent) == os.path.abspath(resume[0]) else \
            "--checkpoint-dir DIR (a folder without later checkpoints)"
        print(f"warning: --resume without --checkpoint-dir: this run writes no checkpoints (to go on saving: "
              f"{there} --checkpoint-every N)", file=sys.stderr, flush=True)
    checkpointer = Checkpointer(ckpt)  # one for the whole job, across restarts
    checkpointer.claim(resume[1] if resume else None, pipeline.to_dict())  # held until the job ends (closed below)
    checkpointer.resumed_from = resume[0] if resume else None
    run_dir = None
    try:  # refused from here on: the directory's lock goes with the refusal (found in review: it was held)
        record = None  # checked before anything is written (the run dir, the trace, TensorBoard's folder)
        if options.record:
            if options.record not in checked.graph.sections:
                raise PipelineError(f"--record: no section named {options.record!r} "
                                    f"(sections: {', '.join(checked.graph.order)})")
            if not options.run_dir:
                raise PipelineError("--record needs a run directory (drop --no-run-dir)")
            first = resume[1].step if resume else 0
            wanted = options.record_steps.ranges if options.record_steps is not None else ()
            never = Steps(ranges=tuple((lo, hi) for lo, hi in wanted if lo < first or hi >= pipeline.steps))
            if never.ranges:
                raise PipelineError(f"--record-steps: this run never reaches step {never} (it runs "
                                    f"steps {first} to {pipeline.steps - 1}: --steps sets how many)")
            rec = pipeline.section(options.record)
            if rec.trainable and (rec.fsdp or rec.tp > 1):  # found in QA: nothing said so
                print(f"note: --record {rec.name}: a sharded section records no weights; to replay a step N > 0 "
                      "give `maestro stage` --weights from `maestro export CKPT/step-N`", file=sys.stderr)
            record = {"dir": os.path.abspath(options.run_dir), "section": options.record,
                      "steps": [list(r) for r in wanted] if options.record_steps is not None else None}
        if options.tensorboard:
            from maestro_flow.runtime.tensorboard import check_available

            check_available()  # before anything is written
        sampler = EpochSampler(checked.metadata, pipeline.global_batch, pipeline.seed, shuffle=pipeline.data.shuffle)
        skipped = getattr(checked.source, "num_skipped", 0)
        if options.show_progress:
            from maestro_flow.runtime.colocated import colocated_mode

            mode = colocated_mode(pipeline) if options.colocated else count(sum(s.dp * s.tp for s in pipeline.sections),
                                                                            "worker")
            if options.baseline:
                fused = pipeline.sections[0]
                mode = (f"monolithic baseline: {fused.dp} data-parallel ranks, each running every section on "
                        f"micro-batches of {fused.micro_batch}")
            per_epoch, left = divmod(len(checked.metadata), pipeline.global_batch)
            which = "drawn anew each epoch" if pipeline.data.shuffle else "the last rows"
            left_out = (f" (epochs of {per_epoch} steps: {left} samples of each are left out, {which})"
                        if left and pipeline.steps > per_epoch else "")  # found in QA: said nowhere
            print(f"{pipeline.name}: {len(checked.metadata)} samples from {pipeline.data.path}"
                  f"{skipped_note(skipped)}, {pipeline.steps} steps of "
                  f"{pipeline.global_batch}{left_out}, {mode}", file=sys.stderr)
        run_dir = RunDir(options.run_dir, pipeline, options.overrides) if options.run_dir else None
        if run_dir is not None:
            checkpointer.on_event = run_dir.event
        trace = _trace_path(options)
        if run_dir is not None and options.show_progress:
            print(f"run directory: {run_dir.path}"
                  + (f" (an earlier run's files moved to {run_dir.set_aside})" if run_dir.set_aside else ""),
                  file=sys.stderr)
        if resume is not None and options.show_progress:
            print(f"resuming from {resume[0]} (after step {resume[1].step}{mf.skipped_note(resume[0])})",
                  file=sys.stderr)
        metrics = [p for p in (options.metrics_out, run_dir.metrics if run_dir else None) if p]
        observer = RunObserver(run_dir=run_dir, trace_path=trace)
        sinks = []
        if options.tensorboard:
            from maestro_flow.runtime.tensorboard import TensorBoardSink

            # One folder per run under DIR, as TensorBoard expects: `tensorboard --logdir DIR` shows
            # the runs side by side (two runs in one folder drew one curve, two points a step).
            sinks.append(TensorBoardSink(default_run_dir(pipeline, root=options.tensorboard,
                                                         instead="give --tensorboard a writable folder")))
            if options.show_progress:
                print(f"tensorboard: {sinks[-1].log_dir}", file=sys.stderr)
        report = RunReport(total_steps=pipeline.steps, metrics_out=metrics, show_progress=options.show_progress,
                           sinks=sinks, resume_at=resume[1].step if resume else None,
                           stop_on_nan=options.stop_on_nan, batches_per_epoch=sampler.per_epoch)
        checkpointer.diverged_from = lambda: report.diverged_from  # what --keep-last keeps (Checkpointer._purge)
    except BaseException:
        checkpointer.close()
        if run_dir is not None:  # and the run dir's (found in review: held while node 0 told the other nodes)
            run_dir.close()
        raise
    saved, failure = False, None  # saved: the run ended without an exception, so its --save-dir save completed
    previous = catch_stops(checkpointer)
    try:
        if options.colocated:
            from maestro_flow.runtime.colocated import run_colocated

            run_colocated(pipeline, checked.source, sampler, report, save_dir=options.save_dir, observer=observer,
                          record=record)
        else:
            from maestro_flow.runtime.coordinator import Coordinator
            from maestro_flow.runtime.restart import supervise

            def attempt(resume_at: tuple[str, mf.Manifest] | None, restarts: int) -> None:
                Coordinator(pipeline, checked.graph, sampler, report, paths=paths, save_dir=options.save_dir,
                            observer=observer, run_dir=options.run_dir, record=record, checkpointer=checkpointer,
                            resume=resume_at, restarts=restarts, carried_restarts=carried, secret=secret, host=host,
                            interface=options.interface, nodes=nodes, rdzv=rdzv, rdzv_key=rkey, files=files,
                            pin_cpus=options.pin_cpus, given=node0_given(options)).run()

            rdzv, rkey = (meeting.store, meeting.key) if meeting is not None else (None, None)
            carried = resume[1].restarts if resume else 0
            try:
                supervise(attempt, max_restarts=ckpt.max_restarts, committed=lambda: checkpointer.committed,
                          stopping=lambda: checkpointer.term_asked,
                          resume=resume, restarts=carried,
                          log=lambda text: print(text, file=sys.stderr, flush=True),
                          on_restart=run_dir.event if run_dir is not None else lambda event: None)
            except BaseException as exc:
                if meeting is not None:
                    meeting.end(f"failed: {_outcome(exc)}", _end_wait_s(),
                                getattr(exc, "lost_nodes", set()))
                raise
            if meeting is not None:
                meeting.end("done", _end_wait_s())
            if options.save_dir and pipeline is not original:  # the baseline saves the sections as section mode
                from maestro_flow.checkpoint.savedir import save_pipeline

                save_pipeline(options.save_dir, original.to_dict())
    except BaseException as exc:  # what `maestro top` says of a run it watched end (found in QA: "ended" of a failure)
        failure = exc  # (end_save's note goes with it, printed after its error: review)
        if run_dir is not None:
            run_dir.event({"ended": "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed",
                           "why": _outcome(exc, "the run"), "code": exit_code_of(exc)})  # top exits with it
        raise
    else:
        saved, fatal = True, checkpointer.final_state_lost(options.save_dir)  # fatal: raised below
        if run_dir is not None:  # found in review: "done", then exit 1
            run_dir.event({"ended": "failed", "why": fatal, "code": 1} if fatal else {"ended": "done", "code": 0})
    finally:
        if options.save_dir:  # the earlier run's files it set aside: deleted, or named where the save failed
            end_save(options.save_dir, original.to_dict(), saved=saved, failure=failure)
        release(previous)
        checkpointer.close()
        report.close()
        observer.close()
        if options.show_progress:
            if report.rows:
                print(report.table(), file=sys.stderr)
            if trace:
                print(f"trace: {trace} (open it in ui.perfetto.dev)", file=sys.stderr)
            if run_dir is not None:
                print(f"run directory: {run_dir.path}", file=sys.stderr)
    if options.show_progress:
        print(report.summary(), file=sys.stderr)
        if checkpointer.committed:  # what the run leaves to go on from (found in QA: the summary named neither)
            print(f"newest checkpoint: {checkpointer.committed}", file=sys.stderr)
        if options.save_dir and not fatal:
            files = ", ".join(f"{s.name}.safetensors" for s in original.sections if s.trainable)
            print(f"weights: {options.save_dir} ({files}; `maestro export {shlex.quote(options.save_dir)} --section S "
                  "-o OUT` takes one out)", file=sys.stderr)
    if record is not None and run_dir is not None:
        idle = idle_steps(run_dir.path, record["section"], options.record_steps)[0]
        if idle:
            print(f"note: --record {record['section']}: no sample activated it at {steps_text(idle)}, "
                  "so nothing was recorded there", file=sys.stderr)
    if fatal:
        raise CheckpointError(fatal)
    if checkpointer.unsaved is not None:
        print(f"warning: {checkpointer.unsaved_note()}; the trained weights are in --save-dir {options.save_dir}",
              file=sys.stderr)
    return report.rows

