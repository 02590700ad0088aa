"""Every wire message of the control plane, who sends it to whom, and when.

Pure (standard library only). A message is a flat dict with a type tag "t"; fields are plain
data (ints, floats, strings, lists, dicts), so msgpack carries them and nothing is ever pickled.
`check` refuses unknown types, missing fields and fields of the wrong type, so a malformed frame
is refused before anything reads it (receivers drop it and log why; see protocol/auth.py).

Worker -> coordinator (DEALER -> ROUTER):
  hello      on connect: protocol version, rank, pid, the worker's tensor-header address and
             host key (which workers share memory: transport/host.host_key). The
             coordinator binds the connection to that rank; it accepts nothing else from a
             connection before its hello, and a rank's hello only once
  ready      stage built, process groups formed; the worker waits for plans (`setup`: seconds
             spent importing, building the stage, joining the world, forming the groups, the rest)
  heartbeat  every Timeouts.heartbeat_interval_s from the worker's control thread
  loss       a loss section replica finished its micro-batches: loss sum and denominator (sent
             only when trainable sections upstream need the denominator; the loss section itself
             sums it with its gradients)
  norm       a trainable replica reduced its gradients (only with Pipeline.grad_clip): its share of
             the squared global gradient norm; it waits for `clip` before its optimizer step
  done       a replica finished a step (after its optimizer step): timings and counts
  error      a stage error or a system error, the traceback formatted as text by the worker
  saved      the worker wrote its part of a checkpoint (info: what the manifest records of it), or
             could not (error: one line on why; the traceback goes to the worker's log)
  bye        the worker saved what it was asked to and is exiting

Coordinator -> worker:
  init       after hello: pipeline config, placement, rendezvous store, peers' header addresses,
             the channels that go through shared memory (`shm`, [src, dst, kind] each) and
             those through CUDA IPC (`ipc`, optional, the same form),
             the trace's epoch and the coordinator's wall clock at sending (`now`; None for a
             worker on the coordinator's host, which reads the same clock), whether to trace, and what to
             record for replay ({"dir", "section", "steps"} or None), and the checkpoint to resume
             from (a folder, or None)
  plan       one step's plan, restricted to what this replica needs (a lockstep FSDP section's
             also `rounds` and `probe`: micro-batches every replica runs, a sample to fill them;
             under --pin-cpus, a busiest section's worker also `io_cpus`: the cores for its
             message threads, runtime/cpus.py)
  finalize   every loss replica reported: the step's global loss denominator, to the trainable
             sections upstream of that loss
  clip       every trainable replica reported its norm share: the step's clip coefficient, to all
             of them
  checkpoint every worker is between steps (no later plan sent yet): save your part into path
  stop       shut down (optionally saving trainable parameters first)
  ping       every Timeouts.heartbeat_interval_s: the coordinator is alive (a worker that hears
             nothing for Timeouts.coordinator_timeout_s exits)

Worker -> worker (PUSH -> PULL, on the tensor-header sockets):
  tensors    the header that precedes tensor bytes sent over torch.distributed: kind "fwd"
             (activations along an edge) or "bwd" (gradients back along it); between CPU workers
             on one host the bytes are in a shared-memory slot instead, named by `shm` ([slot,
             byte offsets], transport/shm.py), and between two workers on one GPU in a CUDA IPC
             slot, named by `ipc` ([slot, byte offsets, the slot's IPC handles the first time it
             is sent, else None], transport/cuda_ipc.py)
  release    the receiver of slots holds no view of them any more: the sender may reuse them
             (its own stream, sender name "rank<N>/release")
  progress   a consumer finished a forward micro-batch: a producer gated on it may go on
             (run-ahead credits, see Plan.gates)
"""

from __future__ import annotations

from typing import Any

PROTOCOL_VERSION = 8

