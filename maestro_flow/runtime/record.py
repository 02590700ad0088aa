"""Recordings of what one section received and produced, micro-batch by micro-batch.

`maestro run --record SECTION` calls `save_micro_batch` in the section's executor for the chosen
steps; `maestro stage PIPELINE SECTION --replay RUN_DIR` reads them back with
`load_micro_batches` and runs the section alone on exactly those inputs.

Layout: `RUN_DIR/record/<section>-<replica>/step<STEP:06d>-mb<INDEX:04d>.safetensors`, one file
per micro-batch. Tensor keys:

  columns/<name>/<i>   dataset column entry of the i-th sample of the micro-batch (tensors as they
                       were; bytes as uint8 tensors; numpy arrays converted to tensors)
  inputs/<name>/<i>    incoming tensor of the i-th sample (absent where it was None)
  outputs/<name>/<i>   per-sample output (a list output; absent where the entry was None)
  outputs/<name>       batched output tensor (a 0-dim loss included)
  rng/cpu, rng/cuda    the RNG states (torch.get_rng_state(); the CUDA device's, on CUDA) as
                       they were before the forward, so a replay draws what the run drew
                       (dropout): `recorded_rng`

The safetensors metadata (str -> str, each value JSON) holds "format", "step", "index",
"sample_ids", "modalities" (sorted lists), "failed" where the stage raised on the micro-batch
(the phase: "forward", Stage.prepare's included, or "backward"; the run stopped there) and, under "columns", "inputs" and "outputs", how to
rebuild every entry: a column or input entry is {"kind": "tensor"} | {"kind": "bytes"} |
{"kind": "scalar", "value": V} (None is a scalar with value null; V is JSON: a number, a string,
lists and string-keyed dicts of them, nested) | {"kind": "other", "repr": "..."} (anything else:
kept as text for the report only, loaded as TextOnly, never replayed); an output is {"kind": "list", "entries": [entry, ...]}
or an entry.

Beside them, `weights-step<STEP:06d>.safetensors` (save_weights): the stage's state_dict as it
was for that step's forwards, so a replay of step N runs with step N's parameters (not for a
sharded section: `Recorder`). A frozen section's file, where its state's content is the same as
at the last step recorded (a digest of every tensor's bytes), is a hard link to that step's: one
copy on disk (found in QA: a frozen teacher's whole weights were written again at every step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from typing import Any

import numpy as np
import torch

from maestro_flow.stage import MicroBatch

FORMAT = "maestro-record/1"
_FILE = re.compile(r"^step(\d{6,})-mb(\d{4,})\.safetensors$")

__all__ = ["FORMAT", "file_name", "save_micro_batch", "load_micro_batches", "recording_dirs", "record_dir",
           "save_weights", "recorded_weights", "rng_states", "recorded_rng", "recorded_failure", "restore_rng",
           "Recorder", "Steps", "idle_steps", "planned", "metric_rows", "steps_text"]


def file_name(step: int, index: int) -> str:
    return f"step{step:06d}-mb{index:04d}.safetensors"


def record_dir(run_dir: str, section: str, replica: int) -> str:
    """Where replica `replica` of `section` writes its recording in a run folder."""
    return os.path.join(run_dir, "record", f"{section}-{replica}")


def recording_dirs(run_dir: str, section: str) -> list[str]:
    """The recording folders of `section` in `run_dir` (one per replica), by replica number."""
    root = os.path.join(run_dir, "record")
    if not os.path.isdir(root):
        return []
    found = []
    prefix = f"{section}-"
    for name in os.listdir(root):
        rest = name[len(prefix):]
        if name.startswith(prefix) and rest.isdigit() and os.path.isdir(os.path.join(root, name)):
            found.append((int(rest), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Steps:
    """Steps as inclusive ranges (`--record-steps`, `maestro stage --steps`; never expanded:
    "0-999999999" is two numbers)."""

    ranges: tuple[tuple[int, int], ...]

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and any(lo <= step <= hi for lo, hi in self.ranges)

    def __str__(self) -> str:
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in sorted(self.ranges))


def idle_steps(run_dir: str, section: str, steps: Steps | None = None) -> tuple[list[int], list[int]]:
    """(the steps of `steps` (None: all) whose plan gave `section` no micro-batch, every step
    planned), from RUN_DIR/plans.jsonl (the last plan of a step replayed after a restart); both
    empty without the file. Found in QA: --record of an encoder at steps where no sample
    activated it wrote nothing and said nothing, and the replay then advised recording it."""
    last = planned(run_dir, section)
    return sorted(s for s, mbs in last.items() if not any(mbs) and (steps is None or s in steps)), sorted(last)


def planned(run_dir: str, section: str, lines: dict[int, int] | None = None) -> dict[int, list[int]]:
    """step -> the micro-batches each replica of `section` ran at it, from RUN_DIR/plans.jsonl (the
    last plan of a step replayed after a restart); empty without the file. `lines`, where given,
    gets each step's number of plans (one per attempt that planned it)."""
    last: dict[int, list[int]] = {}
    try:
        with open(os.path.join(run_dir, "plans.jsonl")) as f:
            for line in f:
                try:
                    plan = json.loads(line)
                    last[int(plan["step"])] = [len(mbs) for mbs in plan["sections"][section]["replicas"]]
                    if lines is not None:
                        lines[int(plan["step"])] = lines.get(int(plan["step"]), 0) + 1
                except (ValueError, KeyError, TypeError):  # a line cut short by a kill, or another pipeline's
                    continue
    except OSError:
        return {}
    return last


