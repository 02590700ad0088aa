"""What a checkpoint is: the layout of its folder, its manifest, and which checkpoints are valid.

Pure (standard library only): the coordinator writes and reads manifests; workers only write the
section states and RNG files the manifest points to. A checkpoint is the folder
`<checkpoint_dir>/step-<N>` for N completed steps (N is the next step to run):

    step-00000012/
        <section>/              torch.distributed.checkpoint of a trainable section: parameters,
                                optimizer state, lr schedule (written over the section's own group)
        rng/<section>-<r>.pt    the RNG states of replica r of every section
        manifest.json           written last, by the coordinator (`Manifest`), with the size and
                                CRC-32 of every file above (digest: checked on --resume)

A checkpoint without `manifest.json` is incomplete (a save was interrupted or failed) and is
never resumed from; `latest` returns the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from maestro_flow.errors import PipelineError
from maestro_flow.overrides import dotted

FORMAT = 1
MANIFEST = "manifest.json"
RNG_DIR = "rng"
STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def rng_file(folder: str, section: str, replica: int, tp_index: int = 0) -> str:
    """A rank's RNG states: one file per replica, and per tensor-parallel rank past the first."""
    return os.path.join(folder, RNG_DIR, f"{section}-{replica}" + (f"-tp{tp_index}" if tp_index else "") + ".pt")


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Everything but the tensors: read first on resume, written last on save."""

    step: int  # completed steps: the resumed run starts at this step
    pipeline: dict[str, Any]  # the configuration the checkpoint was trained with
    sections: dict[str, dict[str, Any]]  # trainable section -> {"stage", "dp", "optimizer", "params": {key: shape}}
    sampler: dict[str, Any]  # EpochSampler.position(step)
    costs: list = field(default_factory=list)  # CostFitter.state(): the planner's cost model
    restarts: int = 0  # automatic restarts so far in this job
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # section -> its Stage.stats() at `step`
    # The training this checkpoint continues: an id drawn by its first run and kept by every run
    # that resumes from it (None: written before lineages were recorded). A checkpoint directory
    # holds one lineage (Checkpointer.claim).
    lineage: str | None = None
    # Relative path -> [size, CRC-32] of every file the workers wrote (digest; empty: written
    # before checksums were kept, so nothing is checked)
    files: dict[str, list] = field(default_factory=dict)
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Manifest:
        if data.get("format") != FORMAT:
            raise PipelineError(f"checkpoint format {data.get('format')!r} is not this version's ({FORMAT})")
        files = data.get("files", {})  # (found in review: a damaged one ended in a traceback where it was used)
        if not isinstance(files, dict) or not all(
                isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
                for v in files.values()):
            raise ValueError("its files are not {path: [size, CRC-32]}")
        return Manifest(**{k: data[k] for k in ("step", "pipeline", "sections", "sampler", "costs", "restarts",
                                                "counters", "lineage", "files", "format") if k in data})


def write(folder: str, manifest: Manifest) -> str:
    """Write the manifest atomically (temporary file, fsync, rename), then fsync the folder, so a
    crash leaves either no manifest or a whole one; every file and folder the workers wrote is
    made durable first, so a manifest that survives a power loss names no file that did not."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)
    path = os.path.join(folder, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(folder)
    return path


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(folder: str, use: str = "--resume {}") -> Manifest:
    """The manifest of checkpoint `folder`; a damaged one names the checkpoint before it, with
    `use` (as `earlier`)."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            return Manifest.from_dict(json.load(f))
    except FileNotFoundError:
        raise PipelineError(f"{folder} is not a complete checkpoint (no {MANIFEST})") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # ValueError: bad JSON, or not text at all
        raise PipelineError(f"{path}: unreadable checkpoint manifest ({exc}){earlier(folder, move=False, use=use)}") \
            from None


def _canonical(value: Any) -> str:
    """One string per value, a number whatever its type (found in review: `--set ...temperature=2`
    against the file's 2.0 was warned of as a change)."""
    return json.dumps(_numbers(value), sort_keys=True, default=str)


def _numbers(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, dict, list, tuple)):
        return value
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_numbers(v) for v in value]
    return float(value) if abs(value) < 2**53 else value


