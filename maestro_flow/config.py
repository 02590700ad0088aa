"""Pipeline configuration records: Pipeline, Section, Edge, ArrowData, Cost.

Pure data (standard library only). These records are what a pipeline file returns and what the
coordinator sends to every worker (as plain dicts, see `to_dict`/`from_dict`), so they hold no
live objects. Field-level checks live here (`validate()` methods); checks that need the whole
graph live in `graph.py`, and checks that need imports or files live in `runtime/checks.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from maestro_flow.errors import PipelineError
from maestro_flow.samples import MODALITIES

DTYPES = ("float32", "float64", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "auto")
SCHEDULES = ("wavefront", "fifo")
OPTIMIZERS = ("adamw", "sgd")
LR_DECAYS = ("cosine", "linear", "constant")
SCHEDULE_KEYS = ("warmup_steps", "decay", "min_lr")  # optimizer keys that shape the lr, not the optimizer
MIXED_PRECISION = ("bf16",)
MAX_DEGREE = 1 << 16  # a section's dp, tp and micro_batch at most (a typo of 10^9 was planned until memory ran out)


def is_number(value: Any) -> bool:
    """An int or float from a config (a bool, which Python counts as an int, is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_name(value: Any) -> bool:
    """A section or pipeline name: letters, digits, '_' and '-' only, so it is safe as a folder name
    (the run folder is runs/NAME-TIME) and in a `--set sections.NAME.FIELD` path."""
    return isinstance(value, str) and value.replace("_", "").replace("-", "").isalnum()


_KINDS: dict[type, str] = {}  # record class -> what an error calls it ("section", "data", ...)


def check_fields(cls: type, given: Any, at: str = "", prefix: str = "") -> None:
    """Refuse keys of `given` that are not fields of the record class `cls`, and missing required
    ones, naming the full dotted path `at` (e.g. sections.student), the valid fields and a close
    match: a misspelt field is named here, not left to a TypeError from the record's __init__."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kind = _KINDS.get(cls, cls.__name__)
    if not isinstance(given, dict):
        raise PipelineError(f"{prefix}{at or kind} must be a mapping of {kind} fields, got {given!r}")
    for name in given:
        if name not in fields:
            raise unknown_field(cls, name, at, prefix)
    for name, f in fields.items():
        if name not in given and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise PipelineError(f"{prefix}{at + ': ' if at else ''}missing required {kind} field {name!r}")


def unknown_field(cls: type, name: str, at: str = "", prefix: str = "") -> PipelineError:
    """`name` is no field of `cls` (at the dotted path `at`): the error names it, its path, the
    closest field (difflib) and all of them."""
    fields = sorted(f.name for f in dataclasses.fields(cls))
    path = f"{at}.{name}" if at else str(name)
    close = difflib.get_close_matches(str(name), fields, n=1)
    return PipelineError(f"{prefix}unknown {_KINDS.get(cls, cls.__name__)} field {name!r}"
                         + (f" at {path}" if path != name else "") + (f"; did you mean {close[0]!r}?" if close else "")
                         + f" (fields: {', '.join(fields)})")


def _named_fields(kind: str) -> Any:
    """Check a record's keyword arguments (check_fields) before its generated __init__ runs, so that
    `Section(micro_bach=4)` in a pipeline file names the section and the field it meant."""

    def wrap(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, **kwargs: Any) -> None:
            name = kwargs.get("name")
            at = {"pipeline": "", "data": "data",
                  "section": f"sections.{name}" if isinstance(name, str) else ""}.get(kind, "")
            check_fields(cls, kwargs, at)
            init(self, **kwargs)

        cls.__init__ = __init__
        _KINDS[cls] = kind
        return cls

    return wrap


@_named_fields("cost")
@dataclass(frozen=True, kw_only=True, slots=True)
class Cost:
    """The planner's starting cost model for one section: forward seconds per unit of work.

    A micro-batch's forward takes per_micro_batch_s plus the per-sample, per-token, per-patch and
    per-frame terms of its samples; a trainable section's backward takes `backward_factor` times
    its forward. During a run the coefficients are refined from measured micro-batch timings.
    `padded=True` says the stage pads every sample to the micro-batch's longest (as the stages
    shipped here do: stages/common.pad_right): the token, patch and frame terms are then charged
    for every sample at the lengths of the micro-batch's longest one (planner/cost.py).
    """

    per_sample_s: float = 1e-3
    per_token_s: float = 0.0
    per_patch_s: float = 0.0
    per_frame_s: float = 0.0
    backward_factor: float = 2.0  # backward time / forward time, for trainable sections
    per_micro_batch_s: float = 0.0  # a micro-batch's fixed forward seconds, whatever its samples
    padded: bool = False  # the stage pads each sample to the micro-batch's longest

    def validate(self, where: str) -> None:
        if not isinstance(self.padded, bool):
            raise PipelineError(f"{where}.cost.padded must be true or false, got {self.padded!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "padded" and (not is_number(value) or not 0 <= value <= MAX_COST):  # NaN fails this too
                raise PipelineError(f"{where}.cost.{f.name} must be a number from 0 to {MAX_COST:g}, got {value!r}")


# No cost figure (seconds per sample, token, patch, frame or micro-batch, or the backward factor)
# is anywhere near this; larger ones are mistakes, and overflowed the planner's sums to inf
# (found in review: 1.7e308 passed validate and crashed plan, tune and run).
MAX_COST = 1e6


@_named_fields("data")
@dataclass(frozen=True, kw_only=True, slots=True)
class ArrowData:
    """A sample dataset: an Arrow IPC file or a Parquet file/folder (DESIGN 5.1b).

    `source` names the reader as "module:Class" (resolved like a stage path), so the runtime never
    imports a concrete loader itself.
    """

    path: str
    source: str = "loaders.arrow:ArrowSource"
    placeholder_ids: dict[str, int] = field(default_factory=dict)
    skip_bad_rows: bool = False
    # False: every epoch takes the rows in file order (step s is rows [s*B, (s+1)*B) of the epoch).
    shuffle: bool = True
    # Which column carries a modality's payload, when not the column of that name
    # (e.g. {"image": "pixel_values"} for precomputed pixel arrays instead of encoded bytes).
    modality_columns: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        path = os.fspath(self.path) if isinstance(self.path, os.PathLike) else self.path  # a pathlib.Path too
        if not isinstance(path, str) or not path.strip():  # found in review: "" read the current folder
            raise PipelineError(f"data.path must name a file or folder, got {self.path!r}")
        if any(c in path for c in "*?[") and not os.path.exists(os.path.expanduser(path)):
            raise PipelineError(f"data.path: {path} is a pattern, which is not expanded: give a file, or a "
                                "folder of Parquet files")
        for key in ("shuffle", "skip_bad_rows"):  # `--set data.skip_bad_rows=False` is the string 'False'
            if not isinstance(getattr(self, key), bool):
                raise PipelineError(f"data.{key} must be true or false, got {getattr(self, key)!r}")
        if not isinstance(self.placeholder_ids, dict):
            raise PipelineError(f"data.placeholder_ids must map modalities to token ids, got {self.placeholder_ids!r}")
        for modality, token in self.placeholder_ids.items():
            if modality not in MODALITIES or modality == "text":
                raise PipelineError(f"data.placeholder_ids: {modality!r} is not a payload modality (image or audio)")
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise PipelineError(f"data.placeholder_ids.{modality} must be a token id (an integer >= 0), "
                                    f"got {token!r}")
        shared = sorted(m for m, t in self.placeholder_ids.items() if list(self.placeholder_ids.values()).count(t) > 1)
        if shared:  # found in QA: both payloads were spliced at the one token, the other read as text
            raise PipelineError(f"data.placeholder_ids: {' and '.join(shared)} share the token id "
                                f"{self.placeholder_ids[shared[0]]}: give each modality its own placeholder token")
        if not isinstance(self.modality_columns, dict):
            raise PipelineError(f"data.modality_columns must map modalities to column names, got {self.modality_columns!r}")
        for modality, column in self.modality_columns.items():
            if modality not in MODALITIES or modality == "text":
                raise PipelineError(f"data.modality_columns: {modality!r} is not a payload modality "
                                    f"(image or audio)")
            if not isinstance(column, str) or not column:
                raise PipelineError(f"data.modality_columns.{modality} must be a column name, got {column!r}")

    def column_of(self, modality: str) -> str:
        """The dataset column that carries `modality`'s payload."""
        return self.modality_columns.get(modality, modality)


