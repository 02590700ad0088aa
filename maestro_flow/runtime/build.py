"""Import user code (pipeline files, stage classes, sample sources) and build stages.

Runs in the coordinator (for checks and colocated mode) and in every worker. Stage paths
resolve with the pipeline file's folder and the current directory on sys.path, in every process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from maestro_flow.config import Pipeline, Section
from maestro_flow.errors import PipelineError


def add_paths(paths: list[str]) -> None:
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)


def search_paths(pipeline_file: str | None) -> list[str]:
    paths = [os.getcwd()]
    if pipeline_file:
        folder = str(Path(pipeline_file).resolve().parent)
        paths.insert(0, folder)
        # pipelines/x.py commonly names stages.* and loaders.* from the project root beside it.
        paths.append(str(Path(folder).parent))
    return paths


# Pipeline files imported within `imports_once`, by (path, mtime, size): a command that loads its
# pipeline more than once (with --costs, then to check it, then to run it) imports the file once.
# None outside: every load imports the file again (a program that loads a pipeline in a loop sees
# its module-level code run each time, as it expects).
_imported: dict[tuple[str, int, int], Any] | None = None


@contextlib.contextmanager
def imports_once() -> Iterator[None]:
    """Within the block (one `maestro` command), each pipeline file is imported once."""
    global _imported
    outer, _imported = _imported, {} if _imported is None else _imported
    try:
        yield
    finally:
        _imported = outer


def load_pipeline(path: str, overrides: dict[str, Any] | None = None) -> tuple[Pipeline, list[str]]:
    """Import a pipeline file (once per `imports_once` block while it is unchanged) and call its
    `pipeline(**overrides)`; returns it and the search paths."""
    file = Path(path)
    if not file.is_file():
        raise PipelineError(f"pipeline file not found: {path}")
    paths = search_paths(str(file))
    add_paths(paths)
    stat = file.stat()
    key = (str(file.resolve()), stat.st_mtime_ns, stat.st_size)
    module = _imported.get(key) if _imported is not None else None
    if module is None:
        spec = importlib.util.spec_from_file_location(f"maestro_pipeline_{file.stem}", file)
        if spec is None:  # not a .py file (found in review: a run folder's pipeline.json gave a traceback)
            raise PipelineError(f"{path}: not a Python pipeline file (give a .py file that defines "
                                "pipeline(**overrides))")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except PipelineError:
            raise
        except Exception as exc:
            raise PipelineError(f"{path}: importing the pipeline file failed: {type(exc).__name__}: {exc}") from exc
        if _imported is not None:
            _imported[key] = module
    factory = getattr(module, "pipeline", None)
    if not callable(factory):
        raise PipelineError(f"{path}: defines no function pipeline(**overrides) -> maestro_flow.Pipeline")
    try:
        pipeline = factory(**(overrides or {}))
    except PipelineError:
        raise
    except Exception as exc:
        raise PipelineError(f"{path}: pipeline(**overrides) failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(pipeline, Pipeline):
        raise PipelineError(f"{path}: pipeline() returned {type(pipeline).__name__}, not maestro_flow.Pipeline")
    return pipeline, paths


def resolve(path: str, where: str) -> Any:
    """Import "module:Attr"; a failure names `where` (the field) and the path."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise PipelineError(f"{where}: cannot import {path!r}: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PipelineError(f"{where}: module {module_name!r} has no attribute {attr!r} (from {path!r})") from None


def section_seed(seed: int, section: str) -> int:
    """Same for every replica of a section (DP replicas start identical), stable across processes."""
    return (seed * 1_000_003 + zlib.crc32(section.encode())) % (2**31)


def replica_seed(seed: int, section: str, replica: int, step: int = 0) -> int:
    """The seed of one replica's draws while it trains (dropout), from step `step` on: its own, so
    replicas draw independent masks (found in QA: every replica drew the same stream, so replica
    k's dropout masks repeated replica 0's and the noise changed with dp); the tp ranks of a
    replica share it, as their replicated activations must draw alike."""
    return zlib.crc32(f"{section_seed(seed, section)}/{replica}/{step}".encode()) % (2**31)


def resolve_device(section: Section, local_index: int) -> str:
    import torch

    if section.device.startswith("cuda:"):
        return section.device
    want_cuda = section.device == "cuda" or (section.device == "auto" and torch.cuda.is_available())
    if section.device == "cuda" and not torch.cuda.is_available():
        raise PipelineError(f"sections.{section.name}.device is 'cuda' but no CUDA device is available here")
    if want_cuda:
        return f"cuda:{local_index % torch.cuda.device_count()}"
    return "cpu"


