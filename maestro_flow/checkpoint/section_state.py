"""A replica's part of a checkpoint: its section's training state through
`torch.distributed.checkpoint` (DCP) over the section's own process group, and its RNG states
and buffers.

Runs in a worker's compute thread at a step boundary (no sample in flight). Every replica of a
trainable section calls `save` / `load` together (DCP is collective over the section's group);
DCP stores replicated tensors once and reshards on load, so a section resumed with another dp
reads the same checkpoint. The state is one flat dict:

    model/<name>            trainable parameters and buffers (names as in the stage's state_dict)
    optim/<name>/<key>      the optimizer state of each parameter that has one (Adam's step,
                            exp_avg, exp_avg_sq; SGD's momentum_buffer) — a parameter that was
                            never stepped has none, and gets none back
    optim_groups            the optimizer's param_groups (hyperparameters, parameter names)
    scheduler               the LambdaLR state, when the section has a schedule

A stage with several optimizers (Stage.optimizer_groups) saves the first one's groups and
schedule under these names and optimizer i's under `optim_groups.<i>` and `scheduler.<i>`; its
parameters' state is keyed by parameter name whichever optimizer holds them.

Every entry is a tensor — the last two hold their JSON text as bytes (DCP would otherwise split
nested Python containers into one entry per leaf).

Frozen parameters are not saved: they are rebuilt from the configuration.

Buffers (a BatchNorm's running statistics, a counter a forward updates) are per replica: nothing
synchronises them across data-parallel replicas, and each replica's change with the samples it
ran. DCP would keep one replica's copy of each replicated entry, whichever rank it picked, so
every replica's persistent buffers go into its RNG file as well (frozen sections' too) and come
back from there; the `model/` entries hold replica 0's (only replica 0 offers its buffers to DCP),
as `--save-dir` and `maestro export` do. A replica the checkpoint did not have (dp grew) takes
replica 0's buffers, and RNG states seeded for it (build.replica_seed at the checkpoint's step:
replica 0's would repeat its draws).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from maestro_flow.checkpoint import digest, rng
from maestro_flow.checkpoint import manifest as mf
from maestro_flow.checkpoint.manifest import rng_file
from maestro_flow.checkpoint.savedir import trainable_state
from maestro_flow.errors import PipelineError, brief
from maestro_flow.optim.stepper import SectionOptimizer
from maestro_flow.runtime.executor_state import collective_failure


class CheckpointMismatch(PipelineError):
    """The checkpoint does not fit the section as built now (names or shapes differ)."""


class LostPeer(RuntimeError):
    """A collective of the load failed: a peer is gone (not the checkpoint's fault)."""


def _failures(exc: BaseException) -> list[BaseException]:
    """`exc`, or the ranks' exceptions a DCP CheckpointException gathered (the lowest rank's first)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return [failures[r][0] if isinstance(failures[r], tuple) else failures[r] for r in sorted(failures)]
    return [exc]


def interrupted(exc: BaseException) -> bool:
    """Whether a DCP CheckpointException gathered a KeyboardInterrupt (Ctrl-C while it read or
    wrote): to be raised as one, not reported as a damaged checkpoint (found in review)."""
    return any(isinstance(e, KeyboardInterrupt) for e in _failures(exc))


class SectionState:
    def __init__(self, stage: Any, optim: SectionOptimizer | None, *, section: str, replica: int, group: Any,
                 device: torch.device, tp_index: int = 0, seed: int = 0) -> None:
        self.stage, self.optim = stage, optim
        self.section, self.replica, self.group, self.device = section, replica, group, device
        self.tp_index, self.seed = tp_index, seed  # the pipeline's seed (build.replica_seed)
        self.standin: dict[str, Any] | None = None  # what load() found of save()'s `standin`

    def folder(self, checkpoint: str) -> str:
        return os.path.join(checkpoint, self.section)

    # -- save ------------------------------------------------------------------------------

    @staticmethod
    def cause(exc: BaseException) -> str:
        """One line on why a save or load failed: DCP gathers every rank's exception into one
        CheckpointException; the first rank's own error is the cause (not a collective's failure
        another rank's error caused, where there is one)."""
        failures = _failures(exc)
        exc = next((e for e in failures if not collective_failure(e)), failures[0])
        if not str(exc) and isinstance(exc, EOFError):  # found in review: "EOFError: " said nothing
            return "EOFError: a file ended early (truncated or damaged)"
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    def save(self, checkpoint: str, standin: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write this replica's part; returns what the manifest records of it (replica 0 of a
        trainable section: its parameter shapes). `standin`: a lockstep FSDP replica's batch for
        rounds without samples (runtime/lockstep.pack), kept with its RNG states."""
        info: dict[str, Any] = {}
        written = []  # what this rank wrote: their checksums go into the manifest (digest)
        if self.optim is not None:
            state = self._state_dict()
            writer = _Writer(self.folder(checkpoint))
            dcp.save(state, storage_writer=writer, process_group=self.group)
            written += writer.written
            if self.replica == 0 and self.tp_index == 0:
                info["params"] = {k[len("model/"):]: list(v.shape) for k, v in state.items() if k.startswith("model/")}
        extra: dict[str, Any] = {"buffers": self._buffers()}
        if standin is not None:
            extra["standin"] = standin
        written.append(rng_file(checkpoint, self.section, self.replica, self.tp_index))
        rng.save(written[-1], self.device, extra)
        info["files"] = digest.of_files(checkpoint, written)
        return info

    def _buffers(self) -> dict[str, torch.Tensor]:
        """This replica's persistent buffers (those in the stage's state_dict), on the CPU; a
        sharded (DTensor) one is its section's, in DCP, not the replica's."""
        from torch.distributed.tensor import DTensor

        persistent = set(self.stage.state_dict())
        return {name: b.detach().cpu() for name, b in self.stage.named_buffers()
                if name in persistent and not isinstance(b, DTensor)}

    def _restore_buffers(self, saved: dict[str, torch.Tensor]) -> None:
        own = dict(self.stage.named_buffers())
        with torch.no_grad():
            for name, value in saved.items():
                if name in own and tuple(own[name].shape) == tuple(value.shape):
                    own[name].copy_(value)

    def _named(self) -> list[list[tuple[str, torch.Tensor]]]:
        """Per optimizer, each of its parameters with its name, in its state_dict's order."""
        by_id = {id(p): name for name, p in self.stage.named_parameters()}
        return [[(by_id[id(p)], p) for g in opt.param_groups for p in g["params"]] for opt in self.optim.optimizers]

    def _names(self) -> list[list[str]]:
        return [[name for name, _ in named] for named in self._named()]

    def _state_dict(self) -> dict[str, Any]:
        # Buffers from replica 0 only (each replica's own go to its RNG file): DCP writes a
        # replicated entry once, from any rank that has it, and the others it balances over ranks.
        buffers = set() if self.replica == 0 else {name for name, _ in self.stage.named_buffers()}
        state: dict[str, Any] = {f"model/{k}": v.detach() for k, v in trainable_state(self.stage).items()
                                 if k not in buffers}
        for i, (names, optimizer, scheduler) in enumerate(zip(self._names(), self.optim.optimizers,
                                                               self.optim.schedulers, strict=True)):
            saved = optimizer.state_dict()
            for index, per_param in saved["state"].items():
                for key, value in per_param.items():
                    if isinstance(value, torch.Tensor):  # SGD without momentum keeps None: nothing to keep
                        state[f"optim/{names[index]}/{key}"] = value
            state[_entry("optim_groups", i)] = _json_tensor([{**{k: v for k, v in g.items() if k != "params"},
                                                             "params": [names[j] for j in g["params"]]}
                                                            for g in saved["param_groups"]])
            if scheduler is not None:
                state[_entry("scheduler", i)] = _json_tensor(scheduler.state_dict())
        return state

    # -- load ------------------------------------------------------------------------------

    def load(self, checkpoint: str, layout: tuple[int, int] | None = None) -> str | None:
        """Restore this replica's part; returns a note when its RNG states came from another
        replica (the section's dp or tp, `layout` here, changed), else None. A checkpoint that
        does not fit, or cannot be read, or lacks this replica's RNG states though the section
        has the layout it was saved with, is a CheckpointMismatch naming the section and the
        cause."""
        if self.optim is not None:
            try:
                manifest = os.path.join(checkpoint, mf.MANIFEST)
                self._load_state(self.folder(checkpoint), mf.read(checkpoint).step if os.path.isfile(manifest) else None)
            except CheckpointMismatch:
                raise
            except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
                if interrupted(exc):
                    raise KeyboardInterrupt from None
                if all(collective_failure(e) for e in _failures(exc)):  # a rank's own file error is the cause
                    # A peer lost while DCP loads collectively (found in review: reported as bad
                    # input, so a lost node ended a run that --max-restarts would have restarted):
                    # a system error, whose cause the coordinator looks for (a dead peer or node).
                    raise LostPeer(f"section {self.section!r}: a peer was lost while loading the checkpoint "
                                   f"{checkpoint}: {self.cause(exc)}") from None
                raise CheckpointMismatch(f"the checkpoint {checkpoint}: cannot read the state of section "
                                         f"{self.section!r} ({self.folder(checkpoint)}): {self.cause(exc)}"
                                         f"{mf.earlier(checkpoint)}") from None
        own = rng_file(checkpoint, self.section, self.replica, self.tp_index)
        who = f"{self.section} replica {self.replica}" + (f" tp rank {self.tp_index}" if self.tp_index else "")
        if os.path.isfile(own):
            self._load_rng(checkpoint, own, who)
            return None
        saved = _saved_layout(checkpoint, self.section)
        if layout is not None and saved == layout:
            raise CheckpointMismatch(f"--resume {checkpoint}: {own} is missing: the RNG states and buffers of {who}, "
                                     f"which a checkpoint of this section at dp {layout[0]}, tp {layout[1]} holds; "
                                     f"the checkpoint is incomplete{mf.earlier(checkpoint) or ' (resume from another one)'}")
        for replica, tp_index in ((self.replica, 0), (0, 0)):
            other = rng_file(checkpoint, self.section, replica, tp_index)
            if os.path.isfile(other):
                self._load_rng(checkpoint, other, who)
                if replica == self.replica:  # its replica's leader's: a tp rank draws as its leader does
                    return (f"{who}: no RNG state or buffers saved for it (the section's dp or tp changed); using "
                            f"replica {replica}'s leader's")
                from maestro_flow.runtime.build import replica_seed

                step = mf.read(checkpoint).step if os.path.isfile(os.path.join(checkpoint, mf.MANIFEST)) else 0
                rng.reseed(replica_seed(self.seed, self.section, self.replica, step))
                return (f"{who}: no RNG state or buffers saved for it (the section's dp or tp changed); using replica "
                        f"{replica}'s buffers and RNG states seeded for it")
        return f"{who}: the checkpoint holds no RNG state for this section"

    def _load_rng(self, checkpoint: str, path: str, who: str) -> None:
        try:
            state = rng.load(path, self.device)
            self.standin = state.get("standin")  # another replica's will stand in too
        except Exception as exc:  # truncated or corrupt: torch.load's zip reader says so
            # Not torch's advice to load with weights_only=False (found in QA): the file is damaged.
            why = ("UnpicklingError: not a torch file of RNG state (damaged or replaced)"
                   if type(exc).__name__ == "UnpicklingError" else brief(exc))
            raise CheckpointMismatch(f"--resume {checkpoint}: cannot read the RNG state of {who} ({path}): "
                                     f"{why}{mf.earlier(checkpoint)}") from None  # (which one: found in QA)
        self._restore_buffers(state.get("buffers", {}))  # a checkpoint from before buffers were kept has none

    def _load_state(self, folder: str, step: int | None) -> None:
        """`step`: the checkpoint's, where a schedule starts that the checkpoint did not have."""
        try:
            metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        except FileNotFoundError:  # found in QA: "{folder} is missing" though only its .metadata was
            missing = folder if not os.path.isdir(folder) else os.path.join(folder, ".metadata")
            raise CheckpointMismatch(f"section {self.section!r}: the checkpoint holds no state for it "
                                     f"({missing} is missing)") from None
        model = {f"model/{k}": v.detach() for k, v in trainable_state(self.stage).items()}
        self._check(model, metadata, folder)
        target: dict[str, Any] = dict(model)
        named = self._named()
        per_optimizer = [[name for name, _ in pairs] for pairs in named]
        params = dict(pair for pairs in named for pair in pairs)
        for key, meta in metadata.items():
            if not isinstance(meta, TensorStorageMetadata) or key.startswith("model/"):
                continue
            name, _, field = key[len("optim/"):].rpartition("/") if key.startswith("optim/") else ("", "", "")
            p = params.get(name)
            if p is not None and field != "step" and tuple(meta.size) == tuple(p.shape):
                target[key] = torch.zeros_like(p, dtype=meta.properties.dtype)  # shaped and placed like p
            else:  # Adam's step (kept on the CPU, as torch.optim keeps it), the JSON entries
                target[key] = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
        dcp.load(target, checkpoint_id=folder, process_group=self.group)
        steps_done: list[int | None] = []
        for i, (names, optimizer) in enumerate(zip(per_optimizer, self.optim.optimizers, strict=True)):
            index = {name: j for j, name in enumerate(names)}
            state: dict[int, dict[str, Any]] = {}
            for key, value in target.items():
                if key.startswith("optim/"):
                    name, field = key[len("optim/"):].rsplit("/", 1)
                    if name in index:
                        state.setdefault(index[name], {})[field] = value
            saved = _from_json_tensor(target[_entry("optim_groups", i)]) if _entry("optim_groups", i) in target else None
            if saved is None or sorted(n for g in saved for n in g["params"]) != sorted(names):
                raise CheckpointMismatch(
                    f"--resume {os.path.dirname(folder)}: section {self.section!r}'s optimizer {i} "
                    f"({len(names)} parameters, e.g. {', '.join(names[:2])}) is not one the checkpoint saved: "
                    f"the stage's optimizer_groups changed since")
            groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved]
            for g in groups:
                if "betas" in g:
                    g["betas"] = tuple(g["betas"])
            optimizer.load_state_dict({"state": state, "param_groups": groups})
            scheduler = target.get(_entry("scheduler", i))
            # A schedule added since (the checkpoint's lr was constant) starts at the checkpoint's
            # step: the optimizer's own state counts no steps (SGD) or only those with a gradient.
            steps_done.append(_from_json_tensor(scheduler)["last_epoch"] if scheduler is not None else step)
        self.optim.resume(steps_done)

    def _check(self, model: dict[str, torch.Tensor], metadata: dict[str, Any], folder: str) -> None:
        saved = {k for k in metadata if k.startswith("model/")}
        missing = sorted(set(model) - saved)
        extra = sorted(saved - set(model))
        problems = []
        if missing:
            problems.append(f"the checkpoint lacks {len(missing)} of its parameters, e.g. "
                            f"{', '.join(k[6:] for k in missing[:3])}")
        if extra:
            problems.append(f"the checkpoint has {len(extra)} parameters it lacks, e.g. "
                            f"{', '.join(k[6:] for k in extra[:3])}")
        shapes = [f"{key[6:]} is {list(metadata[key].size)} in the checkpoint, {list(model[key].shape)} here"
                  for key in sorted(set(model) & saved) if tuple(metadata[key].size) != tuple(model[key].shape)]
        if shapes:
            problems += shapes[:3] + ([f"{len(shapes)} parameters differ in shape in all"] if len(shapes) > 3 else [])
        if problems:
            raise CheckpointMismatch(f"--resume {os.path.dirname(folder)}: section {self.section!r} "
                                     f"({self.stage.__class__.__module__}:{self.stage.__class__.__name__}) does not "
                                     "fit the checkpoint: " + "; ".join(problems))