@_named_fields("section")
@dataclass(frozen=True, kw_only=True, slots=True)
class Section:
    """A named stage plus its run settings."""

    name: str
    stage: str
    config: dict[str, Any] = field(default_factory=dict)
    trainable: bool = True
    activates_on: str | None = None
    dp: int = 1
    micro_batch: int = 1
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "adamw", "lr": 1e-3})
    device: str = "cpu"
    cost: Cost = field(default_factory=Cost)
    columns: tuple[str, ...] | None = None
    tp: int = 1  # tensor parallelism: a replica is a group of tp ranks (the stage's tp_plan shards it)
    fsdp: bool = False  # shard parameters, gradients and optimizer state over the dp replicas (FSDP2)

    def validate(self) -> None:
        where = f"sections.{self.name}"
        if not is_name(self.name):
            raise PipelineError(f"{where}.name must be a non-empty identifier, got {self.name!r}")
        if not isinstance(self.stage, str) or ":" not in self.stage:
            raise PipelineError(f"{where}.stage must be 'module:Class', got {self.stage!r}")
        for key, kind in (("trainable", bool), ("config", dict), ("optimizer", dict), ("device", str), ("fsdp", bool)):
            if not isinstance(getattr(self, key), kind):
                raise PipelineError(f"{where}.{key} must be a {kind.__name__}, got {getattr(self, key)!r}")
        for key in ("dp", "micro_batch", "tp"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PipelineError(f"{where}.{key} must be an integer >= 1, got {value!r}")
            if value > MAX_DEGREE:  # found in QA
                raise PipelineError(f"{where}.{key}={value} is more than {MAX_DEGREE}, the most this version takes")
        if self.activates_on is not None and self.activates_on not in MODALITIES:
            raise PipelineError(
                f"{where}.activates_on must be one of {', '.join(MODALITIES)} or None, "
                f"got {self.activates_on!r}"
            )
        if self.columns is not None and (not isinstance(self.columns, (list, tuple)) or not all(
                isinstance(c, str) and c for c in self.columns) or len(set(self.columns)) != len(self.columns)):
            raise PipelineError(f"{where}.columns must be None (every column) or a list of distinct column names, "
                                f"got {self.columns!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise PipelineError(f"{where}.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.trainable:
            name = self.optimizer.get("name")
            if name not in OPTIMIZERS:
                raise PipelineError(
                    f"{where}.optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {name!r}"
                )
            lr = self.optimizer.get("lr")
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
                other = [k for k in self.optimizer if isinstance(k, str) and k != "lr" and "learning" in k.lower()]
                hint = f" (it has {other[0]!r}: the field is 'lr')" if lr is None and other else ""  # found in QA
                raise PipelineError(f"{where}.optimizer.lr must be a finite number >= 0, got {lr!r}{hint}")
            self._validate_schedule(where, lr)
        self.cost.validate(where)
        _check_plain(self.config, f"{where}.config")

    def _validate_schedule(self, where: str, lr: float) -> None:
        opt = self.optimizer
        warmup = opt.get("warmup_steps", 0)
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise PipelineError(f"{where}.optimizer.warmup_steps must be an integer >= 0, got {warmup!r}")
        decay = opt.get("decay", "constant")
        if decay not in LR_DECAYS:
            raise PipelineError(f"{where}.optimizer.decay must be one of {', '.join(LR_DECAYS)}, got {decay!r}")
        min_lr = opt.get("min_lr", 0.0)
        if not is_number(min_lr) or not 0 <= min_lr <= lr:
            raise PipelineError(f"{where}.optimizer.min_lr must be a number in [0, lr={lr}], got {min_lr!r}")

    def activates(self, modalities: frozenset[str] | set[str] | tuple[str, ...]) -> bool:
        return self.activates_on is None or self.activates_on in modalities


@_named_fields("edge")
@dataclass(frozen=True, kw_only=True, slots=True)
class Edge:
    """`src -> dst` carrying named per-sample tensors; gradients flow back when both ends train."""

    src: str
    dst: str
    tensors: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"


@_named_fields("pipeline")
@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """A whole job: data, global batch, sections and edges."""

    name: str
    data: ArrowData
    sections: tuple[Section, ...]
    edges: tuple[Edge, ...] = ()
    global_batch: int = 16
    steps: int = 20
    seed: int = 0
    dtype: str = "float32"
    schedule: str = "wavefront"
    lookahead_steps: int = 1
    run_ahead: int | None = None  # samples a producer may get ahead of each consumer replica
    # Share of a step's planned seconds the wavefront planner may spend searching for a shorter
    # plan than its rules make (planner/refine.py; only where the plan is >2% over its bound); 0: off.
    # A run searches only where the coordinator plans ahead on a core of its own (coordinator.py).
    plan_search: float = 0.5
    adapt_costs: bool = True  # refine the sections' Cost from measured micro-batch timings
    grad_clip: float | None = None  # clip by the global norm of every trainable parameter (None: no clipping)
    mixed_precision: str | None = None  # "bf16": bf16 autocast compute and transfers, fp32 master weights

    def __post_init__(self) -> None:
        # Accept lists from users; store tuples so the record stays hashable and immutable.
        object.__setattr__(self, "sections", tuple(self.sections))
        object.__setattr__(self, "edges", tuple(self.edges))
        for e in self.edges:
            # A bare string is the classic missing-comma mistake: ("hidden") is not a tuple.
            if isinstance(e, Edge) and not isinstance(e.tensors, (tuple, str)):
                object.__setattr__(e, "tensors", tuple(e.tensors))

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise PipelineError(f"no section named {name!r} (sections: {', '.join(self.section_names)})")

    @property
    def section_names(self) -> list[str]:
        return [s.name for s in self.sections]

    def check_name(self) -> None:
        """The name alone, which a run uses as a folder name before it checks the rest (cli.py's run)."""
        if not is_name(self.name):
            raise PipelineError(f"name must be a non-empty identifier (letters, digits, '_' and '-': it names "
                                f"the run folder), got {self.name!r}")

    def validate(self) -> None:
        """Field checks plus graph checks; never imports user code or touches files."""
        from maestro_flow.graph import SectionGraph

        self.check_name()
        if not isinstance(self.adapt_costs, bool):
            raise PipelineError(f"adapt_costs must be true or false, got {self.adapt_costs!r}")
        if self.run_ahead is not None and (not isinstance(self.run_ahead, int) or self.run_ahead < 1):
            raise PipelineError(f"run_ahead must be an integer >= 1 or None, got {self.run_ahead!r}")
        if not is_number(self.plan_search) or not 0 <= self.plan_search <= 1:
            raise PipelineError(f"plan_search must be a number from 0 to 1, got {self.plan_search!r}")
        for key in ("global_batch", "steps", "lookahead_steps", "seed"):
            value = getattr(self, key)
            low = 0 if key in ("lookahead_steps", "seed") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise PipelineError(f"{key} must be an integer >= {low}, got {value!r}")
        if self.dtype not in DTYPES:
            raise PipelineError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float16" and any(s.trainable for s in self.sections):
            raise PipelineError("dtype=float16 cannot train: gradients are summed over micro-batches and replicas "
                                "before the division by the loss denominator, in float16 without loss scaling, "
                                "and overflow on real batches; use dtype=float32 with mixed_precision='bf16'")
        if self.schedule not in SCHEDULES:
            raise PipelineError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.grad_clip is not None and (not isinstance(self.grad_clip, (int, float))
                                           or isinstance(self.grad_clip, bool) or not self.grad_clip > 0):
            raise PipelineError(f"grad_clip must be a number > 0 or None, got {self.grad_clip!r}")
        if self.mixed_precision is not None:
            if self.mixed_precision not in MIXED_PRECISION:
                raise PipelineError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)} or None, "
                                    f"got {self.mixed_precision!r}")
            if self.dtype != "float32":
                raise PipelineError(f"mixed_precision={self.mixed_precision!r} keeps float32 master weights: "
                                    f"set dtype to float32 (got {self.dtype!r}) or mixed_precision to None")
        self.data.validate()
        if not self.sections:
            raise PipelineError("sections must name at least one section")
        for s in self.sections:
            s.validate()
        SectionGraph(self)  # raises on duplicates, unknown names, cycles, dp mismatches

    def override(self, **overrides: Any) -> Pipeline:
        """Return a copy with `--set`-style overrides applied.

        Keys are top-level fields (`global_batch=8`) or `sections.NAME.FIELD` paths, possibly
        deeper into dict fields (`sections.student.optimizer.lr=1e-3`). Python callers may also
        use `sections__NAME__FIELD` since dots are not valid keyword names. A name that is no
        field of its record (`sections.student.optimiser`, `data.pth`) is refused naming its path,
        the closest field and all of them.
        """
        data = self.to_dict()
        for raw_key, value in overrides.items():
            key = raw_key.replace("__", ".")
            _set_path(data, key.split("."), value, key)
        return Pipeline.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Pipeline:
        try:
            fields = dict(data)
            check_fields(Pipeline, fields)
            check_fields(ArrowData, fields["data"], "data")
            fields["data"] = ArrowData(**fields["data"])
            sections = []
            for i, s in enumerate(fields["sections"]):
                at = f"sections.{s['name']}" if isinstance(s, dict) and is_name(s.get("name")) else f"sections[{i}]"
                check_fields(Section, s, at)
                check_fields(Cost, s.get("cost", {}), f"{at}.cost")
                sections.append(Section(**{**s, "cost": Cost(**s.get("cost", {})),
                                           "columns": _tuple(s.get("columns"))}))
            fields["sections"] = tuple(sections)
            edges = []
            for i, e in enumerate(fields.get("edges", ())):
                check_fields(Edge, e, f"edges[{i}]")
                edges.append(Edge(**{**e, "tensors": _tuple(e["tensors"])}))
            fields["edges"] = tuple(edges)
            return Pipeline(**fields)
        except TypeError as exc:
            raise PipelineError(f"invalid pipeline field: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


_NESTED = {(Pipeline, "data"): ArrowData, (Section, "cost"): Cost}  # record fields that are records


def _set_path(data: dict[str, Any], parts: list[str], value: Any, key: str) -> None:
    """Set `value` at the dotted path `parts` of the pipeline's plain form, refusing a name that is
    not a field of the record it falls in (a pipeline, section, data or cost field; the keys of a
    mapping field such as config or optimizer are free)."""
    prefix = f"--set {key}: "
    cls: type | None = Pipeline
    target, at, rest = data, "", parts
    if parts[0] == "sections" and len(parts) >= 3:
        for sec in data["sections"]:
            if sec["name"] == parts[1]:
                break
        else:
            names = [s["name"] for s in data["sections"]]
            close = difflib.get_close_matches(parts[1], names, n=1)  # found in QA: fields had it, sections not
            mean = f"; did you mean {close[0]!r}?" if close else ""
            raise PipelineError(f"{prefix}no section named {parts[1]!r}{mean} (sections: {', '.join(names)})")
        cls, target, at, rest = Section, sec, f"sections.{parts[1]}", parts[2:]
    for i, part in enumerate(rest):
        if cls is not None and part not in {f.name for f in dataclasses.fields(cls)}:
            raise unknown_field(cls, part, at, prefix)
        if i == len(rest) - 1:
            target[part] = value
            return
        if not isinstance(target.get(part), dict):
            if part in target:
                raise PipelineError(f"{prefix}{'.'.join(rest[:i + 1])} is not a mapping")
            target[part] = {}
        cls = _NESTED.get((cls, part)) if cls is not None else None
        target, at = target[part], f"{at}.{part}" if at else part


def _tuple(value: Any) -> Any:
    """A JSON list as the tuple a field holds; anything else as it is, for validate to judge (a
    string made a tuple would be read as its letters)."""
    return tuple(value) if isinstance(value, list) else value


def _check_plain(value: Any, where: str) -> None:
    """Configuration is sent to workers, so it must be plain JSON-like data."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise PipelineError(f"{where} keys must be strings, got {k!r}")
            _check_plain(v, f"{where}.{k}")
        return
    raise PipelineError(f"{where} must hold plain data (numbers, strings, lists, dicts), got {type(value).__name__}")
