"""Pre-flight checks that need imports or files: run in the coordinator before any worker starts.

`check_pipeline` imports every stage class, checks declared outputs against the edges and the
losses, and opens the dataset (which checks the file and its required columns, and the columns
a stage's payload checks read with the payload, runtime/payloads.declared_checks). Every failure is
a `PipelineError` naming the section, edge or field to change.

`pipeline_warnings` (pure) names what is legal but almost surely not meant: nothing trains, a
frozen section whose outputs no edge reads, more replicas than the global batch has samples;
`data_warnings`, what the dataset makes of it (a section activating on a modality no sample has).
They are warnings, not refusals (a forward-only run is a fair benchmark): `maestro validate` and
`maestro run` print them on stderr.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from maestro_flow.config import Pipeline, Section
from maestro_flow.errors import PipelineError, brief
from maestro_flow.graph import SectionGraph
from maestro_flow.optim.build import pipeline_schedule_warnings
from maestro_flow.overrides import dotted
from maestro_flow.planner import make_planner
from maestro_flow.runtime.build import build_stage, open_source, resolve
from maestro_flow.samples import SampleMeta
from maestro_flow.stage import UNREAD_LOSS
from maestro_flow.wording import count as count_of


@dataclass(frozen=True, kw_only=True, slots=True)
class Checked:
    """What the checks produced: the graph, the opened data source and every row's metadata."""

    graph: SectionGraph
    source: Any
    metadata: list[SampleMeta]
    warnings: tuple[str, ...] = ()  # pipeline_warnings
    data_warnings: tuple[str, ...] = ()  # data_warnings (maestro run prints these; the CLI, the others)


def pipeline_warnings(pipeline: Pipeline) -> list[str]:
    """What a valid pipeline does that is almost surely not meant, each naming the field to change
    (empty for an invalid one: its error comes from the checks)."""
    try:
        pipeline.validate()
    except PipelineError:
        return []
    graph = SectionGraph(pipeline)
    out = []
    if not any(s.trainable for s in pipeline.sections):
        out.append("no section is trainable (every section has trainable=False): the run computes forwards only, "
                   "changes no weights and reports no loss; to train one, set sections.NAME.trainable=true")
    else:
        for s in pipeline.sections:
            if not s.trainable and not graph.outputs(s.name):
                fed = [n for n in graph.order if pipeline.section(n).trainable and not graph.inputs(n)]
                hint = f" (an edge missing, e.g. Edge(src={s.name!r}, dst={fed[0]!r}, ...)?)" if fed else ""
                out.append(f"sections.{s.name} is frozen (trainable=False) and no edge reads its outputs: it does work "
                           f"for nobody{hint}")
    out += pipeline_schedule_warnings(pipeline)
    batch = pipeline.global_batch
    for s in pipeline.sections:
        # A lockstep FSDP section is left alone: fed by others, it is refused for this (check_pipeline);
        # fed by the data, its spare replicas stand in each round and hold their shards, which may
        # be what makes it fit.
        if s.fsdp and s.dp == 1:  # found in QA: accepted in silence
            out.append(f"sections.{s.name}.fsdp=true at dp=1 shards over one replica, so it saves no memory; raise "
                       f"sections.{s.name}.dp (FSDP shards over the dp replicas) or set sections.{s.name}.fsdp=false")
        if s.dp > batch and not graph.lockstep(s.name):
            out.append(f"sections.{s.name}.dp={s.dp} is more than global_batch={batch}: a step's {batch} samples "
                       f"leave {s.dp - batch} of its {s.dp} replicas without work; lower sections.{s.name}.dp or "
                       "raise global_batch")
    return out


def _instance_method(attr: Any) -> bool:
    """A plain function whose first parameter is `self` or `cls`: called on the class, it lacks one
    (a plain `def tp_plan(config)` works, found in review)."""
    if isinstance(attr, (classmethod, staticmethod)) or not inspect.isfunction(attr):
        return False
    first = next(iter(inspect.signature(attr).parameters), None)
    return first in ("self", "cls")