def earlier(checkpoint: str, *, move: bool = True, use: str = "--resume {}") -> str:
    """Where to go back to when `checkpoint` cannot be read: the newest complete one before it
    (found in QA: a damaged manifest named none). `move`: the damaged one still counts as a
    checkpoint past it (its manifest reads), so a --checkpoint-dir holding it is refused until it
    is moved away (found in QA: that refusal then advised resuming from the damaged one). `use`:
    what to do with it, "{}" the folder (found in QA: an export was advised to --resume)."""
    here = os.path.abspath(checkpoint)
    before = [folder for _, folder, ok in checkpoints(os.path.dirname(here)) if ok and folder < here]
    if not before:
        return ""
    then = f"; with --checkpoint-dir {os.path.dirname(here)}, first move {here} away" if move else ""
    return f"; the complete checkpoint before it: {before[-1]} ({use.format(shlex.quote(before[-1]))}{then})"


def checkpoints(root: str) -> list[tuple[int, str, bool]]:
    """(step, folder, complete) of every step folder under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        folder = os.path.join(root, name)
        if m and os.path.isdir(folder):
            out.append((int(m.group(1)), folder, os.path.isfile(os.path.join(folder, MANIFEST))))
    return sorted(out)


def holds_checkpoints(folder: str) -> str | None:
    """What makes `folder` no place for other outputs (a --save-dir, an export): "is a
    checkpoint", "holds checkpoints (NEWEST and N more)", or None."""
    held = checkpoints(folder)
    if held:
        return (f"holds checkpoints ({os.path.basename(held[-1][1])}"
                f"{f' and {len(held) - 1} more' if len(held) > 1 else ''})")
    return "is a checkpoint" if os.path.isfile(os.path.join(folder, MANIFEST)) else None


def find_folder(path: str, what: str) -> str:
    """The folder `path` names, where a user gives one (`what`: the option): itself, or for a
    step folder written as its number (ckpt/step-2) the folder of that step (ckpt/step-00000002).
    A missing one is refused listing the checkpoints its parent holds."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise PipelineError(f"{what}: {path} is a file, not a checkpoint folder")
    parent, name = os.path.split(os.path.normpath(path))
    found = checkpoints(parent or ".")
    m = STEP_DIR.match(name)
    for step, folder, _ in found:
        if m and step == int(m.group(1)):
            return os.path.join(parent, os.path.basename(folder))
    shown = [os.path.basename(f) + ("" if ok else " (incomplete)") for _, f, ok in found[-8:]]
    more = f" and {len(found) - len(shown)} older" if len(found) > len(shown) else ""
    listing = (f" (checkpoints in {parent or '.'}: {', '.join(shown)}{more})" if found
               else f" ({parent or '.'} holds no step-N checkpoint folders)" if os.path.isdir(parent or ".") else "")
    raise PipelineError(f"{what}: no such folder: {path}{listing}")


def skipped_note(checkpoint: str) -> str:
    """'; newer, incomplete (...): step-00000006' for the incomplete folders beside `checkpoint`
    that are newer than it (found in QA: a resume from the folder took the one before a save whose manifest was
    missing, and said nothing of the newer one)."""
    here = os.path.abspath(checkpoint)
    try:
        found = checkpoints(os.path.dirname(here))
    except OSError:
        return ""
    mine = [step for step, f, _ in found if os.path.abspath(f) == here]
    newer = [os.path.basename(f) for step, f, ok in found if mine and not ok and step > mine[0]]  # (by step)
    return f"; newer, incomplete (an interrupted or failed save, never resumed from): {', '.join(newer)}" if newer else ""


def latest(path: str) -> str | None:
    """The newest complete checkpoint: `path` itself if it is one, else the newest under it."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    complete = [folder for _, folder, ok in checkpoints(path) if ok]
    return complete[-1] if complete else None


