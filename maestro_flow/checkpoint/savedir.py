"""`--save-dir`: each trainable section's parameters as `<save_dir>/<section>.safetensors`.

Runs in the process that holds replica 0 of a section (DP replicas hold identical parameters
after every step, so replica 0's copy is the gathered one) — in every rank of a sharded section
(tensor parallel or FSDP), which gather the full tensors together — and in the coordinator, which writes
`<save_dir>/pipeline.json` (the resolved pipeline, so `maestro export` can rebuild a section's
model). A file holds what the section trains: its trainable parameters and its buffers, keyed as
in the stage's `state_dict()`; frozen parameters that live inside a trainable stage (the KD
student's copy of the teacher's LM head) are left out — they are rebuilt from the configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

PIPELINE_FILE = "pipeline.json"


def trainable_state(stage: Any) -> dict[str, torch.Tensor]:
    """The stage's state_dict without its frozen parameters."""
    frozen = {name for name, p in stage.named_parameters() if not p.requires_grad}
    return {k: v for k, v in stage.state_dict().items() if k not in frozen}


def full_state(stage: Any) -> dict[str, torch.Tensor]:
    """The trainable state with sharded (DTensor) entries gathered: a collective over the section's
    ranks when any entry is sharded (every rank calls it, in the same key order). Gathered over
    gloo, the entries are on the CPU; over NCCL, on the device."""
    import logging

    from torch.distributed.tensor import DTensor

    # Gathering an FSDP x TP shard takes two all-gathers, which torch logs as "suboptimal" per
    # tensor; once, at the end of a run, it is what a gather costs.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    hosts: dict[int, Any] = {}
    try:
        return {k: (_full_tensor(v, hosts) if isinstance(v, DTensor) else v).detach()
                for k, v in trainable_state(stage).items()}
    finally:
        log.setLevel(level)


def _full_tensor(v: Any, hosts: dict[int, Any]) -> torch.Tensor:
    """A DTensor gathered whole. The mesh dimensions over gloo groups (a CPU section, or ranks
    sharing one GPU) are gathered in host memory, on a CPU mesh of the same groups (`hosts`: one
    per mesh), the others (NCCL) on the device first. gloo's all-gathers of CUDA tensors are
    not all supported (pytorch issues #152645, #132709), and a gather for --save-dir of FSDP/TP
    sections on one shared GPU crashed (tools/bench/RESULTS.md 9.1): the suspected cause."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = v.device_mesh
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    gloo = [dist.get_backend(g) == "gloo" for g in groups]
    if not any(gloo):
        return v.full_tensor()
    if not all(gloo):  # NCCL dimensions first, on the device
        v = v.redistribute(mesh, [p if g else Replicate() for p, g in zip(v.placements, gloo, strict=True)])
    host = hosts.get(id(mesh))
    if host is None:
        # The list form, even in 1-D: it keeps the mesh's own rank order (so each rank's coordinate).
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        host = hosts[id(mesh)] = DeviceMesh.from_group(groups, "cpu", mesh=mesh.mesh, mesh_dim_names=names)
    local = v.to_local().detach().cpu()
    return DTensor.from_local(local, host, v.placements, run_check=False, shape=v.shape,
                              stride=v.stride()).full_tensor()


def save_stage(stage: Any, save_dir: str, section: str, *, write: bool = True) -> str:
    """Gather the stage's trainable state and (when `write`) write it to save_dir/<section>.safetensors.
    A stage that holds other sections' stages (the monolithic baseline's, `saved_sections()`)
    writes each of them as that section would."""
    parts = getattr(stage, "saved_sections", None)
    if callable(parts):
        return [save_stage(part, save_dir, name, write=write) for name, part in parts().items()][-1]
    path = os.path.join(save_dir, f"{section}.safetensors")
    gathered = full_state(stage)
    if not write:
        return path
    os.makedirs(save_dir, exist_ok=True)
    # clone: tied weights share storage, which safetensors refuses to write twice.
    state = {k: v.cpu().clone().contiguous() for k, v in gathered.items()}
    write_safetensors(state, path, {"section": section})
    return path


def write_safetensors(state: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """`state` to `path` whole or not at all (a temporary file, then a rename), readable as the
    process's umask says like every other file written (safetensors creates files 0600: found in
    review, teammates could not read an export), and a failed write (a full disk) an OSError, as
    for any other file (safetensors raises its own error type: a traceback before)."""
    tmp = path + ".tmp"
    try:
        save_file(state, tmp, metadata=metadata)
        readable(tmp)
    except (OSError, SafetensorError) as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise
        raise OSError(f"{path}: {exc}") from exc
    try:
        os.replace(tmp, path)
    except OSError:  # a folder in the way (found in this session: the .tmp file stayed)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def readable(path: str) -> None:
    """Give a file the mode the process's umask gives new files (0644 under the usual 022), where
    the filesystem keeps modes (one that does not, say vfat, refuses chmod: the file stays as it is)."""
    try:
        os.chmod(path, 0o666 & ~_umask())
    except OSError:
        pass


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def save_pipeline(save_dir: str, pipeline_dict: dict[str, Any]) -> str:
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, PIPELINE_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(pipeline_dict, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


PREVIOUS = ".previous"  # an earlier run's file, set aside while this run's replaces it (begin_save)


def _saved_sections(pipeline_dict: dict[str, Any]) -> list[str]:
    """The sections whose files a run of this pipeline writes: its trainable ones, and for the
    monolithic baseline's one section, those of the pipeline it runs (as save_stage writes them;
    found in review: the baseline's own name was set aside, and the sections' files overwritten)."""
    from maestro_flow.baseline.monolithic import STAGE

    names: list[str] = []
    for s in pipeline_dict["sections"]:
        if s.get("stage") == STAGE:
            names += _saved_sections(s["config"]["pipeline"])
        elif s.get("trainable", True):
            names.append(s["name"])
    return names


def _own_files(save_dir: str, pipeline_dict: dict[str, Any]) -> list[str]:
    """The files a run of this pipeline writes in `save_dir`: pipeline.json and each saved section's."""
    return [os.path.join(save_dir, name) for name in
            (PIPELINE_FILE, *(f"{section}.safetensors" for section in _saved_sections(pipeline_dict)))]


