"""The Stage contract (DESIGN 5.2): what user code for one section implements.

A stage is built in its worker as `Class(config, ctx)`, owns `torch.nn.Module`s, and maps a
`MicroBatch` to a dict of outputs. It knows nothing of processes, transfers, gradient reduction,
optimizers or checkpoints: the runtime does all of that around `forward`.

What the runtime guarantees around a stage:
- Parameters: the constructor runs with torch's global RNG seeded by `ctx.seed` — the same for
  every replica of a section (so data-parallel replicas start identical) and different between
  sections (a hash of the pipeline seed and the section name) — and with torch's default dtype
  set to `ctx.dtype`; afterwards every module is moved to `ctx.device` and `ctx.dtype`. A stage
  that wants weights independent of the section (e.g. a teacher head rebuilt elsewhere) seeds
  its own generator.
- Random draws after the constructor (dropout, in forward) come from each replica's own seed
  (torch's, Python's and NumPy's RNGs, reseeded once the stage is built; the tp ranks of a
  replica share it), so replicas draw independently. Anything that must be identical across
  replicas (parameters, buffers, a lazily initialised module) must be created in the
  constructor: drawn later, it would differ between replicas.
- Samples: each step's global batch comes from a seeded per-epoch shuffle of the dataset (or file
  order with `data.shuffle=false`), cut into batches with the remainder dropped; the samples of
  every step, in execution order, are in the run directory's `plans.jsonl`.
- Columns: `tokens` entries are 1-D int64 tensors; other numeric list columns (e.g. `audio`) are
  1-D tensors of the column's dtype; binary columns are `bytes`, strings `str`, nested lists and
  scalars plain Python values, and a null is `None`.

What the runtime asks of `forward`'s outputs is `output_problem`: the executor checks every
micro-batch's outputs with it right after the forward, and `maestro stage` does the same.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from numbers import Real
from operator import methodcaller
from typing import Any

import torch

from maestro_flow.samples import SampleMeta


class PayloadNote(str):
    """What a payload check (Stage.payload_checks) finds that the run tolerates, e.g. an image
    that decode.skip_corrupt makes the run skip: `maestro validate --payloads` lists it without
    failing."""


@dataclass(frozen=True, slots=True)
class PayloadCheck:
    """A payload check (Stage.payload_checks) that needs more of the sample's row than its
    payload: called as `check(payload, meta, row)`, `row` mapping each of `columns` to the
    sample's value there (the audio encoder's needs "sample_rate")."""

    check: Callable[[Any, SampleMeta, dict[str, Any]], str | None]
    columns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Sender:
    """The section that sends a stage one of its inputs (Stage.check_senders)."""

    section: str
    stage: str  # "module:Class", as in its Section
    config: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageContext:
    """Where and how a stage instance runs: `module.to(ctx.device, ctx.dtype)` just works.

    `placeholder_ids` is the pipeline's `data.placeholder_ids`: modality -> the token id that marks
    where that modality's embeddings go in `tokens` (e.g. {"image": 259}); an LLM stage expands
    each placeholder into the rows its encoder sent. `seed` is the seed the constructor runs
    under (see the module docstring). `modality_columns` is the pipeline's
    `data.modality_columns`: which column carries a modality when it is not the column of that
    name (e.g. {"image": "pixel_values"} for precomputed pixel arrays).
    """

    section: str
    replica: int = 0
    num_replicas: int = 1
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    seed: int = 0
    trainable: bool = True
    placeholder_ids: dict[str, int] = field(default_factory=dict)
    modality_columns: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Accept "cuda:0" / "float64" from callers, hold torch objects.
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", getattr(torch, self.dtype))


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """One micro-batch as a stage sees it.

    `columns` maps each dataset column to one entry per sample (`tokens` entries are 1-D int64
    tensors); `inputs` maps each incoming tensor name to one tensor per sample, `None` where the
    producer did not activate on that sample.
    """

    step: int
    index: int
    sample_ids: list[int]
    modalities: list[frozenset[str]]
    columns: dict[str, list[Any]]
    inputs: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_ids)


class Stage:
    """Base class of user stages.

    Subclasses build their modules in `__init__` and implement `forward`. `outputs(config)` is
    optional: when a stage declares the names `forward` returns, `maestro validate` checks the
    edges and the loss against them before any worker starts. Declared or not, every forward's
    outputs are checked as they come back (`output_problem`: a tensor an edge carries, or "loss"
    for a terminal trainable section, missing or malformed is an error naming the section, the
    class and the name). `inputs(config)`, also optional, declares the names `forward` reads
    from `batch.inputs`.
    """

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        self.config = dict(config)
        self.ctx = ctx

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...] | None:
        return None

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...] | None:
        """The input tensors `forward` may read from `batch.inputs`, or None (the default): not
        declared. When declared, `maestro validate` refuses an edge into the section that carries
        a tensor the stage does not read, naming the edge and what the stage reads (the same
        tensor spelt one way by the edge and the producer and another by the consumer would
        otherwise fail in the first forward, or be sent and never read). A subclass that
        overrides `forward` without declaring `inputs` again is not checked: its base's
        declaration need not hold for it."""
        return None

    @classmethod
    def token_limits(cls, config: dict[str, Any]) -> dict[str, int] | None:
        """What this stage accepts in a sample's `tokens`: {"vocab_size": V} (every id below V)
        and/or {"max_tokens": L} (at most L per sample), or, for a stage that puts each
        modality's encoder rows in place of its placeholder token (data.placeholder_ids, as
        stages.multimodal does), {"max_positions": L}: at most L positions once expanded (one per
        image patch, one per audio frame: num_patches, num_frames), placeholder ids exempt from
        vocab_size, and exactly one placeholder in a sample that declares its modality; an
        encoder may give {"max_frames": F} (at most F audio frames: num_frames) or
        {"max_patches": P} (num_patches). `maestro validate` and `maestro run`
        check every sample the section reads against them before any worker starts, naming the
        first sample id that breaks one. None (the default): no limits beyond the loader's (ids
        in int32, no empty token list)."""
        return None

    @classmethod
    def placeholder_inputs(cls, config: dict[str, Any]) -> dict[str, str]:
        """For a stage that puts encoder rows in place of placeholder tokens (token_limits'
        "max_positions"): modality -> the input tensor whose rows replace that modality's
        placeholder. `maestro validate` refuses an edge that carries such a tensor when
        data.placeholder_ids gives no id for its modality (the rows would be dropped). Empty (the
        default): not declared, not checked."""
        return {}

    @classmethod
    def output_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        """The last dimension of tensors this stage sends, with the config key that sets it:
        name -> (width, key), e.g. {"image_embeds": (64, "project_to")}. Every command that checks
        a pipeline compares each edge's tensors with the widths its consumer declares
        (`input_widths`) before any worker starts, naming both keys. Empty (the default): not
        declared, not checked. Like `check_config`, not taken from a base class whose `__init__`
        or `forward` the class overrides."""
        return {}

    @classmethod
    def input_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        """The last dimension this stage reads each received tensor with, and the config key that
        sets it (see `output_widths`). Empty (the default): not declared, not checked."""
        return {}

    @classmethod
    def payload_checks(cls, config: dict[str, Any]) -> dict[str, Callable[[Any, SampleMeta], str | None]
                                                             | PayloadCheck]:
        """Checks of the payloads this stage will read, for `maestro validate --payloads`:
        modality -> a function of one sample's payload (as `SampleSource.read` gives it) and its
        metadata, returning what is wrong with it for this configuration (one line), a
        PayloadNote for what the run tolerates, or None; a PayloadCheck where the check needs
        other columns of the row too. They read whole payloads, so only that
        option runs them, over every sample carrying the modality whose section reads the
        modality's column (its `columns` include it, or are not given). Empty (the default):
        nothing to check."""
        return {}

    @classmethod
    def tp_plan(cls, config: dict[str, Any]) -> dict[str, str] | None:
        """Tensor parallelism (`Section.tp > 1`): module name as in `state_dict` (the stage
        attribute first, `*` for one name part such as a layer index) -> "colwise", "rowwise",
        "colwise_rep" or "replicate" (Hugging Face's tp-plan vocabulary). The modules between the
        sharded layers must work on the local shard (e.g. attention on its share of the heads).
        None (the default): no plan; such a stage cannot take tp > 1 unless it overrides
        `parallelize`."""
        return None

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """Raise ValueError, naming the config key, for a config this stage cannot be built from
        (an unknown key, a value out of range, d_model not divisible by n_heads). Every command
        that checks a pipeline (`validate`, `run`, `plan`, `tune`, `profile`) calls it for every
        section before any worker starts; anything but a ValueError is reported as a fault of the
        check itself. It should be cheap and build nothing (`validate` also builds each stage on
        the meta device). A subclass (or a mixin) that overrides `__init__` and not this is not
        checked: its own `__init__` may take keys its base's check does not know. The default
        checks nothing."""

    @classmethod
    def check_senders(cls, config: dict[str, Any], senders: dict[str, Sender]) -> None:
        """Raise ValueError, naming the config key, for a config that does not fit the sections
        that send this stage its inputs: `senders` maps each input tensor an edge carries to its
        Sender (e.g. a KD student's copy of its teacher's config against the section that sends
        it "hidden"). Called where `check_config` is, after it, and held to the same subclass
        rule. The default checks nothing."""

    @classmethod
    def check_tp(cls, config: dict[str, Any], tp: int) -> None:
        """Raise ValueError, naming the config key, when `tp` cannot shard this configuration
        (e.g. "n_heads (4) is not divisible by tp=3"). `maestro validate` also checks that the
        plan's sharded dimensions divide by tp."""

    def parallelize(self, mesh: Any) -> None:
        """Full control over the section's layout: shard this stage's modules over `mesh`, a
        torch DeviceMesh with dimensions ("dp", "tp") (or ("dp",) for tp=1) over the section's
        ranks. Override it instead of `tp_plan` for layouts a plan cannot express; modules it
        wraps with `fully_shard` are driven by the runtime as with `fsdp=True` (per step, or per
        micro-batch in a lockstep section: parallel/fsdp.py).
        Not called unless overridden."""
        raise NotImplementedError

    def forward(self, batch: MicroBatch) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        """Optional: the part of a micro-batch's work that needs only its columns (no parameters,
        no inputs from other sections, no randomness), e.g. decoding images; the runtime's
        `forward` then gets the returned batch. In section mode the runtime calls it ahead, for a
        section that reads only the data, while the worker would otherwise wait (for gradients,
        for the step's loss), so that the work leaves the critical path; otherwise just before
        `forward`. `forward` must give the same result on a batch as read (replay, profiling and
        the monolithic baseline call it directly). The default returns the batch unchanged."""
        return batch

    def optimizer_groups(self, spec: dict[str, Any]) -> list[tuple[dict[str, Any], list[torch.nn.Parameter]]] | None:
        """Optional: several optimizers for this stage's trainable parameters, each
        `(optimizer spec, parameters)` (a spec as `Section.optimizer`, with its own lr schedule);
        they step together after the section's one gradient reduction. None (the default): one
        optimizer, the section's `spec`, over every trainable parameter."""
        return None

    def stats(self) -> dict[str, float]:
        """Counters of this stage's own (e.g. corrupt images skipped), reported in the metrics
        under sections.NAME.stage, summed over replicas. Cumulative since the worker started:
        checkpoints record the sums, and a restart or a resume adds them back (ledger.carry_counters)."""
        return {}

    def modules(self) -> dict[str, torch.nn.Module]:
        """The stage's modules by attribute name (in definition order)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.nn.Module)}

    def parameters(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        params = []
        for module in self.modules().values():
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self._named(methodcaller("named_parameters"))

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return self._named(methodcaller("named_buffers"))

    def _named(self, each: Callable[[torch.nn.Module], Iterator[tuple[str, Any]]]) -> list[tuple[str, Any]]:
        """`each(module)`'s tensors of every module, named `attr.name`, each tensor once (the first
        name it has: a module shared by two attributes, or tied weights)."""
        out, seen = [], set()
        for attr, module in self.modules().items():
            for name, t in each(module):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append((f"{attr}.{name}", t))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{attr}.{k}": v for attr, m in self.modules().items() for k, v in m.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """As torch's, by module attribute. `strict=False` loads what `state` holds: an export or a
        --save-dir file leaves frozen parameters out (found in QA: a KD student's export did not
        load back into the stage strictly)."""
        for attr, module in self.modules().items():
            prefix = attr + "."
            module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=strict)

    def train(self, mode: bool = True) -> None:
        for module in self.modules().values():
            module.train(mode)


PER_SAMPLE = ("a tensor whose first dimension indexes the micro-batch's samples, or a list of one tensor "
              "(or None) per sample")


def output_problem(out: Any, *, section: str, stage: str, num_samples: int, carried: Mapping[str, str],
                   loss: bool) -> str | None:
    """What breaks the output contract in `out`, what `stage` (its "module:Class") returned from
    `forward` on a micro-batch of `num_samples` samples of `section`, as the error to show; None
    when nothing does. `carried`: output name -> the edge that carries it, each such output
    checked to be PER_SAMPLE; `loss`: the section's "loss" is read (a terminal section), so it must
    be a scalar (0-dim) tensor and "loss_denominator", when returned, a number or a one-element
    tensor. Other outputs are not looked at. Pure and cheap (a few isinstance checks an output):
    it runs after every forward."""
    who = f"section {section!r}: {stage}.forward returned"
    if not isinstance(out, dict):
        return f"{who} {type(out).__name__}, not a dict of outputs"
    for name, edge in carried.items():
        if name not in out:
            return f"{who} no {name!r} (returned: {_names(out)}); edge {edge} carries it"
        value = out[name]
        if isinstance(value, (list, tuple)) or isinstance(value, torch.Tensor) and value.dim() > 0:
            if len(value) != num_samples:
                return (f"{who} {name!r} with {len(value)} entries for a micro-batch of {num_samples} samples; "
                        f"edge {edge} carries it, so it must be {PER_SAMPLE}")
            if not isinstance(value, torch.Tensor):
                bad = next((i for i, t in enumerate(value) if t is not None and not isinstance(t, torch.Tensor)), None)
                if bad is not None:
                    return (f"{who} {name!r} as a {type(value).__name__} whose entry {bad} is {_described(value[bad])}; "
                            f"edge {edge} carries it, so it must be {PER_SAMPLE}")
        else:
            return f"{who} {name!r} as {_described(value)}; edge {edge} carries it, so it must be {PER_SAMPLE}"
    if loss:
        if "loss" not in out:
            return (f"{who} no 'loss' (returned: {_names(out)}); a terminal trainable section must return the sum "
                    "of its losses as 'loss'")
        value = out["loss"]
        # A scalar, not any one-element tensor (found in QA: a loss per sample, [B], passed at
        # micro-batch 1 and was refused once a plan made micro-batches of 2).
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            return (f"{who} 'loss' as {_described(value)}; it must be a scalar tensor (0 dimensions: .sum()), the sum "
                    "of the micro-batch's losses (the runtime backwards it)")
        denom = out.get("loss_denominator", 0)
        if not (isinstance(denom, Real) or isinstance(denom, torch.Tensor) and denom.numel() == 1):
            return (f"{who} 'loss_denominator' as {_described(denom)}; it must be a number or a scalar tensor "
                    "(what 'loss' sums over; leave it out for the number of samples)")
    return None


def detached_loss(section: str, stage: str) -> str:
    """The error for a trainable section's "loss" that has no gradient (section mode and
    `maestro stage` alike: found in QA, `stage` passed one that a run refuses)."""
    return (f"section {section!r}: {stage}.forward returned 'loss' with no gradient (detached, computed under "
            "torch.no_grad(), or an integer tensor): it must be computed from the section's outputs, so that it can "
            "train it")


UNREAD_LOSS = ("which nothing reads: only a terminal trainable section's loss trains (to add this one, send it per "
               "sample on an edge to that section and add it to its loss there)")


def warn_unread_loss(stage: Any, config: Mapping[str, Any], section: str) -> None:
    """Warn (stderr) that a forward of trainable `section`, which is not terminal, returned a
    "loss" that nothing reads; the executor (and the monolithic baseline's fused model) call it
    once, on replica 0 (found in QA: the loss was dropped in silence, while a plain loop over the
    whole model would add it). Nothing when the stage declares "loss" in `outputs` (`maestro
    validate` and `run` warn of it before anything starts) or its `outputs` fails (validate said
    so)."""
    try:
        declared = type(stage).outputs(dict(config))
    except Exception:
        return
    if declared is None or "loss" not in declared:
        print(f"maestro: warning: section {section!r}: {type(stage).__module__}:{type(stage).__qualname__}.forward "
              f"returned a 'loss', {UNREAD_LOSS}", file=sys.stderr, flush=True)


def _names(out: dict) -> str:
    return ", ".join(map(str, out)) or "nothing"


def _described(value: Any) -> str:
    """`value` in a few words for an error: its type and its shape, length or value."""
    kind = "a tensor" if isinstance(value, torch.Tensor) else type(value).__name__
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple):  # torch.Size is one; so is a numpy array's
        return f"{kind} of shape {list(shape)}"
    if isinstance(value, (list, tuple, dict)):
        return f"{kind} of {len(value)} entries"
    text = repr(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"
