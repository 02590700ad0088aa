"""Optimizer concerns (maestro_flow/optim/): the lr schedule, optimizer arguments, the end-of-step
sequence and the clipping rule — each against what torch itself does."""

from __future__ import annotations

import math

import pytest
import torch

from maestro_flow import ArrowData, Pipeline, PipelineError, Section
from maestro_flow.optim.build import WarmupDecay, build_scheduler, check_optimizer_spec
from maestro_flow.optim.clip import clip_coefficient, global_norm
from maestro_flow.optim.stepper import SectionOptimizer


def lrs(spec: dict, total: int) -> list[float]:
    params = [torch.nn.Parameter(torch.zeros(2))]
    optim = SectionOptimizer(spec, params, total_steps=total)
    out = []
    for _ in range(total):
        out.append(optim.lr)
        params[0].grad = torch.ones(2)
        optim.step()
    return out


def test_warmup_then_cosine_to_min_lr_at_the_last_step():
    got = lrs({"name": "adamw", "lr": 1.0, "warmup_steps": 2, "decay": "cosine", "min_lr": 0.1}, total=7)
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[-1] == pytest.approx(0.1)


def test_linear_and_constant_decay():
    assert lrs({"name": "sgd", "lr": 1.0, "decay": "linear", "min_lr": 0.0}, total=5) == \
        pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert lrs({"name": "sgd", "lr": 0.5, "warmup_steps": 4}, total=6) == \
        pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5, 0.5])
    assert lrs({"name": "sgd", "lr": 0.5}, total=3) == [0.5, 0.5, 0.5]  # no schedule at all


def test_a_schedule_is_a_torch_lambda_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler({"lr": 1.0, "warmup_steps": 3}, opt, total_steps=10)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    assert isinstance(sched.lr_lambdas[0], WarmupDecay)
    assert build_scheduler({"lr": 1.0}, opt, total_steps=10) is None


@pytest.mark.parametrize("optimizer, message", [
    ({"name": "adamw", "lr": 1e-3, "decay": "exp"}, "sections.s.optimizer.decay must be one of cosine, linear"),
    ({"name": "adamw", "lr": 1e-3, "warmup_steps": -1}, "sections.s.optimizer.warmup_steps must be an integer >= 0"),
    ({"name": "adamw", "lr": 1e-3, "min_lr": 1.0}, r"sections.s.optimizer.min_lr must be a number in \[0, lr=0.001\]"),
])
def test_schedule_fields_are_checked(optimizer, message):
    with pytest.raises(PipelineError, match=message):
        Section(name="s", stage="m:C", optimizer=optimizer).validate()


def test_unknown_optimizer_arguments_are_refused_before_any_worker_starts():
    check_optimizer_spec({"name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95],
                          "warmup_steps": 3}, "sections.s")
    with pytest.raises(PipelineError, match=r"sections.s.optimizer.momentum: not an argument of .*AdamW"):
        check_optimizer_spec({"name": "adamw", "lr": 1e-3, "momentum": 0.9}, "sections.s")


@pytest.mark.parametrize("extra, message", [
    ({"betas": [0.9]}, r"^sections.s.optimizer.betas must be a list of two numbers, got \[0.9\]$"),  # a traceback
    ({"betas": [0.9, 0.99, 0.1]}, "betas must be a list of two numbers"),  # failed in every worker at step 1
    ({"differentiable": True}, r"^sections.s.optimizer.differentiable: the runtime steps the optimizer outside "),
    ({"capturable": True}, r"^sections.s.optimizer.capturable is for CUDA graphs: .*\(its device is cpu\)"),
])
def test_optimizer_values_that_fail_at_the_first_step_are_refused_before_it(extra, message):
    """Found in QA: these passed validate (or gave a traceback) and failed in the workers."""
    with pytest.raises(PipelineError, match=message):
        check_optimizer_spec({"name": "adamw", "lr": 1e-3, **extra}, "sections.s")
    check_optimizer_spec({"name": "adamw", "lr": 1e-3, "capturable": True}, "sections.s", "cuda")  # its device
    with pytest.raises(PipelineError, match=r"^sections.s.optimizer.betas: not an argument of .*SGD"):  # not its length
        check_optimizer_spec({"name": "sgd", "lr": 1e-3, "betas": [0.9]}, "sections.s")


