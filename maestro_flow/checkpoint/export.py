"""`maestro export`: a trained section's parameters out of a checkpoint or a `--save-dir`.

Runs in the CLI process, without torch.distributed (DCP reads a checkpoint in one process,
whatever dp wrote it). Writes `OUT/<section>.safetensors` (keys as in the stage's state_dict,
trainable parameters and buffers). When the section's stage class names, in its class attribute
`hugging_face_model`, the attribute holding a transformers model (as `stages.hf:HFCausalLM`
does), the stage is built as a run builds it, given the weights, and that model writes itself
into OUT with its own `save_pretrained` (`config.json`, `generation_config.json`,
`model.safetensors`): a folder that `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads.
Every failure is a PipelineError naming what to change.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from maestro_flow.checkpoint import digest
from maestro_flow.checkpoint import manifest as mf
from maestro_flow.checkpoint.savedir import PIPELINE_FILE, readable, write_safetensors
from maestro_flow.errors import PipelineError
from maestro_flow.runtime.outputs import check_writable


@dataclass(frozen=True, slots=True)
class Exported:
    files: list[str]
    source: str
    note: str | None = None  # what was not written and why (a stage not importable here), or how to load it


def export_section(source: str, section: str, out: str) -> Exported:
    check_writable(out, "-o", folder=True)  # a traceback before (found in review), as run's --save-dir was
    held = mf.holds_checkpoints(out)  # found in QA: later exports of that folder were then refused
    if held:
        raise PipelineError(f"-o {out} {held}: export into a folder of its own (a folder holding both cannot be "
                            "exported from again)")
    pipeline, state, where = _read(mf.find_folder(source, "SOURCE"), section)
    spec = next((s for s in pipeline.get("sections", []) if s.get("name") == section), None)
    if spec is None:  # _read refuses a section not there in what maestro writes: a hand-edited file
        raise PipelineError(f"--section {section}: {where} holds it, but its pipeline has no section of that name")
    os.makedirs(out, exist_ok=True)
    _one_model_folder(out, section)
    path = os.path.join(out, f"{section}.safetensors")
    write_safetensors({k: v.contiguous() for k, v in state.items()}, path, {"section": section, "source": where})
    try:
        files, note = _hugging_face(pipeline, spec, state, out)
    except _NotImportable as exc:
        return Exported(files=[path], source=where, note=str(exc))
    return Exported(files=[path, *files], source=where, note=note)


def _one_model_folder(out: str, section: str) -> None:
    """A folder holding another section's Hugging Face export (its config.json beside that
    section's file) takes no other section: its config.json and model.safetensors would be
    overwritten, or left beside this section's file (found in QA)."""
    if not os.path.exists(os.path.join(out, "config.json")):
        return
    from safetensors import safe_open

    for name in sorted(os.listdir(out)):
        if not name.endswith(".safetensors") or name in ("model.safetensors", f"{section}.safetensors"):
            continue
        try:
            with safe_open(os.path.join(out, name), framework="pt") as f:
                other = (f.metadata() or {}).get("section")
        except Exception:  # noqa: BLE001 (not an export of ours)
            continue
        if other and other != section:
            raise PipelineError(f"-o {out} holds section {other!r}'s Hugging Face export ({name}, config.json): "
                                f"export section {section!r} into a folder of its own")


class _NotImportable(Exception):
    """The section's stage cannot be imported here: whether it owns a Hugging Face model is unknown."""