def incompatibilities(manifest: Manifest, pipeline: dict[str, Any]) -> list[str]:
    """What keeps a checkpoint from resuming `pipeline` (its to_dict()), each naming the field.

    Parameter shapes are checked by each worker against its built stage; here: the trainable
    sections, their stage classes and optimizers, and what the sampler position means."""
    problems = []
    now = {s["name"]: s for s in pipeline["sections"] if s["trainable"]}
    saved = manifest.sections
    for name in sorted(set(saved) - set(now)):
        problems.append(f"the checkpoint has trainable section {name!r}, the pipeline does not")
    for name in sorted(set(now) - set(saved)):
        problems.append(f"sections.{name}: trainable here, but not in the checkpoint")
    for name in sorted(set(now) & set(saved)):
        if now[name]["stage"] != saved[name]["stage"]:
            problems.append(f"sections.{name}.stage: {now[name]['stage']!r} here, {saved[name]['stage']!r} in "
                            "the checkpoint")
        if now[name]["optimizer"].get("name") != saved[name]["optimizer"].get("name"):
            problems.append(f"sections.{name}.optimizer.name: {now[name]['optimizer'].get('name')!r} here, "
                            f"{saved[name]['optimizer'].get('name')!r} in the checkpoint")
        elif now[name]["optimizer"].get("amsgrad") and not saved[name]["optimizer"].get("amsgrad"):
            # Found in review: the first step then failed in a worker (KeyError 'max_exp_avg_sq').
            problems.append(f"sections.{name}.optimizer.amsgrad: on here, off in the checkpoint (its optimizer "
                            "state has no maximum of the second moments to go on from)")
    sampler = manifest.sampler
    for key, here in (("global_batch", pipeline["global_batch"]), ("seed", pipeline["seed"]),
                      ("shuffle", pipeline["data"].get("shuffle", True))):
        if sampler.get(key) != here:
            problems.append(f"{'data.' if key == 'shuffle' else ''}{key}: {here!r} here, {sampler.get(key)!r} in the "
                            "checkpoint (the sampler position would mean other samples)")
    return problems


def resume_warnings(manifest: Manifest, pipeline: dict[str, Any]) -> list[str]:
    """What a resume takes as it is but may not be meant: another dtype or mixed precision than the
    run that wrote the checkpoint (its state cast, or the compute); a trainable section's changed
    config or optimizer fields (_trainable_changes); a frozen section is not in the
    checkpoint (its weights are built from its config, or its load_weights), so one whose stage
    or config differ from the run that wrote the checkpoint changes what the trained sections
    learn from (found in review: a teacher's init_seed changed on resume, without a word); a
    checkpoint without checksums (digest) is not checked for damage."""
    saved = {s["name"]: s for s in manifest.pipeline.get("sections", []) if isinstance(s, dict) and "name" in s}
    out = [] if manifest.files else [  # (last note: a manifest without `files` turned the check off without a word)
        "the checkpoint records no checksums of its files (written before they were kept, or `files` was taken "
        "out of its manifest.json), so a file damaged since the save is not found before the workers load it"]
    for key in ("dtype", "mixed_precision"):  # found in QA: a float64 run resumed in float32 without a word
        before, now = manifest.pipeline.get(key), pipeline.get(key)
        if key in manifest.pipeline and before != now:
            # (mixed precision keeps the parameters and optimizer state in dtype: found in QA, said "cast")
            what = (f"its state is cast to {now!r}" if key == "dtype" else
                    f"the forward and backward run {'in ' + repr(now) if now else 'without autocast'} (parameters and "
                    "optimizer state stay in dtype)")
            again = before if isinstance(before, str) else json.dumps(before)
            out.append(f"{key} is {now!r}, not {before!r} as in the run that wrote the checkpoint: {what}, so the run "
                       f"does not go on as that one would have (--set {key}={again} does)")
    for s in pipeline["sections"]:
        before = saved.get(s["name"])
        if before is not None and s["trainable"] and before.get("trainable", True):
            out += _trainable_changes(s, before)
        if s["trainable"] or before is None or before.get("trainable", True):
            continue
        changed = ["stage"] if before.get("stage") != s["stage"] else []
        config, old = s.get("config") or {}, before.get("config") or {}
        changed += [f"config.{k}" for k in sorted(set(config) | set(old), key=str)
                    if _canonical(config.get(k)) != _canonical(old.get(k))]  # NaN != NaN (found in review)
        if changed:
            out.append(f"sections.{s['name']} is frozen, so its weights are not in the checkpoint but built from its "
                       f"config, and {', '.join(changed)} {'differs' if len(changed) == 1 else 'differ'} from the "
                       "run that wrote it: what the trained "
                       "sections learn from has changed")
    return out