def metric_rows(run_dir: str) -> dict[int, int]:
    """step -> its rows in RUN_DIR/metrics.jsonl (one per attempt that finished it); empty without
    the file, a cut line skipped."""
    rows: dict[int, int] = {}
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    step = int(json.loads(line).get("step"))
                    rows[step] = rows.get(step, 0) + 1
    except OSError:
        pass
    return rows


def steps_text(steps: list[int]) -> str:
    """'step 3' or 'steps 0, 1'."""
    return f"step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}"


# -- saving -------------------------------------------------------------------------------------

def _tensor(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().clone()


class TextOnly(str):
    """A recorded value that was kept as its repr only (not JSON-able, e.g. a dict of tensors):
    the report shows it; `--compare` cannot compare it."""

    def __repr__(self) -> str:
        return f"<recorded as text: {str(self)}>"


_PLAIN = (bool, int, float, str)


def _json(value: Any) -> Any:
    """A JSON-able copy of a plain value (numbers, strings, None, and lists, tuples and
    string-keyed dicts of them, nested: a column of boxes), numpy scalars and arrays as Python
    values; raises TypeError for anything else."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if value is None or isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json(v) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def _scalar_or_text(value: Any) -> dict[str, Any]:
    """The entry of a non-tensor value: a JSON-able one as JSON (`_json`), anything else as its
    repr."""
    try:
        return {"kind": "scalar", "value": _json(value)}
    except TypeError:
        return {"kind": "other", "repr": repr(value)[:200]}


def _entry(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Store one column/input/list-output entry; returns how to rebuild it."""
    if isinstance(value, torch.Tensor):
        tensors[key] = _tensor(value)
        return {"kind": "tensor"}
    if isinstance(value, np.ndarray):
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value).copy())
        return {"kind": "tensor"}
    if isinstance(value, (bytes, bytearray, memoryview)):
        tensors[key] = torch.frombuffer(bytearray(bytes(value)), dtype=torch.uint8).clone() if len(value) else \
            torch.zeros(0, dtype=torch.uint8)
        return {"kind": "bytes"}
    return _scalar_or_text(value)