def _entry(name: str, optimizer: int) -> str:
    """The checkpoint entry of optimizer `optimizer`'s groups or schedule (the first: as it was named
    before stages could have several)."""
    return name if optimizer == 0 else f"{name}.{optimizer}"


def _json_tensor(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _from_json_tensor(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.tolist()).decode())


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, except that a failed write is reported as the OS error it is.

    torch.save's zip writer turns a write the OS refused (full disk, file too large) into
    "RuntimeError: ... unexpected pos", with the OSError only in its context, which does not
    survive DCP gathering every rank's exception; so the OSError is raised instead.
    `written`: the files this rank wrote (its shards, and `.metadata` where its rank wrote that)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            done = super().write_data(plan, planner)
        except RuntimeError as exc:
            inner, seen = exc.__cause__ or exc.__context__, set()
            while inner is not None and id(inner) not in seen:
                if isinstance(inner, OSError):
                    raise OSError(inner.errno, inner.strerror, str(self.path)) from exc
                seen.add(id(inner))
                inner = inner.__cause__ or inner.__context__
            raise
        self.written += sorted({os.path.join(self.path, r.storage_data.relative_path) for r in done.wait()})
        return done

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        self.written.append(os.path.join(self.path, ".metadata"))


def _saved_layout(checkpoint: str, section: str) -> tuple[int, int] | None:
    """(dp, tp) of `section` in the pipeline the checkpoint was saved from; None when unknown."""
    try:
        saved = mf.read(checkpoint).pipeline
        spec = next(s for s in saved["sections"] if s["name"] == section)
        return int(spec.get("dp", 1)), int(spec.get("tp", 1))
    except Exception:  # no manifest or an old one: the layout is not known, so nothing is refused
        return None