FIELDS: dict[str, tuple[str, ...]] = {
    "hello": ("version", "rank", "pid", "data_addr"),
    "ready": ("rank",),
    "heartbeat": ("rank",),
    "loss": ("rank", "step", "loss_sum", "denominator"),
    "norm": ("rank", "step", "sq"),
    "done": ("rank", "step", "stats"),
    "error": ("rank", "kind", "section", "replica", "step", "phase", "traceback"),
    "saved": ("rank", "step", "info", "error"),
    "bye": ("rank",),
    "init": ("rank", "pipeline", "placement", "store", "peers", "timeouts", "paths", "epoch", "now", "trace",
             "record", "resume", "shm"),
    "plan": ("step", "micro_batches", "samples", "routes", "gates", "notify"),
    "finalize": ("step", "denominator"),
    "clip": ("step", "coef"),
    "checkpoint": ("step", "path"),
    "stop": ("save_dir",),
    "ping": (),
    "tensors": ("src", "kind", "edge", "step", "entries", "buffers"),
    "progress": ("src", "step", "finished"),
    "release": ("src", "slots"),
}

# Fields a message may carry or leave out (a hello's host key is optional so that a worker of
# another protocol version still parses, and its version mismatch is reported).
OPTIONAL: dict[str, tuple[str, ...]] = {"hello": ("host_key",), "heartbeat": ("status",), "tensors": ("shm", "ipc"),
                                        "ready": ("setup",), "plan": ("rounds", "probe", "io_cpus"),
                                        "init": ("ipc",)}

_NUM = (int, float)
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
# The type of every field (a field's type is the same in every message unless listed per message).
TYPES: dict[str, tuple[type, ...]] = {
    "version": (int,), "rank": (int,), "pid": (int,), "data_addr": (str,), "step": (int,),
    "loss_sum": _NUM, "denominator": _NUM, "sq": _NUM, "coef": _NUM, "stats": (dict,), "kind": (str,),
    "section": (str,), "replica": (int,), "phase": (str,), "traceback": (str,), "info": (dict,),
    "error": _OPT_STR, "pipeline": (dict,), "placement": (dict,), "store": (list,), "peers": (dict,),
    "timeouts": (dict,), "paths": (list,), "epoch": _NUM, "now": (int, float, type(None)), "trace": (bool,),
    "record": (dict, type(None)),
    "resume": _OPT_STR, "micro_batches": (list,), "samples": (list,), "routes": (dict,), "gates": (list,),
    "notify": (list,), "path": (str,), "save_dir": _OPT_STR, "src": (int,), "edge": (int,), "entries": (list,),
    "buffers": (list,), "finished": (int,), "status": (dict,), "session": (str,), "host_key": _OPT_STR,
    "slots": (list,), "setup": (dict,), "rounds": (int,), "probe": (list,), "io_cpus": (list,),
}
TYPES_OF: dict[tuple[str, str], tuple[type, ...]] = {("error", "step"): _OPT_INT, ("tensors", "shm"): (list, type(None)),
                                                     ("init", "shm"): (list,), ("tensors", "ipc"): (list, type(None)),
                                                     ("init", "ipc"): (list,)}


class ProtocolError(Exception):
    """A frame that is not a valid message of this protocol version."""


def make(t: str, **fields: Any) -> dict[str, Any]:
    msg = {"t": t, **fields}
    check(msg)
    return msg


def check(msg: Any) -> dict[str, Any]:
    if not isinstance(msg, dict) or "t" not in msg:
        raise ProtocolError(f"not a message: {str(msg)[:80]!r}")
    expected = FIELDS.get(msg["t"]) if isinstance(msg["t"], str) else None
    if expected is None:
        raise ProtocolError(f"unknown message type {msg['t']!r}")
    missing = [f for f in expected if f not in msg]
    if missing:
        raise ProtocolError(f"message {msg['t']!r} lacks {', '.join(missing)}")
    for name, value in msg.items():
        types = TYPES_OF.get((msg["t"], name)) or TYPES.get(name)
        if types is not None and not isinstance(value, types):
            raise ProtocolError(f"message {msg['t']!r}: field {name!r} is {type(value).__name__}, "
                                f"not {' or '.join(t.__name__ for t in types)}")
    return msg