def _output(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    key = f"outputs/{name}"
    if isinstance(value, torch.Tensor):
        tensors[key] = _tensor(value)
        return {"kind": "tensor"}
    if isinstance(value, (list, tuple)):
        return {"kind": "list", "entries": [_entry(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]}
    return _scalar_or_text(value)


def rng_states(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The RNG states a forward on `device` draws from, as `save_micro_batch` takes them."""
    states = {"rng/cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        states["rng/cuda"] = torch.cuda.get_rng_state(device)
    return states


def save_micro_batch(directory: str, batch: MicroBatch, outputs: dict,
                     rng: dict[str, torch.Tensor] | None = None, failed: str | None = None) -> str:
    """Write what a section received (`batch`) and produced (`outputs`), with the RNG states
    taken before its forward (`rng_states`), to one file; returns its path. `failed`: the phase
    (forward, backward) in which the stage raised on this micro-batch, the run's last."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {k: v.clone() for k, v in (rng or {}).items()}
    columns = {name: [_entry(v, f"columns/{name}/{i}", tensors) for i, v in enumerate(values)]
               for name, values in batch.columns.items()}
    inputs = {name: [_entry(v, f"inputs/{name}/{i}", tensors) for i, v in enumerate(values)]
              for name, values in batch.inputs.items()}
    outs = {name: _output(value, name, tensors) for name, value in (outputs or {}).items()}
    metadata = {
        "format": json.dumps(FORMAT),
        "step": json.dumps(int(batch.step)),
        "index": json.dumps(int(batch.index)),
        "sample_ids": json.dumps([int(s) for s in batch.sample_ids]),
        "modalities": json.dumps([sorted(m) for m in batch.modalities]),
        "columns": json.dumps(columns),
        "inputs": json.dumps(inputs),
        "outputs": json.dumps(outs),
        **({"failed": json.dumps(failed)} if failed else {}),
    }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, file_name(batch.step, batch.index))
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


# -- loading ------------------------------------------------------------------------------------

def _rebuild(entry: dict[str, Any], key: str, tensors: dict[str, torch.Tensor]) -> Any:
    kind = entry["kind"]
    if kind == "tensor":
        return tensors[key]
    if kind == "bytes":
        return tensors[key].numpy().tobytes()
    if kind == "other":
        return TextOnly(entry.get("repr", ""))
    return entry.get("value")


def _rebuild_output(entry: dict[str, Any], name: str, tensors: dict[str, torch.Tensor]) -> Any:
    key = f"outputs/{name}"
    kind = entry["kind"]
    if kind == "tensor":
        return tensors[key]
    if kind == "list":
        return [_rebuild(e, f"{key}/{i}", tensors) for i, e in enumerate(entry["entries"])]
    return _rebuild(entry, key, tensors)


def load_file(path: str) -> tuple[MicroBatch, dict[str, Any]]:
    """One recorded micro-batch and the outputs the section produced for it."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt") as f:
        raw = f.metadata() or {}
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    if "format" not in raw:
        raise ValueError(f"{path}: not a maestro recording (no 'format' in its metadata)")
    meta = {k: json.loads(v) for k, v in raw.items()}
    if meta["format"] != FORMAT:
        raise ValueError(f"{path}: a recording of format {meta['format']!r}; this version reads {FORMAT!r} "
                         f"(record the run again with this version)")
    columns = {name: [_rebuild(e, f"columns/{name}/{i}", tensors) for i, e in enumerate(entries)]
               for name, entries in meta["columns"].items()}
    inputs = {name: [_rebuild(e, f"inputs/{name}/{i}", tensors) for i, e in enumerate(entries)]
              for name, entries in meta["inputs"].items()}
    outputs = {name: _rebuild_output(e, name, tensors) for name, e in meta["outputs"].items()}
    batch = MicroBatch(step=meta["step"], index=meta["index"], sample_ids=list(meta["sample_ids"]),
                       modalities=[frozenset(m) for m in meta["modalities"]], columns=columns, inputs=inputs)
    return batch, outputs


def recorded_failure(path: str) -> str | None:
    """The phase in which the run's stage raised on a recorded micro-batch (None: it did not)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        failed = (f.metadata() or {}).get("failed")
    return None if failed is None else json.loads(failed)


def recorded_rng(path: str) -> dict[str, torch.Tensor]:
    """The RNG states recorded with a micro-batch ({} for a recording made without them)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys() if key.startswith("rng/")}


def restore_rng(states: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Set the RNG states `recorded_rng` gave (the CUDA one only where the replay runs on CUDA)."""
    if "rng/cpu" in states:
        torch.set_rng_state(states["rng/cpu"])
    if "rng/cuda" in states and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["rng/cuda"], device)


def recorded_files(directory: str) -> list[tuple[int, int, str]]:
    """(step, index, path) of every recording file in `directory`, sorted."""
    out = []
    for name in os.listdir(directory):
        m = _FILE.match(name)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), os.path.join(directory, name)))
    return sorted(out)


def load_micro_batches(directory: str) -> list[tuple[MicroBatch, dict[str, Any]]]:
    """Every recorded micro-batch of one folder with its recorded outputs, by (step, index)."""
    return [load_file(path) for _, _, path in recorded_files(directory)]


# -- weights ------------------------------------------------------------------------------------