def begin_save(save_dir: str, pipeline_dict: dict[str, Any]) -> str:
    """Before the workers write their sections: set aside (FILE.previous) the files an earlier run
    left for this pipeline, then write pipeline.json. A run stopped in between leaves a
    pipeline.json with no section file (export says so), never one beside an earlier run's
    weights; and a save that fails (a full disk) loses none of them (found in QA: they were
    deleted first). `end_save` deletes them, or says where they are. Where files set aside by an
    earlier failed save are still there, they stay the ones kept, and what that failed save
    wrote goes (found in review: the next save replaced them with the failed one's). Only files
    move: what else is in the way stays, and the section's own write says why."""
    own = _own_files(save_dir, pipeline_dict)
    kept = any(os.path.isfile(path + PREVIOUS) for path in own)
    for path in filter(os.path.isfile, own):
        try:
            if kept:
                os.remove(path)
            else:
                os.replace(path, path + PREVIOUS)
        except OSError:  # what cannot go: the section's own write says why
            pass
    return save_pipeline(save_dir, pipeline_dict)


def end_save(save_dir: str, pipeline_dict: dict[str, Any], *, saved: bool,
             failure: BaseException | None = None) -> None:
    """After the run: the files begin_save set aside are deleted where this run's save completed
    (`saved`), and otherwise named, with how to take them back: a note added to the run's
    `failure`, which `maestro` prints after the error's own line (found in review: the note came
    first), or printed now. Never raises (the run's own outcome stands; found in review: a folder
    in the way turned a finished run into a traceback)."""
    kept = [path + PREVIOUS for path in _own_files(save_dir, pipeline_dict) if os.path.isfile(path + PREVIOUS)]
    if saved:
        for path in kept:
            try:
                os.remove(path)
            except OSError as exc:
                print(f"warning: --save-dir {save_dir}: cannot remove {path} ({exc.strerror or exc})", file=sys.stderr)
    elif kept:
        names = ", ".join(os.path.basename(p) for p in kept)
        note = (f"note: --save-dir {save_dir}: this run's save did not complete; the files an earlier run saved "
                f"there are kept as {names} (drop the '{PREVIOUS}' to use them again)")
        if failure is not None:  # (add_note is Python 3.11's: found in review, 3.10 raised AttributeError)
            failure.__notes__ = [*getattr(failure, "__notes__", []), note]
        else:
            print(note, file=sys.stderr)