def build_stage(pipeline: Pipeline, section: Section, replica: int, device: str, *, meta: bool = False,
                keep_on_cpu: bool = False) -> Any:
    """Construct a section's stage exactly as every mode does (same seed, dtype, device).

    `meta`: build its tensors on the meta device (shapes only, no memory, no values), for checks.
    `keep_on_cpu`: leave its modules on the CPU (the stage is still told `device`): a sharded
    section's are moved to the device as they are sharded (FSDP and tp move each unit's shard),
    so the device never holds the whole section (runtime/worker.py)."""
    import torch

    from maestro_flow.stage import Stage, StageContext

    cls = resolve(section.stage, f"sections.{section.name}.stage")
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise PipelineError(f"sections.{section.name}.stage: {section.stage!r} is not a maestro_flow.Stage subclass")
    dtype = getattr(torch, pipeline.dtype)
    seed = section_seed(pipeline.seed, section.name)
    ctx = StageContext(section=section.name, replica=replica, num_replicas=section.dp, device=torch.device(device),
                       dtype=dtype, seed=seed, trainable=section.trainable,
                       placeholder_ids=dict(pipeline.data.placeholder_ids),
                       modality_columns=dict(pipeline.data.modality_columns))
    # Modules are built directly in the pipeline's dtype (initialising in float32 and casting
    # would give other float64 values than building in float64), with a seeded generator.
    with default_dtype(dtype), (torch.device("meta") if meta else contextlib.nullcontext()):
        if not meta:
            torch.manual_seed(seed)
        stage = cls(dict(section.config), ctx)
    if not meta:  # the weights are the section's; what the replica draws from here on is its own
        from maestro_flow.checkpoint.rng import reseed

        reseed(replica_seed(pipeline.seed, section.name, replica))
    stray = _stray(stage)
    if stray:  # found in QA: an nn.Parameter on the stage itself trained in a plain loop, never here
        raise PipelineError(f"sections.{section.name}.stage: {section.stage} keeps {' and '.join(w for w, _ in stray)} "
                            "outside its nn.Module attributes (Stage.modules()), so the runtime would not train, save or "
                            f"move {'it' if len(stray) == 1 else 'them'}: {'; '.join(f for _, f in stray)}")
    for module in stage.modules().values():
        module.to(device=torch.device("meta" if meta else "cpu" if keep_on_cpu else device), dtype=dtype)
    if not section.trainable:
        for p in stage.parameters():
            p.requires_grad_(False)
    return stage


def _stray(stage: Any) -> list[tuple[str, str]]:
    """The stage's attributes holding parameters its modules do not (an nn.Parameter on the stage
    itself, modules in a plain list, tuple or dict), each as (what, the fix). A plain list of modules
    that are attributes too (references) is fine."""
    from torch import nn

    held = {id(p) for p in stage.parameters()}
    stray = []
    for name, value in vars(stage).items():
        items = list(value.values()) if isinstance(value, dict) else list(value) if isinstance(value, (list, tuple)) \
            else [value]
        params = [p for v in items if isinstance(v, (nn.Parameter, nn.Module))
                  for p in ([v] if isinstance(v, nn.Parameter) else v.parameters())]
        if isinstance(value, nn.Module) or all(id(p) in held for p in params):
            continue
        if isinstance(value, nn.Parameter):
            stray.append((f"self.{name} (an nn.Parameter)", f"hold self.{name} in a module (an nn.ParameterDict, "
                                                              "or an attribute of an nn.Module of the stage)"))
        else:
            kind = "an nn.ModuleDict or nn.ParameterDict" if isinstance(value, dict) else \
                "an nn.ModuleList or nn.ParameterList"
            stray.append((f"self.{name} (a {type(value).__name__} of modules or parameters)",
                          f"make self.{name} {kind}"))
    return stray


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    """torch's default dtype set for a block (stage code may create tensors without a dtype)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def open_source(pipeline: Pipeline) -> Any:
    cls = resolve(pipeline.data.source, "data.source")
    return cls(pipeline.data)


def unresolved(pipeline: Pipeline) -> list[str]:
    """Why each section's stage cannot be imported, or its tp layout cannot work (none: all can).
    Found in QA: `graph` drew a tp=2 of a model without a tensor-parallel plan, which plan,
    tune and validate refuse."""
    from maestro_flow.runtime.checks import check_tensor_parallel

    out = []
    for s in pipeline.sections:
        try:
            cls = resolve(s.stage, f"sections.{s.name}.stage")
            if s.tp > 1:
                check_tensor_parallel(pipeline, s, cls)
        except PipelineError as exc:
            out.append(str(exc))
    return out
