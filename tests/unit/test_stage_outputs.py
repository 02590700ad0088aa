"""Outputs that break the Stage contract (stage.output_problem) are the stage's error, named the
same way wherever the stage runs: the section executor (section and colocated mode) and
`maestro stage`. Colocated mode reports any other failure as section mode does: one line naming
the section and step, the exception chained for --debug.

Found in review: a teacher returning a numpy array, a student returning a vector or a float
"loss", failed inside maestro (`_wire`, `_loss_backward`) as a system error with maestro's own
traceback; in colocated mode as a raw traceback with no `error:` line; and `maestro stage` ran
them, or a forward with fewer entries than samples, to exit 0.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from maestro_flow.errors import StageError, SystemFailure
from maestro_flow.stage import output_problem

STAGES = '''
import torch
from maestro_flow import Stage


class Teacher(Stage):
    """Frozen: one feature vector per sample; config `bug` breaks its output."""

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.emb = torch.nn.Embedding(260, 4)

    def forward(self, batch):
        feat = torch.stack([self.emb(t).mean(0) for t in batch.columns["tokens"]])
        bug = self.config.get("bug")
        if bug == "numpy":
            return {"feat": feat.detach().numpy()}
        if bug == "short":
            return {"feat": feat[:-1]}
        if bug == "aux":  # an auxiliary loss besides its features (MoE, VQ)
            return {"feat": feat, "loss": feat.pow(2).sum()}
        return {"feat": feat}


class Student(Stage):
    """Trainable loss section; config `bug` breaks its loss."""

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, batch):
        losses = torch.stack([self.head(f).pow(2).sum() for f in batch.inputs["feat"]])
        bug = self.config.get("bug")
        if bug == "vector":
            return {"loss": losses}
        if bug == "float":
            return {"loss": losses.sum().item()}
        if bug == "first":  # a loss per sample cut to one sample: shape [1], at any micro-batch size
            return {"loss": losses[:1]}
        if bug == "detached":
            return {"loss": losses.sum().detach()}
        return {"loss": losses.sum()}


class AuxTeacher(Teacher):
    """Declares an auxiliary loss besides its features, as MoE or VQ encoders have."""

    @classmethod
    def outputs(cls, config):
        return ("feat", "loss")


class Stray(Student):
    """A parameter held by the stage itself, outside its modules."""

    @classmethod
    def tp_plan(cls, config):
        return {"head": "rowwise"}

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.blocks = [torch.nn.Linear(4, 4)]
        self.refs = [self.head]  # a module held elsewhere too: fine
'''

PIPELINE = '''
from maestro_flow import ArrowData, Edge, Pipeline, Section


def pipeline(**overrides):
    return Pipeline(
        name="contract", data=ArrowData(path="set by the test"), global_batch=4, steps=1, seed=0, schedule="fifo",
        sections=[
            Section(name="teacher", stage="contract_stages:Teacher", trainable=False, dp=1, micro_batch=2),
            Section(name="student", stage="contract_stages:Student", dp=1, micro_batch=2,
                    optimizer={"name": "sgd", "lr": 0.1}),
        ],
        edges=[Edge(src="teacher", dst="student", tensors=("feat",))],
    ).override(**overrides)
'''

PER_SAMPLE = ("a tensor whose first dimension indexes the micro-batch's samples, or a list of one tensor "
              "(or None) per sample")
NUMPY = ("section 'teacher': contract_stages:Teacher.forward returned 'feat' as ndarray of shape [2, 4]; "
         f"edge teacher->student carries it, so it must be {PER_SAMPLE}")
SHORT = ("section 'teacher': contract_stages:Teacher.forward returned 'feat' with 1 entries for a micro-batch "
         f"of 2 samples; edge teacher->student carries it, so it must be {PER_SAMPLE}")
VECTOR = ("section 'student': contract_stages:Student.forward returned 'loss' as a tensor of shape [2]; it must "
          "be a scalar tensor (0 dimensions: .sum()), the sum of the micro-batch's losses (the runtime backwards it)")
FLOAT = "section 'student': contract_stages:Student.forward returned 'loss' as float "
FIRST = ("section 'student': contract_stages:Student.forward returned 'loss' as a tensor of shape [1]; it must be a "
         "scalar tensor (0 dimensions: .sum())")


def _problem(out, *, n=2, carried=None, loss=False):
    return output_problem(out, section="s", stage="m:C", num_samples=n, carried=carried or {}, loss=loss)


def test_output_problem_names_the_output_what_came_back_and_what_the_contract_wants():
    feat = {"feat": "s->t"}
    ok = [({"feat": torch.zeros(2, 3)}, feat, False), ({"feat": [torch.zeros(3), None]}, feat, False),
          ({"feat": (torch.zeros(1), torch.zeros(5))}, feat, False),
          ({"loss": torch.tensor(1.0), "extra": "anything"}, {}, True),
          ({"loss": torch.tensor(1.0), "loss_denominator": 3}, {}, True),
          ({"loss": torch.tensor(1.0), "loss_denominator": torch.tensor(2.0)}, {}, True),
          ({"loss": torch.tensor(1.0), "loss_denominator": np.int64(2)}, {}, True)]
    for out, carried, loss in ok:
        assert _problem(out, carried=carried, loss=loss) is None, out
    who = "section 's': m:C.forward returned"
    cases = [
        (torch.zeros(2), feat, False, f"{who} Tensor, not a dict of outputs"),
        ({"other": 1}, feat, False, f"{who} no 'feat' (returned: other); edge s->t carries it"),
        ({"feat": np.zeros((2, 3))}, feat, False, f"{who} 'feat' as ndarray of shape [2, 3]; edge s->t carries it, "
                                                  f"so it must be {PER_SAMPLE}"),
        ({"feat": torch.zeros(1, 3)}, feat, False, f"{who} 'feat' with 1 entries for a micro-batch of 2 samples"),
        ({"feat": torch.tensor(1.0)}, feat, False, f"{who} 'feat' as a tensor of shape []"),
        ({"feat": [torch.zeros(1)]}, feat, False, f"{who} 'feat' with 1 entries for a micro-batch of 2 samples"),
        ({"feat": [torch.zeros(1), np.zeros(1)]}, feat, False,
         f"{who} 'feat' as a list whose entry 1 is ndarray of shape [1]"),
        ({"feat": 3.0}, feat, False, f"{who} 'feat' as float 3.0;"),
        ({"total": torch.tensor(1.0)}, {}, True, f"{who} no 'loss' (returned: total); a terminal trainable section"),
        ({"loss": torch.ones(2)}, {}, True, f"{who} 'loss' as a tensor of shape [2]; it must be a scalar tensor"),
        ({"loss": torch.ones(1)}, {}, True, f"{who} 'loss' as a tensor of shape [1]; it must be a scalar tensor"),
        ({"loss": 1.5}, {}, True, f"{who} 'loss' as float 1.5; it must be a scalar tensor"),
        ({"loss": torch.tensor(1.0), "loss_denominator": torch.ones(2)}, {}, True,
         f"{who} 'loss_denominator' as a tensor of shape [2]; it must be a number or a scalar tensor"),
        ({"loss": torch.tensor(1.0), "loss_denominator": None}, {}, True, f"{who} 'loss_denominator' as NoneType None"),
    ]
    for out, carried, loss, expected in cases:
        problem = _problem(out, carried=carried, loss=loss)
        assert problem is not None and problem.startswith(expected), (problem, expected)


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    """The pipeline file (stages beside it) and its data."""
    from loaders.demo import build_text_demo

    folder = tmp_path_factory.mktemp("contract")
    (folder / "contract_stages.py").write_text(textwrap.dedent(STAGES))
    (folder / "contract.py").write_text(textwrap.dedent(PIPELINE))
    data = build_text_demo(folder, num_samples=16, min_tokens=4, max_tokens=8, parquet=False)
    return str(folder / "contract.py"), str(data)


def _colocated(contract, overrides, wrap=None):
    from maestro_flow.runtime.build import load_pipeline, open_source
    from maestro_flow.runtime.colocated import run_colocated
    from maestro_flow.runtime.report import RunReport
    from maestro_flow.runtime.sampler import EpochSampler

    path, data = contract
    pipeline, _ = load_pipeline(path, {"data.path": data, **overrides})
    source = open_source(pipeline)
    sampler = EpochSampler(source.metadata(), pipeline.global_batch, 0)
    report = RunReport(total_steps=pipeline.steps, metrics_out=None, show_progress=False)
    run_colocated(pipeline, wrap(source) if wrap else source, sampler, report)


@pytest.mark.parametrize("bug, expected", [
    ({"sections.teacher.config.bug": "numpy"}, NUMPY),
    ({"sections.teacher.config.bug": "short"}, SHORT),
    ({"sections.student.config.bug": "vector"}, VECTOR),
    ({"sections.student.config.bug": "float"}, FLOAT),
    ({"sections.student.config.bug": "first"}, FIRST),
])
def test_the_executor_reports_a_broken_output_as_the_stages_error(contract, bug, expected):
    """The executor checks outputs right after forward (colocated mode drives the same executors
    as the workers, and turns their StageFault into the StageError a worker's report becomes)."""
    _colocated(contract, {})  # the stages keep the contract
    with pytest.raises(StageError) as caught:
        _colocated(contract, bug)
    err = caught.value
    section = next(iter(bug)).split(".")[1]
    assert (err.section, err.replica, err.step, err.phase) == (section, 0, 0, "forward")
    assert err.traceback.startswith(expected), err.traceback
    assert "Traceback" not in err.traceback  # maestro's own frames are no help to the stage's author


def test_a_loss_without_a_gradient_is_the_stages_error_in_one_line(contract):
    """Found in QA: torch's "element 0 of tensors does not require grad", from a frame of the runtime."""
    with pytest.raises(StageError) as caught:
        _colocated(contract, {"sections.student.config.bug": "detached"})
    err = caught.value
    assert (err.section, err.step, err.phase) == ("student", 0, "backward")
    assert err.traceback == ("section 'student': contract_stages:Student.forward returned 'loss' with no gradient "
                             "(detached, computed under torch.no_grad(), or an integer tensor): it must be computed "
                             "from the section's outputs, so that it can train it"), err.traceback


def test_parameters_the_stage_holds_outside_its_modules_are_refused_before_any_worker_starts(contract):
    """Found in QA: an nn.Parameter on the stage itself was never trained or saved, in silence."""
    from maestro_flow.errors import PipelineError
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.checks import check_pipeline

    path, data = contract
    pipeline, _ = load_pipeline(path, {"data.path": data, "sections.student.stage": "contract_stages:Stray"})
    for tp in (1, 2):  # at tp 2 not blamed on the tp plan (found in review)
        with pytest.raises(PipelineError) as caught:
            check_pipeline(pipeline.override(**{"sections.student.tp": tp}), build=True)
        assert str(caught.value) == (
            "sections.student.stage: contract_stages:Stray keeps self.scale (an nn.Parameter) and self.blocks (a list "
            "of modules or parameters) outside its nn.Module attributes (Stage.modules()), so the runtime would not "
            "train, save or move them: hold self.scale in a module (an nn.ParameterDict, or an attribute of an "
            "nn.Module of the stage); make self.blocks an nn.ModuleList or nn.ParameterList")


def test_a_declared_loss_that_nothing_reads_is_warned_of(contract):
    """Found in QA: an encoder's auxiliary loss was dropped in silence, where a plain loop adds it."""
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.checks import check_pipeline

    path, data = contract
    pipeline, _ = load_pipeline(path, {"data.path": data, "sections.teacher.stage": "contract_stages:AuxTeacher",
                                       "sections.teacher.trainable": True,
                                       "sections.teacher.optimizer": {"name": "sgd", "lr": 0.1}})
    assert check_pipeline(pipeline).warnings == (
        "sections.teacher: contract_stages:AuxTeacher declares a 'loss', which nothing reads: only a terminal "
        "trainable section's loss trains (to add this one, send it per sample on an edge to that section and add it "
        "to its loss there)",)
    frozen, _ = load_pipeline(path, {"data.path": data, "sections.teacher.stage": "contract_stages:AuxTeacher"})
    assert check_pipeline(frozen).warnings == ()  # a frozen section trains nothing anyway
    carried, _ = load_pipeline(path, {"data.path": data, "sections.teacher.stage": "contract_stages:AuxTeacher",
                                      "sections.teacher.trainable": True,
                                      "sections.teacher.optimizer": {"name": "sgd", "lr": 0.1},
                                      "edges": [{"src": "teacher", "dst": "student", "tensors": ["feat", "loss"]}]})
    assert check_pipeline(carried).warnings == ()  # sent on to be added there (found in review)


def test_an_undeclared_loss_that_nothing_reads_is_warned_of_once_at_run_time(contract, capsys):
    """Found in QA: a non-terminal trainable section's "loss", not declared in `outputs`, was
    dropped in silence (validate cannot see it); a declared one is warned of before the run."""
    trainable = {"sections.teacher.config.bug": "aux", "sections.teacher.trainable": True,
                 "sections.teacher.optimizer": {"name": "sgd", "lr": 0.1}, "steps": 2}
    _colocated(contract, trainable)
    warned = [line for line in capsys.readouterr().err.splitlines() if "nothing reads" in line]
    assert warned == [
        "maestro: warning: section 'teacher': contract_stages:Teacher.forward returned a 'loss', which nothing reads: "
        "only a terminal trainable section's loss trains (to add this one, send it per sample on an edge to that "
        "section and add it to its loss there)"], warned  # once, though every forward returned one
    _colocated(contract, {**trainable, "sections.teacher.stage": "contract_stages:AuxTeacher"})
    assert "nothing reads" not in capsys.readouterr().err  # declared: the checks before the run say it
    _colocated(contract, {"sections.teacher.config.bug": "aux", "steps": 1})
    assert "nothing reads" not in capsys.readouterr().err  # frozen: it trains nothing anyway


class _FailingSource:
    """A data source whose reads fail: an error that is no stage's."""

    def __init__(self, source) -> None:
        self.source = source

    def __getattr__(self, name):
        return getattr(self.source, name)

    def read(self, rows, columns):
        raise OSError("disk gone")


def test_colocated_reports_a_system_error_in_one_line_naming_section_and_step(contract):
    with pytest.raises(SystemFailure) as caught:
        _colocated(contract, {}, wrap=_FailingSource)
    assert str(caught.value) == ("system error in section 'teacher' replica 0 (rank 0) during step 1: "
                                 "OSError: disk gone")
    assert isinstance(caught.value.__cause__, OSError)  # what --debug shows


def test_colocated_reports_a_setup_error_in_one_line_naming_the_section(contract, monkeypatch):
    """Found in review: an error while a section's executor was set up (its optimizer, say)
    escaped colocated mode as a bare traceback, with no `error:` line."""
    import maestro_flow.runtime.executor as executor

    def refuse(*args, **kwargs):
        raise ValueError("no optimizer today")

    monkeypatch.setattr(executor, "SectionOptimizer", refuse)
    with pytest.raises(SystemFailure) as caught:
        _colocated(contract, {})
    assert str(caught.value) == ("system error in section 'student' replica 0 (rank 1) during setup: "
                                 "ValueError: no optimizer today")


@pytest.mark.parametrize("section, bug, expected", [
    ("teacher", "numpy", NUMPY), ("teacher", "short", SHORT),
    ("student", "vector", VECTOR), ("student", "float", FLOAT),
    # found in QA: `stage` said "nothing to backward" and exited 0
    ("student", "detached", "section 'student': contract_stages:Student.forward returned 'loss' with no gradient"),
])
def test_maestro_stage_refuses_what_a_run_refuses(contract, section, bug, expected):
    from maestro_flow.cli_stage import stage

    path, data = contract
    sets = ["--set", f"data.path={data}", "--set", "sections.student.micro_batch=2"]
    fine = CliRunner().invoke(stage, [path, section, *sets], catch_exceptions=False)
    assert fine.exit_code == 0, fine.output
    args = [path, section, *sets, "--set", f"sections.{section}.config.bug={bug}"]
    result = CliRunner().invoke(stage, args, catch_exceptions=False)
    assert result.exit_code == 3, result.output
    assert f"error: {expected}" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("bug, expected", [({"sections.teacher.config.bug": "numpy"}, NUMPY),
                                           ({"sections.student.config.bug": "float"}, FLOAT)])
def test_the_monolithic_baseline_holds_its_sections_to_the_same_contract(contract, bug, expected):
    """The baseline's fused model runs every section's forward itself: its checks were its own
    (a numpy output failed inside it, a float loss passed through to the backward)."""
    from maestro_flow.baseline.monolithic import monolithic_pipeline
    from maestro_flow.runtime.build import load_pipeline, open_source
    from maestro_flow.runtime.colocated import run_colocated
    from maestro_flow.runtime.report import RunReport
    from maestro_flow.runtime.sampler import EpochSampler

    path, data = contract
    pipeline, _ = load_pipeline(path, {"data.path": data, **bug})
    fused = monolithic_pipeline(pipeline, devices=1)
    source = open_source(fused)
    with pytest.raises(StageError) as caught:
        run_colocated(fused, source, EpochSampler(source.metadata(), fused.global_batch, 0),
                      RunReport(total_steps=1, metrics_out=None, show_progress=False))
    assert f"ValueError: {expected}" in caught.value.traceback, caught.value.traceback


def test_the_monolithic_baseline_warns_of_an_unread_loss_too(contract, capsys):
    """Found in review: section mode warned of a non-terminal section's undeclared "loss"; the
    baseline's fused model dropped it in silence."""
    from maestro_flow.baseline.monolithic import monolithic_pipeline
    from maestro_flow.runtime.build import load_pipeline, open_source
    from maestro_flow.runtime.colocated import run_colocated
    from maestro_flow.runtime.report import RunReport
    from maestro_flow.runtime.sampler import EpochSampler

    path, data = contract
    pipeline, _ = load_pipeline(path, {"data.path": data, "sections.teacher.config.bug": "aux", "steps": 2,
                                       "sections.teacher.trainable": True,
                                       "sections.teacher.optimizer": {"name": "sgd", "lr": 0.1}})
    fused = monolithic_pipeline(pipeline, devices=1)
    source = open_source(fused)
    run_colocated(fused, source, EpochSampler(source.metadata(), fused.global_batch, 0),
                  RunReport(total_steps=2, metrics_out=None, show_progress=False))
    warned = [line for line in capsys.readouterr().err.splitlines() if "nothing reads" in line]
    assert len(warned) == 1 and warned[0].startswith(
        "maestro: warning: section 'teacher': contract_stages:Teacher.forward returned a 'loss'"), warned


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bug, expected", [({"sections.teacher.config.bug": "numpy"}, NUMPY),
                                           ({"sections.teacher.config.bug": "short"}, SHORT),
                                           # at micro-batch 1 (found in QA: a loss per sample passed there)
                                           ({"sections.student.config.bug": "vector"}, VECTOR.replace("[2]", "[1]"))])