def _trainable_changes(now: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """A trainable section's config and optimizer fields that differ from the run that wrote the
    checkpoint (found in QA: a KD student's alpha changed on resume, and the loss jumped without a
    word). Its weights and optimizer state are the checkpoint's; what they train on with is not."""
    fields = ("config", "optimizer")
    old, new = dotted({k: before.get(k) for k in fields}), dotted({k: now.get(k) for k in fields})
    changed = [k for k in sorted(old.keys() | new.keys()) if _canonical(old.get(k)) != _canonical(new.get(k))
               and not _weights_source(k)]
    if not changed:
        return []
    shown = ", ".join(f"{k} ({_shown(new, k)} now, {_shown(old, k)} then)" for k in changed[:4])
    if len(changed) > 4:  # the rest by name (found in review: "and 2 more" named none)
        shown += f", and {', '.join(changed[4:])}"
    return [f"sections.{now['name']}: {shown} {'differs' if len(changed) == 1 else 'differ'} from the run that wrote "
            "the checkpoint: the section trains on from its weights and optimizer state with the new "
            f"value{'s' if len(changed) > 1 else ''}"]


def _weights_source(key: str) -> bool:
    """A trainable model's own init_seed or checkpoint, which the checkpoint's weights replace on
    resume (found in review: warned of as used); a KD student's `teacher` copy is rebuilt from
    the config, so its weights' source counts."""
    parts = key.split(".")
    return parts[-1] in ("init_seed", "checkpoint") and "teacher" not in parts


def _shown(d: dict[str, Any], key: str) -> str:
    return json.dumps(d[key], default=str) if key in d else "unset"


def check_samples(manifest: Manifest, num_samples: int, fingerprint: str, sizes: str | None = None) -> None:
    """The dataset is the one the checkpoint was trained on: as many usable samples, the same ids
    in the same rows, with the same modalities and sizes (sampler.data_fingerprint, without and
    with sizes; a checkpoint from before either records it not)."""
    if manifest.sampler.get("num_samples") != num_samples:
        raise PipelineError(f"data.path: the dataset has {num_samples} usable samples, the checkpoint was trained on "
                            f"{manifest.sampler.get('num_samples')} (the sampler position would mean other samples)")
    saved = manifest.sampler.get("data_fingerprint")
    if saved is not None and saved != fingerprint:
        raise PipelineError(f"data.path: the dataset is not the one the checkpoint was trained on (as many samples, "
                            f"but other ids or rows: fingerprint {fingerprint}, the checkpoint's {saved}); the "
                            f"sampler position would mean other samples")
    saved = manifest.sampler.get("data_sizes")
    if saved is not None and sizes is not None and saved != sizes:
        raise PipelineError(f"data.path: the dataset is not the one the checkpoint was trained on (the same ids in "
                            f"the same rows, but other samples: their modalities or token, patch or frame counts "
                            f"differ; fingerprint {sizes}, the checkpoint's {saved}); the sampler position would "
                            f"mean other samples")