def weights_name(step: int) -> str:
    return f"weights-step{step:06d}.safetensors"


def save_weights(directory: str, step: int, stage: Any) -> str | None:
    """The stage's state at the start of `step` (Recorder.begin: before its first forward of the
    step), once per step: replay loads it so that recorded outputs of later steps can be compared. Returns
    the path, or None when it was already written."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, weights_name(step))
    if os.path.exists(path):
        return None
    state = {k: _tensor(v) for k, v in stage.state_dict().items()}
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(state, tmp, metadata={"step": json.dumps(int(step))})
    os.replace(tmp, path)
    return path


def _digest(stage: Any) -> str:
    """A digest of the stage's state as save_weights writes it: each tensor's name, dtype, shape
    and bytes."""
    h = hashlib.blake2b(digest_size=20)
    for name, value in stage.state_dict().items():
        t = value.detach().to("cpu").resolve_conj().resolve_neg().contiguous()  # (a conj view: found in review)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def recorded_weights(directory: str, step: int) -> str | None:
    path = os.path.join(directory, weights_name(step))
    return path if os.path.exists(path) else None


class Recorder:
    """What `maestro run --record` saves in one replica's executor: for each micro-batch of the
    chosen `steps` (None: all), `begin` before its forward (the step's weights at micro-batch 0,
    so a forward that changes buffers replays from where it started; the RNG states it draws
    from), `save` after it, or `fail` where the stage raised on it (in Stage.prepare, forward, or
    backward: marked `failed` with the outputs it returned if any; a replay then raises as the run
    did). A sharded section's replica (fsdp, or tp > 1: recorded by its
    tensor-parallel leader alone) holds no whole weights: it records no weights, and a replay
    takes them from --weights (a checkpoint taken at the recorded step, exported whole by
    `maestro export`; --save-dir's file holds the last step's). A
    recording that fails (a full disk) stops, said once on the worker's output; the run goes on."""

    def __init__(self, directory: str, steps: Steps | None, weights: bool = True) -> None:
        self.directory, self.steps, self.weights, self.stopped = directory, steps, weights, False
        self._last: tuple[str, str] | None = None  # a frozen section's weights file written last, and its digest

    def begin(self, step: int, index: int, stage: Any, device: torch.device | None) -> dict[str, torch.Tensor] | None:
        """The RNG states to save with the micro-batch (after saving the weights at index 0), or
        None where it is not recorded."""
        if self.stopped or (self.steps is not None and step not in self.steps):
            return None

        def start() -> dict[str, torch.Tensor]:
            if index == 0 and self.weights:
                self._save_weights(step, stage)
            return rng_states(device)

        return self._guarded(start)

    def _save_weights(self, step: int, stage: Any) -> None:
        """save_weights, or for a frozen section (no parameter requires a gradient) a hard link to
        the last file written where its state's content is the same. Not version counters: a
        `.data` update or a fused optimizer changes a tensor without them (found in review)."""
        digest = None
        if not any(p.requires_grad for p in stage.parameters()):  # frozen
            try:
                digest = _digest(stage)
            except Exception:  # noqa: BLE001 (a state it cannot hash is written in full, as before)
                digest = None
        path = os.path.join(self.directory, weights_name(step))
        if self._last is not None and digest == self._last[1] and not os.path.exists(path):
            try:
                os.link(self._last[0], path)
                return
            except OSError:  # a filesystem without hard links: written again
                pass
        written = save_weights(self.directory, step, stage)  # (None: there already)
        if written is not None:
            self._last = (written, digest) if digest is not None else None

    def save(self, batch: MicroBatch, outputs: dict, rng: dict[str, torch.Tensor]) -> None:
        self._guarded(lambda: save_micro_batch(self.directory, batch, outputs, rng))

    def fail(self, batch: MicroBatch, outputs: dict, rng: dict[str, torch.Tensor] | None, phase: str) -> None:
        """Save a micro-batch the stage raised on (its `phase`), where it is recorded (`rng` None: not)."""
        if rng is not None:
            self._guarded(lambda: save_micro_batch(self.directory, batch, outputs, rng, phase))

    def _guarded(self, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 (a debugging aid: the training goes on whatever it hit)
            print(f"recording stopped ({self.directory}): {type(exc).__name__}: {exc}; the run goes on", flush=True)
            self.stopped = True
            return None