COUNTS = ("position", "layer", "vocab", "seed", "len", "step", "_id")  # config fields sizing no sharded dimension


def check_tensor_parallel(pipeline: Pipeline, section: Any, cls: Any) -> None:
    """A section with tp > 1: the stage has a plan (or its own parallelize), the configuration
    can be split tp ways (the stage's check_tp), and every sharded dimension divides by tp
    (the stage built on the meta device: no memory, no weights)."""
    from maestro_flow.parallel.tp import check_plan
    from maestro_flow.runtime.build import build_stage
    from maestro_flow.stage import Stage

    where = f"sections.{section.name}"
    if cls.parallelize is not Stage.parallelize:
        return  # the stage takes full control of its layout
    for name in ("tp_plan", "check_tp"):  # found in QA: a forgotten @classmethod said "missing 'config'"
        if _instance_method(inspect.getattr_static(cls, name, None)):
            raise PipelineError(f"{where}.stage: {section.stage}.{name} must be a @classmethod ({name}(cls, config"
                                f"{', tp' if name == 'check_tp' else ''})) or a @staticmethod: it is read before "
                                "any stage is built")
    try:
        plan = cls.tp_plan(dict(section.config))
    except Exception as exc:
        check_builds(pipeline, section)  # found in QA: a config the stage cannot build from was blamed on the plan
        raise PipelineError(f"{where}.stage: {section.stage}.tp_plan(config) failed: {type(exc).__name__}: {exc}") from exc
    try:
        cls.check_tp(dict(section.config), section.tp)
    except ValueError as exc:
        raise PipelineError(f"{where}.tp={section.tp}: {where}.config.{exc}") from None
    if not plan:
        raise PipelineError(f"{where}.tp={section.tp}: {section.stage} declares no tp_plan(config) and no "
                            f"parallelize(mesh), so it cannot be tensor-parallel; set {where}.tp=1")
    try:
        stage = build_stage(pipeline, section, 0, "cpu", meta=True)
    except PipelineError:  # already says what to change (review: a stray parameter was blamed on the plan)
        raise
    except Exception as exc:
        raise PipelineError(f"{where}.stage: building {section.stage} to check its tp_plan failed: "
                            f"{type(exc).__name__}: {exc}") from exc
    fields: dict[int, list[str]] = {}  # found in QA: a dimension that did not divide named modules, not the field
    for key, value in dotted(dict(section.config), f"{where}.config").items():
        if isinstance(value, int) and not isinstance(value, bool) and not any(c in key.rsplit(".")[-1] for c in COUNTS):
            fields.setdefault(value, []).append(key)
    problems = check_plan(stage, plan, section.tp, fields)
    if problems:
        raise PipelineError(f"{where}.tp={section.tp}: " + "; ".join(problems))


def check_builds(pipeline: Pipeline, section: Any) -> None:
    """The stage builds from its config (on the meta device: shapes only, no memory, a
    checkpoint's header only), so a config a worker would refuse is refused before any starts."""
    try:
        build_stage(pipeline, section, 0, "cpu", meta=True)
    except PipelineError:
        raise
    except (NotImplementedError, RuntimeError):
        return  # what the meta device cannot do (a stage moving its modules with .to(ctx.device)): unchecked
    except Exception as exc:
        raise PipelineError(f"sections.{section.name}.config: building {section.stage} from it failed: "
                            f"{brief(exc)}") from exc


