"""A replica's training state through a checkpoint (checkpoint/section_state.py), in one process
(DCP without a process group): a stage with several optimizers resumes every one of them."""

from __future__ import annotations

import pytest
import torch

from maestro_flow.checkpoint.manifest import rng_file
from maestro_flow.checkpoint.section_state import CheckpointMismatch, SectionState
from maestro_flow.optim.stepper import SectionOptimizer

# DCP says it saves and loads in a single process: it is meant.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SPEC = {"name": "adamw", "lr": 0.1, "warmup_steps": 3, "decay": "cosine", "min_lr": 0.0}


class TwoPart(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)


def build(split: bool = True) -> tuple[TwoPart, SectionOptimizer]:
    """Stage.optimizer_groups' way: one optimizer per part (its own lr), or one for all."""
    stage = TwoPart()
    groups = [(SPEC, list(stage.a.parameters())), ({**SPEC, "lr": 0.02}, list(stage.b.parameters()))] if split \
        else [(SPEC, list(stage.parameters()))]
    return stage, SectionOptimizer(SPEC, list(stage.parameters()), total_steps=10, groups=groups)


def train(optim: SectionOptimizer, steps: int) -> None:
    for _ in range(steps):
        for i, p in enumerate(optim.params):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
        optim.step()


def state(stage: TwoPart, optim: SectionOptimizer) -> SectionState:
    return SectionState(stage, optim, section="x", replica=0, group=None, device=torch.device("cpu"))


def test_every_optimizer_of_a_stage_resumes(tmp_path):
    # Reproduced before: only the first optimizer's state and schedule were saved; the second
    # restarted with empty Adam moments and its warmup, and the resumed run drifted from the
    # uninterrupted one.
    (tmp_path / "rng").mkdir()
    stage, optim = build()
    train(optim, 4)
    state(stage, optim).save(str(tmp_path))
    train(optim, 2)  # the uninterrupted run

    again, resumed = build()
    assert state(again, resumed).load(str(tmp_path)) is None
    assert [s.last_epoch for s in resumed.schedulers] == [4, 4]
    assert [{int(v["step"]) for v in o.state.values()} for o in resumed.optimizers] == [{4}, {4}]
    train(resumed, 2)
    for (name, p), q in zip(stage.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert [o.param_groups[0]["lr"] for o in resumed.optimizers] == [o.param_groups[0]["lr"] for o in optim.optimizers]


def test_optimizers_split_otherwise_than_saved_are_refused(tmp_path):
    (tmp_path / "rng").mkdir()
    stage, optim = build(split=True)
    train(optim, 1)
    state(stage, optim).save(str(tmp_path))
    again, one = build(split=False)
    with pytest.raises(CheckpointMismatch, match="optimizer 0 .*optimizer_groups changed"):
        state(again, one).load(str(tmp_path))


def test_a_truncated_rng_file_is_a_clear_error(tmp_path):
    # Reproduced before: a raw traceback from torch.load's zip reader, reported as a system error.
    (tmp_path / "rng").mkdir()
    stage, optim = build()
    state(stage, optim).save(str(tmp_path))
    path = rng_file(str(tmp_path), "x", 0, 0)
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CheckpointMismatch, match=r"cannot read the RNG state of x replica 0 \(.*x-0.*\): RuntimeError"):
        state(*build()).load(str(tmp_path))
    with open(path, "wb") as f:  # found in QA: torch's advice to load it with weights_only=False came along
        f.write(b"garbage\n")
    with pytest.raises(CheckpointMismatch, match=r"\): UnpicklingError: not a torch file of RNG state \(damaged or "
                                                 r"replaced\)$"):
        state(*build()).load(str(tmp_path))


