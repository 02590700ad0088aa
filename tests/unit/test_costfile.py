"""The cost file at its door (runtime/costfile.py): every field checked, a file measured on another
pipeline or another model refused, and what `maestro profile` checks before and after its work.

Pure reading and writing of JSON files, plus one in-process profile of a tiny vlm (no processes)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from maestro_flow.config import Cost
from maestro_flow.errors import PipelineError
from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.costfile import (
    VERSION,
    file_overrides,
    profiled_with,
    read_cost_file,
    read_planning_s,
    staged,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLM = os.path.join(ROOT, "pipelines/vlm.py")
FIGURES = {"micro_batch_overhead_s": 1e-3, "memory_base_mb": 4.0, "peak_memory_mb_per_sample": 0.5,
           "runtime_overhead_s": 5e-4, "step_overhead_s": 2e-3, "grad_mb": 1.0, "param_mb": 1.0, "tp_share": 0.5,
           "unit_mb": 0.25}


def _vlm(**overrides):
    return load_pipeline(VLM, overrides)[0]


def _cost_file(p, **top) -> dict:
    """A complete cost file as `maestro profile` writes it for `pipeline` (every section measured)."""
    sections = {s.name: {"profiled_with": profiled_with(p, s), "cost": dataclasses.asdict(Cost(per_sample_s=1e-3)),
                         **FIGURES} for s in p.sections}
    return {"version": VERSION, "pipeline": p.name, "planning_s": 1e-3, "sections": sections, **top}


def _write(tmp_path, data: dict) -> str:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    return str(path)


# -- finding 1: a file measured on another model is refused -------------------------------------


def test_a_cost_file_of_a_differently_sized_model_is_refused(tmp_path):
    """The review's repro: vlm profiled, then tuned with a 12-layer d_model=1024 llm and the small
    model's memory figures said the llm fits in 7 MB. The file records what each section was
    profiled with; a section that differs is refused, naming it and the fields."""
    from maestro_flow.runtime.tuning import TuneOptions, tune_pipeline

    path = _write(tmp_path, _cost_file(_vlm()))
    bigger = {"sections.llm.config.d_model": 1024, "sections.llm.config.n_layers": 12, "sections.llm.config.n_heads": 16}
    with pytest.raises(PipelineError, match=r"sections\.llm was profiled with another config\.d_model \(64, now 1024\), "
                                            r"config\.n_heads \(4, now 16\), config\.n_layers \(2, now 12\).*maestro profile"):
        file_overrides(_vlm(**bigger), path)
    with pytest.raises(PipelineError, match=r"sections\.llm was profiled with another config\.d_model"):
        tune_pipeline(VLM, TuneOptions(overrides=bigger, devices=3, costs=path, memory_gb=0.05))


@pytest.mark.parametrize("change, field", [
    ({"dtype": "float64"}, "dtype ('float32', now 'float64')"),
    ({"mixed_precision": "bf16"}, "mixed_precision (None, now 'bf16')"),
    ({"sections.vision.device": "cuda"}, "device ('cpu', now 'cuda')"),
    ({"sections.vision.stage": "stages.vision:Other"}, "stage ("),
    ({"sections.vision.trainable": False}, "trainable (True, now False)"),
    ({"sections.vision.optimizer.name": "sgd"}, "optimizer.name ('adamw', now 'sgd')"),
    ({"sections.vision.optimizer.amsgrad": True}, "optimizer.amsgrad (unset, now True)"),  # one more buffer
    ({"sections.vision.config.decode.max_side": 32}, "config.decode.max_side ("),
    # found in QA: a nested config's change was cut off, both dicts shown to 60 characters
    ({"sections.vision.config.decode.max_side": 32, "sections.vision.config.extra": {"a": 1, "b": {"c": 2}}},
     "config.decode.max_side (64, now 32), config.extra (unset, now {'a': 1, 'b': {'c': 2}})"),
])
def test_what_a_measurement_depends_on_is_checked(tmp_path, change, field):
    path = _write(tmp_path, _cost_file(_vlm()))
    with pytest.raises(PipelineError, match=r"sections\.\w+ was profiled with another") as err:
        file_overrides(_vlm(**change), path)
    assert field in str(err.value)


def test_what_the_tuner_varies_does_not_stale_a_cost_file(tmp_path):
    """dp, micro_batch, tp and fsdp (the profile measures dp 1, tp 1, several sizes), the
    learning rate and its schedule, and the optimizer's other numbers (weight decay, betas:
    found by review to force a new profile) change nothing a profile measures."""
    path = _write(tmp_path, _cost_file(_vlm()))
    same = _vlm(**{"sections.llm.dp": 4, "sections.llm.micro_batch": 2, "sections.llm.tp": 2, "sections.llm.fsdp": True,
                   "sections.llm.optimizer.lr": 1e-4, "sections.llm.optimizer.warmup_steps": 3, "steps": 7,
                   "sections.llm.optimizer.weight_decay": 0.05, "sections.llm.optimizer.betas": [0.8, 0.9],
                   "data.path": "elsewhere.arrow"})
    assert file_overrides(same, path)["sections.llm.cost"]["per_sample_s"] == 1e-3


def test_a_file_written_before_the_optimizer_fingerprint_narrowed_still_reads(tmp_path):
    # Found by review: a version 2 file whose optimizer fingerprint kept every key (weight decay
    # included) was refused for the very pipeline it was profiled on ("weight_decay (0.1, now unset)").
    p = _vlm(**{"sections.llm.optimizer.weight_decay": 0.1})
    data = _cost_file(p)
    data["sections"]["llm"]["profiled_with"]["optimizer"] = {"weight_decay": 0.1}  # as written then, no name
    assert file_overrides(p, _write(tmp_path, data))["sections.llm.cost"]["per_sample_s"] == 1e-3


# -- finding 2: planning_s ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), -5.0, "fast", True, float("inf")])
def test_a_bad_planning_time_is_refused(tmp_path, bad):
    path = _write(tmp_path, _cost_file(_vlm(), planning_s=bad))
    with pytest.raises(PipelineError, match="planning_s: .* is not a finite number >= 0"):
        read_planning_s(path)


# -- finding 4: incomplete files ------------------------------------------------------------------


def _drop(data: dict, *keys: str) -> dict:
    for key in keys:
        *head, last = key.split(".")
        target = data
        for part in head:
            target = target[part]
        del target[last]
    return data


@pytest.mark.parametrize("mutate, message", [
    (lambda d: {**d, "sections": {}}, "'sections' is empty"),
    (lambda d: _drop(d, "sections.llm.cost.per_token_s", "sections.llm.cost.padded"),
     r"sections\.llm\.cost: missing field\(s\) per_token_s, padded"),
    (lambda d: {**d, "sections": {**d["sections"], "llm": {**d["sections"]["llm"], "cost": {}}}},
     r"sections\.llm\.cost: missing field\(s\) per_sample_s"),
    (lambda d: _drop(d, "sections.llm.memory_base_mb"), r"sections\.llm: missing field\(s\) memory_base_mb"),
    (lambda d: _drop(d, "sections.llm.profiled_with"), r"sections\.llm: missing field\(s\) profiled_with"),
    (lambda d: {**d, "version": 99}, "version 99 is not a cost file version"),
    (lambda d: _drop(d, "version"), "version None is not a cost file version"),
    (lambda d: {**d, "version": 1}, "a version 1 cost file.*maestro profile"),
    (lambda d: _drop(d, "pipeline"), "'pipeline' .* is missing"),
    (lambda d: _drop(d, "planning_s"), "planning_s is missing"),
    (lambda d: {**d, "sections": {"llm": {**d["sections"]["llm"], "cost": {**d["sections"]["llm"]["cost"],
                                                                           "per_token_s": True}}}},
     r"sections\.llm\.cost\.per_token_s: True is not a finite number"),
])
def test_an_incomplete_or_foreign_cost_file_is_refused(tmp_path, mutate, message):
    path = _write(tmp_path, mutate(_cost_file(_vlm())))
    with pytest.raises(PipelineError, match=message):
        read_cost_file(path)


def test_a_pipeline_section_missing_from_the_file_is_refused(tmp_path):
    data = _cost_file(_vlm())
    del data["sections"]["vision"]
    with pytest.raises(PipelineError, match=r"section\(s\) vision of pipeline 'vlm' are not in the file"):
        file_overrides(_vlm(), _write(tmp_path, data))


def test_a_section_no_sample_activated_is_noted_where_its_memory_goes_unchecked(tmp_path):
    """`maestro profile` keeps a section no sample activates out of `sections` and says so in
    `unmeasured`; the tuner then names it: its memory is not checked against --memory-gb."""
    from maestro_flow.runtime.tuning import TuneOptions, tune_pipeline

    pipeline = _vlm()
    data = _cost_file(pipeline)
    vision = data["sections"].pop("vision")
    data["unmeasured"] = {"vision": {"reason": "no sample in the dataset activates it",
                                     "profiled_with": vision["profiled_with"]}}
    path = _write(tmp_path, data)
    notes: list[str] = []
    assert set(file_overrides(pipeline, path, notes)) == {"sections.llm.cost"}  # vision keeps the pipeline's Cost
    assert notes == [f"--costs {path} has no measurement of vision (no sample in the dataset activates it): "
                     "the pipeline's Cost is used for it"]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"id": i, "modalities": ["text"], "num_tokens": 20 + i}) + "\n"
                             for i in range(24)))
    _, notes = tune_pipeline(VLM, TuneOptions(overrides={}, devices=3, costs=path, memory_gb=1.0,
                                              trace_in=str(trace)))
    assert any("no measurement of vision (no sample in the dataset activates it)" in n
               and "memory is not checked against --memory-gb" in n for n in notes), notes


def test_run_and_plan_say_which_sections_keep_the_pipelines_cost(tmp_path):
    """Found in review: `maestro plan/run --costs` used the pipeline's Cost for a section the file
    has no measurement of without a word (only `tune` said so)."""
    from click.testing import CliRunner

    from maestro_flow.cli import main

    pipeline = _vlm()
    data = _cost_file(pipeline)
    data["unmeasured"] = {"vision": {"reason": "no sample in the dataset activates it",
                                     "profiled_with": data["sections"].pop("vision")["profiled_with"]}}
    result = CliRunner().invoke(main, ["plan", VLM, "--costs", _write(tmp_path, data)])
    assert result.exit_code == 0, result.output
    assert "note: --costs" in result.stderr and "no measurement of vision" in result.stderr, result.stderr


def test_a_bad_memory_figure_is_refused(tmp_path):
    for field, bad in (("memory_base_mb", "NaN"), ("memory_base_mb", -1e9), ("tp_share", 1.5), ("param_mb", "inf")):
        data = _cost_file(_vlm())
        data["sections"]["llm"][field] = bad
        with pytest.raises(PipelineError, match=rf"sections\.llm\.{field}: "):
            read_cost_file(_write(tmp_path, data))


def test_a_cost_file_of_another_pipeline_is_refused(tmp_path):
    # Found in review: only section names were compared, so vlm's costs (sections vision, llm)
    # applied to pipelines/multimodal.py without a word.
    path = _write(tmp_path, _cost_file(_vlm(), pipeline="other"))
    with pytest.raises(PipelineError, match="measured on pipeline 'other', not 'vlm'"):
        file_overrides(_vlm(), path)


def test_the_cost_per_message_is_read_and_optional(tmp_path):
    """message_s (a worker's own time per tensor message it receives) came after version 2's
    first files: a file without it reads as 0, one with it keeps it, a bad one is refused."""
    data = _cost_file(_vlm())
    assert read_cost_file(_write(tmp_path, data))[1]["llm"].message_s == 0.0
    data["sections"]["llm"]["message_s"] = 3e-4
    assert read_cost_file(_write(tmp_path, data))[1]["llm"].message_s == 3e-4
    data["sections"]["llm"]["message_s"] = -1.0
    with pytest.raises(PipelineError, match=r"sections\.llm\.message_s: "):
        read_cost_file(_write(tmp_path, data))


def test_padded_survives_a_cost_file(tmp_path):
    data = _cost_file(_vlm())
    data["sections"]["llm"]["cost"]["padded"] = True
    assert read_cost_file(_write(tmp_path, data))[1]["llm"].cost.padded is True


# -- findings 5, 6: the file appears whole or not at all, and a bad --out is found first ----------


def test_a_staged_file_appears_only_when_its_block_succeeds(tmp_path):
    out = tmp_path / "sub" / "costs.json"
    with pytest.raises(RuntimeError, match="calibration failed"), staged(str(out)) as tmp:
        open(tmp, "w").write("uncalibrated")
        raise RuntimeError("calibration failed")
    assert not out.exists() and os.listdir(out.parent) == []  # no file, and no partial one
    with staged(str(out)) as tmp:
        open(tmp, "w").write("calibrated")
    assert out.read_text() == "calibrated" and os.listdir(out.parent) == ["costs.json"]


def test_an_unusable_out_is_refused_before_any_work(tmp_path):
    from click.testing import CliRunner

    from maestro_flow.cli import main

    afile = tmp_path / "afile"
    afile.write_text("")
    result = CliRunner().invoke(main, ["profile", VLM, "--set", "data.path=/nonexistent.arrow",
                                       "--out", str(afile / "costs.json")])
    assert result.exit_code == 2, result.output
    assert f"error: --out {afile / 'costs.json'}: {afile} is a file, not a folder" in result.output


def test_the_default_out_checked_before_any_work_is_the_file_written(tmp_path, monkeypatch):
    """Found in QA: runs/costs.json was checked, and runs/costs-NAME.json failed after the work."""
    from click.testing import CliRunner

    from maestro_flow.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "costs-vlm.json").mkdir(parents=True)
    result = CliRunner().invoke(main, ["profile", VLM, "--set", "data.path=/nonexistent.arrow"])
    assert result.exit_code == 2, result.output
    assert "error: --out runs/costs-vlm.json: is a folder; give a file path" in result.output


# -- finding 3: a failure names its section; MAESTRO_WORKER_THREADS ---------------------------------


def test_bad_worker_threads_are_refused_naming_the_variable(monkeypatch):
    from click.testing import CliRunner

    from maestro_flow.cli import main

    monkeypatch.setenv("MAESTRO_WORKER_THREADS", "two")
    result = CliRunner().invoke(main, ["profile", VLM, "--set", "data.path=/nonexistent.arrow"])
    assert result.exit_code == 2, result.output
    assert "error: MAESTRO_WORKER_THREADS must be a whole number of torch threads" in result.output
    assert "'two'" in result.output and "Traceback" not in result.output


def test_a_profiling_error_is_one_line_naming_section_phase_and_cause():
    from maestro_flow.runtime.profiling import ProfilingError

    tb = ("Traceback (most recent call last):\n  File \"stages/vision.py\", line 188, in _pixels\n"
          "ValueError: sample 3: cannot decode image: not a PNG/JPEG\n")
    exc = ProfilingError(section="vision", phase="forward at micro-batch 4", traceback=tb)
    assert str(exc) == ("profiling failed in section 'vision' during forward at micro-batch 4: "
                        "ValueError: sample 3: cannot decode image: not a PNG/JPEG")
    assert exc.traceback == tb
    noted = ProfilingError(section="vision", phase="forward", traceback=tb + "a note\n")  # Exception.add_note
    assert str(noted).endswith("ValueError: sample 3: cannot decode image: not a PNG/JPEG; a note")
    # found in review: a message's own indented lines were taken for a frame's
    tb = ('Traceback (most recent call last):\n  File "s.py", line 3, in forward\n    check(x)\n    ^^^^^^^^\n'
          "ValueError: shape mismatch:\n  expected [4, 8]\n  got [4, 9]\n")
    assert str(ProfilingError(section="llm", phase="forward", traceback=tb)).endswith(
        "forward: ValueError: shape mismatch:; expected [4, 8]; got [4, 9]")


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from loaders.demo import build_image_demo

    out = tmp_path_factory.mktemp("vlm")
    good = build_image_demo(out, num_samples=24, image_share=0.5)
    table = ipc.open_file(pa.memory_map(str(good))).read_all()
    images = [b"this is not an image" if x is not None else None for x in table.column("image").to_pylist()]
    columns = {n: table.column(n) for n in table.column_names}
    columns["image"] = pa.array(images, type=table.schema.field("image").type)
    corrupt = out / "corrupt.arrow"
    with ipc.new_file(str(corrupt), table.schema) as w:
        w.write_table(pa.table(columns, schema=table.schema))
    return {"good": str(good), "corrupt": str(corrupt)}


def _profile_here(data: str) -> list:
    from maestro_flow.runtime.profiling import ProfileOptions, profile_to

    messages: list = []
    profile_to(messages.append, VLM, ProfileOptions(overrides={"data.path": data}, sizes=(1,), repeats=1,
                                                    calibrate_steps=0, threads=1), cores=5)
    return messages


@pytest.mark.timeout(120)
def test_a_stage_error_while_profiling_names_the_section_and_phase(tiny_vlm):
    """A corrupt image in the vision encoder's rows: the worker reports the section, what it was
    doing and the traceback as text (profile_to is the worker's body, run here in-process)."""
    from maestro_flow.runtime.profiling import ProfilingError

    kind, body = _profile_here(tiny_vlm["corrupt"])[-1]
    assert kind == "error" and body["section"] == "vision" and "micro-batch" in body["phase"]
    message = str(ProfilingError(**body))
    assert message.startswith("profiling failed in section 'vision' during forward")
    assert "cannot decode image" in message and "\n" not in message
    assert "Traceback (most recent call last)" in body["traceback"]


@pytest.mark.timeout(120)
def test_a_profile_records_what_it_measured_and_the_machine_cores(tiny_vlm):
    """The cost file's data: every section's `profiled_with`, and machine.cores as given (the
    worker passes its cores before it pins itself to one: before, always 1)."""
    kind, data = _profile_here(tiny_vlm["good"])[-1]
    assert kind == "ok", data
    assert data["machine"]["cores"] == 5 and data["machine"]["torch_threads"] == 1
    pipeline = _vlm(**{"data.path": tiny_vlm["good"]})
    for s in pipeline.sections:
        assert data["sections"][s.name]["profiled_with"] == profiled_with(pipeline, s)
    assert data["unmeasured"] == {}


def test_profile_prints_no_backward_factor_for_a_frozen_section():
    """Found in QA: `maestro profile` printed backward_factor=2 for the frozen teacher, the Cost
    default and not a measurement (it has no backward). Memory is in MiB, as counted."""
    from maestro_flow.cli_tools import profile_line

    body = {"cost": {"per_sample_s": 1e-3, "per_token_s": 0.0, "backward_factor": 2.0, "padded": True},
            "micro_batch_overhead_s": 1e-3, "runtime_overhead_s": 2e-4, "step_overhead_s": 0.0,
            "memory_base_mb": 12.0, "peak_memory_mb_per_sample": 0.5, "profiled_with": {"trainable": False}}
    frozen = profile_line("teacher", body)
    assert frozen.startswith("teacher: per_sample_s=0.001, padded; overhead/micro-batch 1.00 ms")
    assert "backward_factor" not in frozen and frozen.endswith("memory 12 MiB + 0.5 MiB/sample")
    trained = profile_line("student", {**body, "profiled_with": {"trainable": True}, "step_overhead_s": 3e-3})
    assert "backward_factor=2" in trained and "optimizer step 3.00 ms" in trained


# -- finding 7 ------------------------------------------------------------------------------------


def test_calibrate_steps_help_counts_the_warm_up_steps():
    """The calibration run is WARMUP_STEPS + --calibrate-steps steps (calibration.calibrate)."""
    import inspect

    from click.testing import CliRunner

    from maestro_flow.cli import main
    from maestro_flow.runtime.calibration import WARMUP_STEPS, calibrate

    assert inspect.signature(calibrate).parameters["warmup"].default == WARMUP_STEPS
    text = " ".join(CliRunner().invoke(main, ["profile", "--help"]).output.split())
    assert f"it runs {WARMUP_STEPS} warm-up steps more, not measured" in text


def test_profile_says_how_far_a_long_size_got(monkeypatch):
    """Found in QA: `maestro profile --sizes 100000` measured for minutes with no line inside a
    size. A size whose micro-batches take longer than PROGRESS_S says how many are measured."""
    import time

    from maestro_flow.runtime import profiling

    monkeypatch.setattr(profiling, "_measure", lambda sec, mb, outputs, repeats: time.sleep(0.03) or {"n": len(mb)})
    said = []
    rows = profiling._measure_size("teacher", None, [[1, 2]] * 4, {}, 1, said.append, progress_s=0.02)
    assert rows == [{"n": 2}] * 4
    assert said == [f"teacher: micro-batch 2: {i} of 4 measured" for i in (1, 2, 3)]  # not after the last
    quiet = []
    profiling._measure_size("teacher", None, [[1]] * 3, {}, 1, quiet.append, progress_s=60)
    assert quiet == []