def _read(source: str, section: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """(pipeline configuration, the section's parameters, where they came from)."""
    saved = os.path.join(source, f"{section}.safetensors")
    newest = mf.latest(source)
    if os.path.isfile(saved) and newest is not None and os.path.realpath(newest) != os.path.realpath(source):
        # found in QA: a --save-dir that was also the --checkpoint-dir gave the saved (older) weights, in silence
        raise PipelineError(f"{source} holds both {section}.safetensors (a --save-dir's or an export's) and "
                            "checkpoints: export "
                            f"{newest} for the newest checkpoint, or move {section}.safetensors and {PIPELINE_FILE} "
                            "to a folder of their own for the saved weights")
    if os.path.isfile(saved):  # a --save-dir
        try:
            with open(os.path.join(source, PIPELINE_FILE)) as f:
                pipeline = json.load(f)
        except FileNotFoundError:
            raise PipelineError(f"{source} has {section}.safetensors but no {PIPELINE_FILE} (written by "
                                "--save-dir since this version): re-save it, or export from a checkpoint") from None
        spec = next((s for s in pipeline.get("sections", []) if s.get("name") == section), None)
        if spec is None or not spec.get("trainable", True):  # found in QA: an earlier run's file, exported as this one's
            why = "has no such section" if spec is None else "holds it frozen (frozen sections are not saved)"
            raise PipelineError(f"--section {section}: {saved} is left from an earlier run: the pipeline that saved "
                                f"into {source} last ({PIPELINE_FILE}) {why}; it saved: {', '.join(_saved(source, pipeline)) or 'none'}")
        return pipeline, load_file(saved), saved
    folder = newest
    if folder is None:
        if os.path.isfile(os.path.join(source, PIPELINE_FILE)):  # a --save-dir without this section
            with open(os.path.join(source, PIPELINE_FILE)) as f:
                pipeline = json.load(f)
            if isinstance(pipeline, dict) and isinstance(pipeline.get("sections"), list):  # not a run dir's file
                _check_section(pipeline, section, source, _saved(source, pipeline))
        from maestro_flow.runtime.rundir import checkpoints_note

        raise PipelineError(f"{source}: neither a --save-dir with {section}.safetensors nor a complete checkpoint"
                            f"{checkpoints_note(source)}")
    again = f"maestro export {{}} --section {section} -o DIR"  # what to run on the checkpoint before a damaged one
    manifest = mf.read(folder, use=again)
    if section not in manifest.sections:
        _check_section(manifest.pipeline, section, folder, sorted(manifest.sections))
    if not os.path.isdir(os.path.join(folder, section)):
        raise PipelineError(f"--section {section}: {folder} holds no parameters for it (it has no trainable "
                            "parameters)")
    digest.check(folder, {k: v for k, v in manifest.files.items() if k.startswith(f"{section}/")},
                 f"{folder} (section {section})", mf.earlier(folder, move=False, use=again))  # the files it reads
    try:
        return manifest.pipeline, _load_dcp(os.path.join(folder, section)), folder
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        from maestro_flow.checkpoint.section_state import SectionState, interrupted

        if interrupted(exc):  # Ctrl-C while reading: not a damaged checkpoint
            raise KeyboardInterrupt from None
        cause = SectionState.cause(exc).strip().splitlines()[0]
        raise PipelineError(f"{folder}: cannot read section {section!r} ({os.path.join(folder, section)}): "
                            f"{cause}{mf.earlier(folder, move=False, use=again)}") from None


def _saved(source: str, pipeline: dict[str, Any]) -> list[str]:
    """The sections a --save-dir holds this pipeline's weights of: its trainable ones with a file."""
    names = [s.get("name") for s in pipeline.get("sections", []) if s.get("trainable", True)]
    return [n for n in names if os.path.isfile(os.path.join(source, f"{n}.safetensors"))]


def _check_section(pipeline: dict[str, Any], section: str, where: str, trainable: list[str]) -> None:
    """Refuse a `section` that `where` (a --save-dir or a checkpoint) holds no parameters of:
    no such section, or a frozen one."""
    names = [s["name"] for s in pipeline.get("sections", [])]
    listed = ", ".join(trainable) or "none"
    if section not in names:
        raise PipelineError(f"--section: {where} has no section {section!r} (sections: {', '.join(names)}; "
                            f"saved: {listed})")
    raise PipelineError(f"--section {section}: not a trainable section of {where} (saved: {listed}); frozen "
                        "sections are not saved, their weights come from their configuration")


def _load_dcp(folder: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    target = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.items()
              if k.startswith("model/") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, checkpoint_id=folder, no_dist=True)
    return {k[len("model/"):]: v for k, v in target.items()}


def _hugging_face(pipeline: dict[str, Any], spec: dict[str, Any], state: dict[str, torch.Tensor],
                  out: str) -> tuple[list[str], str | None]:
    """Build the section's stage as a run does, load the weights, and let the transformers model
    it owns write itself (save_pretrained): the files written (none when the stage class names no
    such model), and a note when loading them back needs more than the folder."""
    from maestro_flow.config import Pipeline
    from maestro_flow.runtime.build import add_paths, build_stage, resolve, search_paths

    add_paths(search_paths(None))  # stage paths resolve from the current directory, as in a run
    try:
        stage_class = resolve(spec["stage"], f"sections.{spec['name']}.stage")
    except PipelineError as exc:  # the safetensors file never needs the stage; only a Hugging Face folder does
        raise _NotImportable(f"{exc}; no Hugging Face folder written (if the stage owns one, export from the "
                             f"directory the run started in, or with the pipeline's folder on PYTHONPATH)") from None
    model_attr = getattr(stage_class, "hugging_face_model", None)
    if model_attr is None:
        return [], None
    p = Pipeline.from_dict(pipeline)
    try:
        stage = build_stage(p, p.section(spec["name"]), 0, "cpu")
    except Exception as exc:
        raise PipelineError(f"section {spec['name']!r}: building {spec['stage']} for the Hugging Face export "
                            f"failed: {type(exc).__name__}: {exc}") from None
    frozen = {name for name, param in stage.named_parameters() if not param.requires_grad}
    for attr, module in stage.modules().items():
        prefix = attr + "."
        missing, unexpected = module.load_state_dict(
            {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=False)
        missing = [k for k in missing if prefix + k not in frozen and not _is_tied(module, k)]
        if missing or unexpected:
            raise PipelineError(f"section {spec['name']!r}: the saved weights do not fit {spec['stage']} "
                                f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model = getattr(stage, model_attr)
    before = {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    model.save_pretrained(out)
    # What save_pretrained wrote: new files and those it rewrote (a re-export into the same folder),
    # readable as the umask says (its model.safetensors is 0600, as safetensors makes files).
    written = [os.path.join(out, name) for name in sorted(os.listdir(out))
               if before.get(name) != os.stat(os.path.join(out, name)).st_mtime_ns]
    for path in written:
        readable(path)
    # transformers keeps no attn_implementation in config.json, and from_pretrained picks sdpa
    # where the model has it (found in QA: a phi3 trained with eager reloaded 5e-8 off in float64).
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    default = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    note = (f"section {spec['name']!r} ran with attn_implementation={attn!r}, which config.json does not keep: "
            f"from_pretrained({out!r}, attn_implementation={attn!r}) computes what it trained (the default, "
            f"{default}, can differ at rounding)") if attn and attn != default else None
    return written, note


def _is_tied(module: torch.nn.Module, key: str) -> bool:
    """Whether parameter `key` shares its tensor with another name (stored once, loaded with it)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return key in params and sum(p is params[key] for p in params.values()) > 1