def test_schedules_that_cannot_be_meant_are_warned_of():
    """Found in QA: min_lr without a decay, and a warmup longer than the run, passed in silence."""
    from maestro_flow.optim.build import schedule_warnings

    assert schedule_warnings({"lr": 0.1, "min_lr": 0.01}, "sections.s", 10) == [
        "sections.s.optimizer.min_lr=0.01 is not used: the lr only decays towards it with "
        "sections.s.optimizer.decay='cosine' or 'linear' (the default, 'constant', keeps lr)"]
    assert schedule_warnings({"lr": 0.1, "warmup_steps": 50}, "sections.s", 2) == [
        "sections.s.optimizer.warmup_steps=50 is more than the pipeline's 2 steps: the lr never reaches 0.1 "
        "(it would after 50 steps)"]
    assert schedule_warnings({"lr": 0.1, "warmup_steps": 5, "decay": "cosine", "min_lr": 0.01}, "sections.s", 6) == []


def test_pipeline_level_fields_are_checked():
    p = Pipeline(name="p", data=ArrowData(path="d"), sections=[Section(name="s", stage="m:C")])
    with pytest.raises(PipelineError, match="grad_clip must be a number > 0"):
        p.override(grad_clip=0).validate()
    with pytest.raises(PipelineError, match="mixed_precision must be one of bf16"):
        p.override(mixed_precision="fp8").validate()
    with pytest.raises(PipelineError, match="keeps float32 master weights: set dtype to float32"):
        p.override(mixed_precision="bf16", dtype="float64").validate()
    with pytest.raises(PipelineError, match="data.modality_columns: 'text' is not a payload modality"):
        p.override(**{"data.modality_columns": {"text": "x"}}).validate()


def test_a_parameter_without_gradient_is_left_exactly_alone():
    """As torch.optim leaves it: no weight decay, no moment and no step count."""
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optim = SectionOptimizer({"name": "adamw", "lr": 0.1, "weight_decay": 0.5}, [used, unused], total_steps=2)
    for _ in range(2):
        used.grad = torch.full((3,), 0.5)
        optim.step()
    assert torch.equal(unused.detach(), torch.ones(3))
    assert unused not in optim.optimizer.state and int(optim.optimizer.state[used]["step"]) == 2


def test_the_norm_share_and_clip_coefficient_are_clip_grad_norm_s():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    b = [torch.nn.Parameter(torch.randn(5))]
    for p in a + b:
        p.grad = torch.randn_like(p)
    a[1].grad = None  # no gradient: not counted
    grads = [p.grad.clone() if p.grad is not None else None for p in a + b]
    share_a = SectionOptimizer({"name": "sgd", "lr": 1.0}, a, total_steps=1).sq_norm()
    share_b = SectionOptimizer({"name": "sgd", "lr": 1.0}, b, total_steps=1).sq_norm()
    assert SectionOptimizer({"name": "sgd", "lr": 1.0}, b, total_steps=1, owns_norm=False).sq_norm() == 0.0
    norm = global_norm([share_a, share_b])
    reference = torch.nn.utils.clip_grad_norm_([p for p in a + b], max_norm=0.5)
    assert norm == pytest.approx(float(reference), rel=1e-6)
    coef = clip_coefficient(0.5, norm)
    for p, g in zip(a + b, grads, strict=True):
        if g is not None:
            assert torch.allclose(p.grad, g * coef, rtol=1e-6)
    assert clip_coefficient(None, 100.0) == 1.0 and clip_coefficient(10.0, 1.0) == 1.0


def test_a_resumed_schedule_is_the_pipeline_s_as_given_now():
    """Resuming 4 steps into a 10-step cosine with steps raised to 20: the decay stretches, and the
    optimizer keeps its state."""
    spec = {"name": "adamw", "lr": 1.0, "warmup_steps": 2, "decay": "cosine", "min_lr": 0.0, "weight_decay": 0.1}
    p = torch.nn.Parameter(torch.ones(2))
    before = SectionOptimizer(spec, [p], total_steps=10)
    for _ in range(4):
        p.grad = torch.ones(2)
        before.step()
    q = torch.nn.Parameter(p.detach().clone())
    after = SectionOptimizer({**spec, "weight_decay": 0.2}, [q], total_steps=20)
    after.optimizer.load_state_dict(before.optimizer.state_dict())
    after.resume([4])
    assert after.lr == pytest.approx(WarmupDecay(lr=1.0, warmup_steps=2, decay="cosine", min_lr=0.0,
                                                  total_steps=20).lr_at(4))
    assert after.optimizer.param_groups[0]["weight_decay"] == 0.2
    assert int(after.optimizer.state[q]["step"]) == 4
    q.grad = torch.ones(2)
    after.step()
    assert after.scheduler.last_epoch == 5