def check_token_limits(pipeline: Pipeline, source: Any, metadata: list[SampleMeta],
                       only: Collection[str] | None = None) -> None:
    """Every sample a section reads fits its stage's token_limits (vocabulary, length), or the
    run is refused naming the section, the limit and the first sample id that breaks it. With
    `source` None (metadata alone, --trace-in), what needs the tokens is left out: the vocabulary,
    and the placeholders, each declared modality counted as holding its one. `only`: the sections
    to check (default every one)."""
    rows_over: dict[tuple, list[int]] = {}  # (vocabulary size, ids exempt) -> rows with an id at or above it
    for s in pipeline.sections:
        if only is not None and s.name not in only:
            continue
        cls = resolve(s.stage, f"sections.{s.name}.stage")
        try:
            limits = cls.token_limits(dict(s.config)) or {}
        except Exception as exc:
            raise PipelineError(f"sections.{s.name}.stage: {s.stage}.token_limits(config) failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        reads = [m for m in metadata if s.activates_on is None or s.activates_on in m.modalities]
        for key, count in (("max_frames", "num_frames"), ("max_patches", "num_patches")):
            if key not in limits:
                continue
            over = [m for m in reads if getattr(m, count) > limits[key]]
            if over:
                raise PipelineError(
                    f"sections.{s.name}: {_sample(over[0])} has {getattr(over[0], count)} "
                    f"{count[4:]}, more than {s.stage} takes ({key} {limits[key]}, from its config); samples "
                    f"like it: {len(over)}. Cut the samples or raise the limit ({key}, or the setting it comes from) in "
                    f"sections.{s.name}.config")
        if s.columns is not None and "tokens" not in s.columns:
            continue
        max_tokens = limits.get("max_tokens")
        if max_tokens is not None:
            over = [m for m in reads if m.num_tokens > max_tokens]
            if over:
                raise PipelineError(
                    f"sections.{s.name}: {_sample(over[0])} has {over[0].num_tokens} tokens, "
                    f"more than {s.stage} takes (max_tokens {max_tokens}, from its config); samples that "
                    f"long: {len(over)}. Cut the samples or raise the model's maximum length")
        placeholders = pipeline.data.placeholder_ids if "max_positions" in limits else {}
        if "max_positions" in limits:
            _check_placeholder_edges(pipeline, s, cls)
        if placeholders:
            _check_placeholders(s, source, reads, placeholders, int(limits["max_positions"]))
        vocab = limits.get("vocab_size")
        if vocab is not None and hasattr(source, "rows_with_tokens_outside"):
            allowed = tuple(sorted(placeholders.values()))  # replaced by encoder rows, never looked up
            if (vocab, allowed) not in rows_over:
                rows_over[(vocab, allowed)] = source.rows_with_tokens_outside(vocab, allowed)
            rows = set(rows_over[(vocab, allowed)])
            bad = [m for m in reads if m.row in rows]
            if bad:
                raise PipelineError(
                    f"sections.{s.name}: {_sample(bad[0])} has a token id{_over(source, bad[0], vocab, allowed)} at "
                    f"or above {s.stage}'s vocab_size {vocab}; {count_of(len(bad), 'sample')} in "
                    "all. Fix the tokenization or the model's vocab_size")


def _over(source: Any, m: SampleMeta, vocab: int, allowed: tuple[int, ...]) -> str:
    """The sample's largest token id past the vocabulary, as ' (ID)' (found in QA: not named), or
    '' where the source cannot tell."""
    try:
        tokens = source.read([m.row], ["tokens"])["tokens"][0]
        ids = [int(t) for t in tokens if int(t) >= vocab and int(t) not in allowed]
        return f" ({max(ids)})" if ids else ""
    except Exception:  # noqa: BLE001 (the id is a courtesy: the message stands without it)
        return ""


def _sample(m: SampleMeta) -> str:
    """A sample as the messages name it: its id, and its row where it has one (a --trace-in
    sample has none)."""
    return f"sample id {m.id}" + (f" (row {m.row})" if m.row >= 0 else "")


def _check_placeholder_edges(pipeline: Pipeline, s: Section, cls: Any) -> None:
    """Tensors whose rows a stage puts in place of a modality's placeholder token
    (Stage.placeholder_inputs) reach it by an edge: data.placeholder_ids must name that modality's
    id (found in review: without it the rows were received and dropped, and the encoder trained on
    nothing)."""
    try:
        wanted = {t: m for m, t in (cls.placeholder_inputs(dict(s.config)) or {}).items()}
    except Exception as exc:
        raise PipelineError(f"sections.{s.name}.stage: {s.stage}.placeholder_inputs(config) failed: "
                            f"{brief(exc)}") from exc
    for e in pipeline.edges:
        for t in e.tensors if e.dst == s.name else ():
            m = wanted.get(t)
            if m is not None and m not in pipeline.data.placeholder_ids:
                raise PipelineError(
                    f"data.placeholder_ids: edge {e.src} -> {s.name} carries {t!r}, whose rows {s.stage} puts in "
                    f"place of the {m} placeholder token, but data.placeholder_ids gives no {m!r} id: the rows "
                    f"would be dropped. Add data.placeholder_ids.{m}")


def _check_placeholders(s: Any, source: Any, reads: list[SampleMeta], placeholders: dict[str, int],
                        max_positions: int) -> None:
    """A stage that puts each modality's encoder rows in place of its placeholder token
    (token_limits' "max_positions"): a sample that declares the modality holds exactly one
    placeholder for it, one that does not declare it holds none (its encoder would never run, and
    the stage would drop the placeholder unnoticed), none holds two, and its positions once
    expanded (one per image patch, one per audio frame, as the built-in encoders give) fit."""
    if not reads:
        return
    import numpy as np  # a dataset of millions of rows: one pass per array, not per sample

    removed = np.zeros(len(reads), dtype=np.int64)
    rows = np.fromiter((m.row for m in reads), dtype=np.int64, count=len(reads))
    for modality, token in sorted(placeholders.items()):
        declared = np.fromiter((modality in m.modalities for m in reads), dtype=bool, count=len(reads))
        if not hasattr(source, "token_counts"):  # metadata without tokens (--trace-in): one where declared
            removed += declared
            continue
        counts = source.token_counts(token)[rows]
        kinds = (counts > 1, declared & (counts == 0), ~declared & (counts == 1))  # each its own message
        wrong = np.nonzero(kinds[0] | kinds[1] | kinds[2])[0]
        if len(wrong):
            m, n = reads[int(wrong[0])], int(counts[wrong[0]])
            like = int(next(k for k in kinds if k[wrong[0]]).sum())  # rows with the same problem
            if n > 1:
                why = f"holds {n} {modality} placeholders (id {token}); {s.stage} takes at most one per sample"
            elif n == 0:
                why = (f"declares {modality!r} but its tokens hold no {modality} placeholder (id {token}, "
                       f"data.placeholder_ids): {s.stage} would have nowhere to put it")
            else:
                why = (f"holds the {modality} placeholder (id {token}, data.placeholder_ids) but its modalities "
                       f"{sorted(m.modalities)} do not declare {modality!r}: no {modality} encoder would run for it, "
                       f"and {s.stage} would drop the placeholder. Tag the row {modality!r} (with its data) or "
                       "remove the placeholder")
            raise PipelineError(f"sections.{s.name}: {_sample(m)} {why}; samples like it: {like}")
        removed += counts
    positions = np.fromiter((m.num_tokens + ("image" in m.modalities) * m.num_patches
                             + ("audio" in m.modalities) * m.num_frames for m in reads),
                            dtype=np.int64, count=len(reads)) - removed
    over = np.nonzero(positions > max_positions)[0]
    if len(over):
        m = reads[int(over[0])]
        raise PipelineError(
            f"sections.{s.name}: {_sample(m)} has {int(positions[over[0]])} positions once its "
            f"placeholders are expanded ({m.num_tokens} tokens, {m.num_patches} image patches, {m.num_frames} "
            f"audio frames), more than {s.stage} takes (max_seq_len {max_positions}, from its config). Cut "
            f"the samples, use smaller images, or raise max_seq_len")


def _declared(cls: type, method: str, section: Section, where: str) -> tuple[str, ...] | None:
    """What a stage class declares with `outputs(config)` or `inputs(config)` (None: nothing).
    Inputs declared by a base class whose `forward` the class overrides are not its own (a
    subclass of a bundled stage that reads one more input): taken as undeclared."""
    if method == "inputs" and _owner(cls, "forward") is not _owner(cls, "inputs") and \
            issubclass(_owner(cls, "forward"), _owner(cls, "inputs")):
        return None
    try:
        names = getattr(cls, method)(dict(section.config))
    except Exception as exc:
        raise PipelineError(f"{where}: {section.stage}.{method}(config) failed: {type(exc).__name__}: {exc}") from exc
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise PipelineError(f"{where}: {section.stage}.{method}(config) returned {names!r}, not a tuple of names")
    return tuple(names)


def _check_config(cls: type, section: Section, method: str = "check_config", *args: Any) -> None:
    """The stage's own check of its config (Stage.check_config, or check_senders with `args`),
    where it is defined at or below the class that defines `__init__`: a subclass (or a mixin)
    whose `__init__` overrides its base's and not the check may take other keys (found in QA:
    `maestro run` started workers that failed on a config `validate` refused)."""
    if not issubclass(_owner(cls, method), _owner(cls, "__init__")):  # (a mixin's __init__ too: review)
        return
    try:
        getattr(cls, method)(dict(section.config), *args)
    except ValueError as exc:  # the contract's; anything else is a fault of the check (found in review)
        raise PipelineError(f"sections.{section.name}.config: {exc}") from None
    except Exception as exc:
        raise PipelineError(f"sections.{section.name}.stage: {section.stage}.{method}(config) failed: "
                            f"{type(exc).__name__}: {exc}") from exc


def check_between(pipeline: Pipeline, only: set[str]) -> None:
    """What `run` checks between sections, for the sections `only` (their configs, and the
    widths and senders of the edges between them): `maestro stage`, which runs a section and
    those upstream of it (found in QA: it ran them into a shape error, or built another teacher
    head)."""
    graph = SectionGraph(pipeline)
    for s in pipeline.sections:
        if s.name in only:
            _check_config(resolve(s.stage, f"sections.{s.name}.stage"), s)
    check_widths(pipeline, graph, only)
    check_senders(pipeline, graph, only)


def check_senders(pipeline: Pipeline, graph: SectionGraph, only: Collection[str] | None = None) -> None:
    """Each section's config against the sections that send it its inputs (Stage.check_senders);
    between the sections `only`, where given."""
    from maestro_flow.stage import Sender

    for s in pipeline.sections:
        if only is not None and s.name not in only:
            continue
        senders = {t: Sender(e.edge.src, pipeline.section(e.edge.src).stage, dict(pipeline.section(e.edge.src).config))
                   for e in graph.edges if e.edge.dst == s.name and (only is None or e.edge.src in only)
                   for t in e.edge.tensors}
        if senders:
            _check_config(resolve(s.stage, f"sections.{s.name}.stage"), s, "check_senders", senders)


def declared_widths(section: Section, method: str) -> dict[str, tuple[int, str]]:
    """What a section's stage declares with Stage.output_widths or input_widths (`method`): {}
    where the method is inherited from above the class that defines `__init__` or `forward` (a
    subclass may size its tensors otherwise)."""
    cls = resolve(section.stage, f"sections.{section.name}.stage")
    owner = _owner(cls, method)
    if not (issubclass(owner, _owner(cls, "__init__")) and issubclass(owner, _owner(cls, "forward"))):
        return {}
    where = f"sections.{section.name}.stage: {section.stage}.{method}(config)"
    try:
        widths = getattr(cls, method)(dict(section.config))
    except Exception as exc:
        raise PipelineError(f"{where} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(widths, dict) or not all(
            isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
            for v in widths.values()):
        raise PipelineError(f"{where} returned {widths!r}: give a dict of tensor name -> (width, config key), "
                            "each value a tuple of an int and a str")
    return widths


def check_widths(pipeline: Pipeline, graph: SectionGraph, only: Collection[str] | None = None) -> None:
    """Each edge's tensors are as wide where they are sent as where they are read (found in QA:
    `--set sections.vision.config.project_to=32` ran, and the LLM refused the first image
    sample at step 1); of the edges between the sections `only`, where given."""
    for e in graph.edges:
        if only is not None and not {e.edge.src, e.edge.dst} <= set(only):
            continue
        src, dst = pipeline.section(e.edge.src), pipeline.section(e.edge.dst)
        sent, read = declared_widths(src, "output_widths"), declared_widths(dst, "input_widths")
        for t in e.edge.tensors:
            if t in sent and t in read and sent[t][0] != read[t][0]:
                raise PipelineError(
                    f"edges[{e.index}] ({src.name} -> {dst.name}).tensors: {t} is {sent[t][0]} wide as "
                    f"{src.name} sends it (sections.{src.name}.config.{sent[t][1]}), but {dst.name} reads it "
                    f"{read[t][0]} wide (sections.{dst.name}.config.{read[t][1]}): make the two equal")


def _owner(cls: type, name: str) -> type:
    """The class in `cls`'s MRO that defines attribute `name`."""
    return next(k for k in cls.__mro__ if name in vars(k))


def check_pipeline(pipeline: Pipeline, build: bool = False) -> Checked:
    """Validate everything checkable without starting workers. `build` (maestro validate):
    also build every stage from its config on the meta device (check_builds; about 2 s for
    torch's meta initialisers, which a run spends in its workers instead, where the same errors
    show at setup naming the section).

    Reading the metadata checks every row (declared modalities against columns, unique ids), so
    bad rows are refused here too.
    """
    from maestro_flow.optim.build import check_optimizer_spec
    from maestro_flow.runtime.payloads import declared_checks
    from maestro_flow.stage import Stage

    pipeline.validate()
    graph = SectionGraph(pipeline)
    # Stages that declare their outputs (inputs) are checked here; the others when they first
    # return (when they read what no edge carries).
    declared: dict[str, tuple[str, ...] | None] = {}
    reads: dict[str, tuple[str, ...] | None] = {}
    for s in pipeline.sections:
        where = f"sections.{s.name}.stage"
        cls = resolve(s.stage, where)
        if not (isinstance(cls, type) and issubclass(cls, Stage)):
            raise PipelineError(f"{where}: {s.stage!r} is not a subclass of maestro_flow.Stage")
        _check_config(cls, s)
        declared[s.name] = _declared(cls, "outputs", s, where)
        reads[s.name] = _declared(cls, "inputs", s, where)
    for e in graph.edges:
        for end, names, kind in ((e.edge.src, declared, "outputs"), (e.edge.dst, reads, "inputs")):
            if names[end] is None:
                continue
            missing = [t for t in e.edge.tensors if t not in names[end]]
            if missing:
                raise PipelineError(
                    f"edges[{e.index}] ({e.edge.src} -> {e.edge.dst}).tensors: {', '.join(missing)} not among the "
                    f"{kind} of {pipeline.section(end).stage} ({', '.join(names[end]) or 'it declares none'})")
    for name in graph.loss_sections():
        if declared[name] is not None and "loss" not in declared[name]:
            raise PipelineError(
                f"sections.{name}: a terminal trainable section must return 'loss', but "
                f"{pipeline.section(name).stage} declares {', '.join(declared[name]) or 'no outputs'} "
                "(set trainable=False, or add a consumer)"
            )
    check_widths(pipeline, graph)
    check_senders(pipeline, graph)
    for s in pipeline.sections:
        if s.trainable:
            check_optimizer_spec(s.optimizer, f"sections.{s.name}", s.device)
        if s.tp > 1:
            check_tensor_parallel(pipeline, s, resolve(s.stage, f"sections.{s.name}.stage"))
        elif build:
            check_builds(pipeline, s)
        if graph.lockstep(s.name) and graph.inputs(s.name) and pipeline.global_batch < s.dp:
            # Its replicas gather each unit together, so one without a sample stands in with its
            # last micro-batch: in the first step it has none (runtime/lockstep.py).
            raise PipelineError(f"sections.{s.name}: an FSDP section fed by other sections needs a sample for each "
                                f"of its {s.dp} replicas in its first step, and global_batch={pipeline.global_batch} has "
                                f"fewer: raise global_batch or lower sections.{s.name}.dp")
    make_planner(pipeline.schedule, graph)  # refuses a schedule this version does not have
    source = open_source(pipeline)
    for s in pipeline.sections:
        for c in s.columns or ():
            if c not in source.column_names:
                # found in QA: data without audio for the multimodal pipeline said only this line
                fix = (f"; without {s.activates_on} data, take section {s.name!r} and its edges out of the pipeline"
                       if s.activates_on else "")
                raise PipelineError(f"sections.{s.name}.columns: dataset {pipeline.data.path} has no column {c!r} "
                                    f"(its columns: {', '.join(source.column_names)}){fix}")
    declared_checks(pipeline, source, strict=False)  # the columns a stage reads with its payloads
    metadata = source.metadata()
    check_token_limits(pipeline, source, metadata)
    if len(metadata) < pipeline.global_batch:
        raise PipelineError(f"global_batch={pipeline.global_batch} is larger than the dataset "
                            f"{pipeline.data.path} ({len(metadata)} usable samples)")
    # Found in QA: an encoder's auxiliary loss, declared, was dropped in silence (a plain loop adds it).
    unread = [f"sections.{n}: {pipeline.section(n).stage} declares a 'loss', {UNREAD_LOSS}" for n in graph.order
              if graph.drops_loss(n) and "loss" in (declared[n] or ())]  # (not when an edge carries it: review)
    return Checked(graph=graph, source=source, metadata=metadata, warnings=tuple(pipeline_warnings(pipeline) + unread),
                   data_warnings=tuple(data_warnings(pipeline, metadata)))


def data_warnings(pipeline: Pipeline, metadata: list[SampleMeta]) -> list[str]:
    """What the data makes of a valid pipeline that is almost surely not meant: a section that
    activates on a modality no sample carries never runs (found in review: an encoder routed to
    "audio" on image data trained nothing, and its consumer dropped every image, silently), and
    a modality samples carry that no section activates on is ignored."""
    counts = Counter(m for meta in metadata for m in meta.modalities)
    carried = set(counts)
    out = [f"sections.{s.name}.activates_on={s.activates_on!r}: no sample of {pipeline.data.path} carries "
           f"{s.activates_on!r} (they carry {', '.join(sorted(carried))}), so the section never runs"
           for s in pipeline.sections if s.activates_on is not None and s.activates_on not in carried]
    # And the mirror case (found in QA: mm.arrow's audio rows trained on pipelines/vlm.py, their audio
    # ignored and its placeholder token learnt as text); a section on every sample that lists the
    # modality's column reads it too (found in QA: it was said to be ignored).
    read = {s.activates_on for s in pipeline.sections if s.activates_on is not None} | {
        m for m in carried for s in pipeline.sections if s.activates_on is None and pipeline.data.column_of(m) in
        (s.columns or ())}
    for modality in sorted(carried - read - {"text"}):
        out.append(f"{counts[modality]} samples of {pipeline.data.path} carry {modality!r} but no section has "
                   f"activates_on={modality!r}: their {modality} is ignored (a placeholder token for it is read "
                   f"as text); add an encoder section for it, or leave those samples out")
    return out