def test_a_schedule_added_on_resume_starts_at_the_checkpoint_s_step(tmp_path):
    # Reproduced in review: a checkpoint written with a constant lr, resumed with a decay, took
    # its step from the optimizer's own state; SGD keeps none, so the schedule began again at 0.
    from maestro_flow.checkpoint import manifest as mf
    from maestro_flow.optim.build import WarmupDecay

    (tmp_path / "rng").mkdir()
    p = torch.nn.Parameter(torch.ones(3))
    holder = torch.nn.Module()
    holder.w = p
    stage = TwoPart()
    stage.a = holder  # one parameter: the stage is only a named_parameters() source here
    constant = SectionOptimizer({"name": "sgd", "lr": 1.0, "momentum": 0.9}, [p], total_steps=10)
    for _ in range(6):
        p.grad = torch.ones(3)
        constant.step()
    state(stage, constant).save(str(tmp_path))
    mf.write(str(tmp_path), mf.Manifest(step=6, pipeline={}, sections={}, sampler={}))
    spec = {"name": "sgd", "lr": 1.0, "momentum": 0.9, "decay": "cosine", "min_lr": 0.0}
    q = torch.nn.Parameter(torch.ones(3))
    again = TwoPart()
    again.a = torch.nn.Module()
    again.a.w = q
    decayed = SectionOptimizer(spec, [q], total_steps=10)
    state(again, decayed).load(str(tmp_path))
    assert decayed.lr == pytest.approx(WarmupDecay(lr=1.0, warmup_steps=0, decay="cosine", min_lr=0.0,
                                                   total_steps=10).lr_at(6))


def test_a_frozen_sections_buffers_come_back_per_replica(tmp_path):
    """A frozen section saves no DCP state, but a buffer its forward changes (BatchNorm's running
    statistics, in train mode) would restart from its built value: each replica's goes into its
    RNG file and comes back to that replica."""
    (tmp_path / "rng").mkdir()
    torch.manual_seed(0)
    replicas = [torch.nn.BatchNorm1d(3) for _ in range(2)]
    for i, bn in enumerate(replicas):
        bn(torch.randn(8, 3) + i)  # each replica's own statistics
        SectionState(bn, None, section="t", replica=i, group=None, device=torch.device("cpu")).save(str(tmp_path))
    for i, bn in enumerate(replicas):
        fresh = torch.nn.BatchNorm1d(3)
        assert SectionState(fresh, None, section="t", replica=i, group=None,
                            device=torch.device("cpu")).load(str(tmp_path)) is None
        for name, b in bn.named_buffers():
            assert torch.equal(dict(fresh.named_buffers())[name], b), (i, name)
    assert not torch.equal(replicas[0].running_mean, replicas[1].running_mean)


@pytest.mark.parametrize("raised", ["gloo", "gathered", "file", "mixed"])
def test_a_peer_lost_while_loading_is_not_blamed_on_the_checkpoint(tmp_path, monkeypatch, raised):
    """Found in review: a node lost while DCP loaded (gloo: "Connection closed by peer") was
    reported as a checkpoint that cannot be read, bad input, so --max-restarts did not restart;
    it is a system error now (the coordinator then finds the lost node). A file's own failure
    still names the checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    from maestro_flow.checkpoint import section_state

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [1.2.3.4]:5")
    error = {"gloo": gloo, "gathered": CheckpointException("load failed", {1: (gloo, None), 0: (gloo, None)}),
             "file": CheckpointException("load failed", {0: (OSError("disk error"), None)}),
             # a rank's own file error, and the collective failure it caused on another: the file's
             "mixed": CheckpointException("load failed", {0: (gloo, None), 1: (OSError("disk error"), None)})}[raised]

    def fail(self, folder, step):
        raise error

    monkeypatch.setattr(section_state.SectionState, "_load_state", fail)
    if raised in ("file", "mixed"):
        with pytest.raises(CheckpointMismatch, match=rf"the checkpoint {tmp_path}: cannot read the state of section "
                                                    r"'x' .*: OSError: disk error"):
            state(*build()).load(str(tmp_path))
    else:
        with pytest.raises(section_state.LostPeer, match=r"section 'x': a peer was lost while loading the checkpoint "
                                                         r".*Connection closed by peer"):
            state(*build()).load(str(tmp_path))