def test_maestro_profile_refuses_what_a_run_refuses(contract, bug, expected):
    """Found in review: `maestro profile` ran forwards without the output check, so a broken
    output failed later with Python's or torch's message (a vector loss: "grad can be implicitly
    created only for scalar outputs", blamed on the optimizer step). profile_to is the profiling
    worker's body, run here in-process."""
    from maestro_flow.runtime.profiling import ProfileOptions, ProfilingError, profile_to

    path, data = contract

    def profile(overrides):
        messages: list = []
        profile_to(messages.append, path, ProfileOptions(overrides={"data.path": data, **overrides}, sizes=(1,),
                                                         repeats=1, calibrate_steps=0, threads=1), cores=1)
        return messages[-1]

    assert profile({})[0] == "ok"
    kind, body = profile(bug)
    assert kind == "error" and body["section"] == next(iter(bug)).split(".")[1], (kind, body)
    message = str(ProfilingError(**body))
    assert message.startswith(f"profiling failed in section {body['section']!r} during ") and \
        message.endswith(f": StageOutputError: {expected}"), message


def test_maestro_stage_says_when_the_upstream_section_broke_the_contract(contract):
    """`maestro stage` of the student computes its inputs by running the teacher: a teacher that
    breaks the contract is not the student's failure (exit 3) but its inputs' (exit 2, as the
    help says), named, with the way round it (random inputs)."""
    from maestro_flow.cli_stage import stage

    path, data = contract
    args = [path, "student", "--set", f"data.path={data}", "--set", "sections.teacher.config.bug=numpy"]
    result = CliRunner().invoke(stage, args, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert (f"error: running upstream section 'teacher' to compute this section's inputs failed (StageOutputError: "
            f"{NUMPY}); pass --input-shape NAME=DxD to use random inputs instead") in result.output, result.output
