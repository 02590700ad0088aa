"""`maestro stage PIPELINE SECTION`: one section alone, on recorded or synthetic inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from maestro_flow.cli_stage import stage
from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.record import load_micro_batches, record_dir, save_micro_batch, save_weights
from maestro_flow.runtime.replay import SectionRunner, synthetic_batches

ROOT = Path(__file__).resolve().parents[2]
DISTILL = str(ROOT / "pipelines" / "distill.py")
VLM = str(ROOT / "pipelines" / "vlm.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    from loaders.demo import build_image_demo, build_text_demo

    out = tmp_path_factory.mktemp("stage-demo")
    return {"text": str(build_text_demo(out, num_samples=64, parquet=False)),
            "vlm": str(build_image_demo(out, num_samples=48, image_share=0.4))}


def _invoke(*args: str):
    return CliRunner().invoke(stage, list(args), catch_exceptions=False)


def _fake_recording(pipeline_file: str, section: str, run_dir: Path, overrides: dict, samples: int) -> int:
    """What `maestro run --record SECTION` writes, made here by running the section itself."""
    pipeline, _ = load_pipeline(pipeline_file, overrides)
    runner = SectionRunner(pipeline, section)
    batches = synthetic_batches(pipeline, section, samples)
    for i, batch in enumerate(batches):
        batch.step, batch.index = i // 2, i % 2
        if batch.index == 0 and runner.trainable:  # a step's weights, as an unsharded section's run records them
            save_weights(record_dir(str(run_dir), section, 0), batch.step, runner.stage)
        prepared, _ = runner.prepare(batch)  # inputs as the executor hands them (grad leaves)
        out = runner.run(batch).outputs
        save_micro_batch(record_dir(str(run_dir), section, 0), prepared, out)
    return len(batches)


@pytest.mark.timeout(120)
def test_replay_compare_matches_then_detects_perturbation(data, tmp_path):
    sets = ["--set", f"data.path={data['text']}"]
    n = _fake_recording(DISTILL, "student", tmp_path, {"data.path": data["text"]}, samples=5)
    assert n == 3
    result = _invoke(DISTILL, "student", "--replay", str(tmp_path), "--compare", "--repeat", "2", *sets)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "inputs: recorded in" in out and "3 micro-batch(es), step(s) 0, 1" in out
    assert "input  hidden" in out and "output loss" in out and "backward of loss" in out
    assert "(this micro-batch alone, unscaled: a run's grad_norm is its whole step's" in out
    assert "compare loss" in out and "MISMATCH" not in out
    assert "all outputs match the recording" in out and "median of 2" in out

    only = _invoke(DISTILL, "student", "--replay", str(tmp_path), "--steps", "1", "--compare", *sets)
    assert only.exit_code == 0 and "step 0 micro-batch" not in only.output and "step 1 micro-batch 0" in only.output

    # Perturb one recorded loss: compare must fail with exit 1 and name the output.
    folder = record_dir(str(tmp_path), "student", 0)
    batch, outputs = load_micro_batches(folder)[0]
    outputs["loss"] = outputs["loss"] + 1.0
    save_micro_batch(folder, batch, outputs)
    bad = _invoke(DISTILL, "student", "--replay", str(tmp_path), "--compare", *sets)
    assert bad.exit_code == 1, bad.output
    assert "MISMATCH" in bad.output and "1 output(s) differ" in bad.output


@pytest.mark.timeout(120)
def test_replay_errors_are_one_line(data, tmp_path):
    sets = ["--set", f"data.path={data['text']}"]
    missing = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path), *sets])
    assert missing.exit_code == 2 and "error: --replay: no recording of section 'student'" in missing.output
    assert "Traceback" not in missing.output
    unknown = CliRunner().invoke(stage, [DISTILL, "nope", *sets])
    assert unknown.exit_code == 2 and "error: no section named 'nope'" in unknown.output
    no_rec = CliRunner().invoke(stage, [DISTILL, "student", "--compare", *sets])
    assert no_rec.exit_code == 2 and "--compare needs --replay" in no_rec.output


@pytest.mark.timeout(120)
def test_unreadable_weights_and_recordings_are_one_line_errors(data, tmp_path):
    # Found in review: a traceback and "section raised ... rerun with --pdb" (exit 3) instead.
    from safetensors.torch import save_file

    sets = ["--set", f"data.path={data['text']}"]
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    junk = CliRunner().invoke(stage, [DISTILL, "student", "--weights", str(tmp_path / "junk.safetensors"), *sets])
    assert junk.exit_code == 2 and "--weights" in junk.output and "not a readable safetensors file" in junk.output
    pipeline, _ = load_pipeline(DISTILL, {"data.path": data["text"]})
    own = SectionRunner(pipeline, "student").stage.state_dict()
    save_file({k: torch.zeros(*(d + 1 for d in v.shape)) for k, v in own.items()}, str(tmp_path / "big.safetensors"))
    big = CliRunner().invoke(stage, [DISTILL, "student", "--weights", str(tmp_path / "big.safetensors"), *sets])
    assert big.exit_code == 2 and "does not fit section 'student'" in big.output, big.output
    _fake_recording(DISTILL, "student", tmp_path / "run", {"data.path": data["text"]}, samples=2)
    folder = record_dir(str(tmp_path / "run"), "student", 0)
    batch, outputs = load_micro_batches(folder)[0]
    save_micro_batch(folder, batch, outputs)
    path = next(p for p in Path(folder).iterdir() if p.name.endswith(".safetensors") and "weights" not in p.name)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, "format": '"maestro-record/99"'})
    newer = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path / "run"), *sets])
    assert newer.exit_code == 2 and "a recording of format 'maestro-record/99'" in newer.output, newer.output
    assert "Traceback" not in junk.output + big.output + newer.output


@pytest.mark.timeout(120)
def test_synthetic_llm_inputs_come_from_the_vision_section(data):
    result = _invoke(VLM, "llm", "--set", f"data.path={data['vlm']}", "--samples", "4")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "inputs: synthetic" in out
    assert "computed by section 'vision'" in out
    assert "input  image_embeds" in out and "None)" in out  # image samples get embeddings, text ones None
    assert "output loss" in out and "input grad image_embeds" in out


@pytest.mark.timeout(120)
def test_synthetic_vision_and_random_inputs(data):
    vision = _invoke(VLM, "vision", "--set", f"data.path={data['vlm']}", "--samples", "2")
    assert vision.exit_code == 0, vision.output
    assert "column image" in vision.output and "output image_embeds" in vision.output
    assert "backward of sum of outputs' squares / 2" in vision.output
    rand = _invoke(VLM, "llm", "--set", f"data.path={data['vlm']}", "--input-shape", "image_embeds=36x64")
    assert rand.exit_code == 0, rand.output
    assert "random normal" in rand.output and "computed by section" not in rand.output
    # Found in review: a teacher's hidden states are [tokens, d] per sample, which no fixed shape fits
    # (the help's own example, hidden=32x128, failed): T is each sample's token count.
    hidden = _invoke(DISTILL, "student", "--set", f"data.path={data['text']}", "--samples", "2",
                     "--input-shape", "hidden=Tx128")
    assert hidden.exit_code == 0, hidden.output
    assert "random normal, per-sample shape hidden=Tx128" in hidden.output
    bad = CliRunner().invoke(stage, [DISTILL, "student", "--input-shape", "hidden=Qx128"])
    assert bad.exit_code == 2 and "e.g. hidden=Tx128), got 'hidden=Qx128'" in bad.output


FAKE_STAGE = '''
import torch
from maestro_flow.stage import Stage


class _Tiny(Stage):
    @classmethod
    def outputs(cls, config):
        return ("loss",)

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.lin = torch.nn.Linear(2, 2)
        self.draws = []


class Exploding(_Tiny):
    def forward(self, batch):
        raise FloatingPointError("boom in forward")


class Drawing(_Tiny):
    """Returns a random number each forward (as dropout draws masks) and keeps what it drew."""

    def forward(self, batch):
        draw = torch.rand(())
        self.draws.append(float(draw))
        return {"loss": self.lin.weight.sum() * 0 + draw}
'''

FAKE_PIPELINE = '''
from maestro_flow import ArrowData, Pipeline, Section


def pipeline(**overrides):
    return Pipeline(name="fake", data=ArrowData(path={path!r}), global_batch=2, steps=1,
                    sections=[Section(name="boom", stage="replay_fake_stage:Exploding", micro_batch=2)]
                    ).override(**overrides)
'''


@pytest.mark.timeout(120)
def test_pdb_post_mortem_on_stage_exception(data, tmp_path, monkeypatch):
    import pdb

    (tmp_path / "replay_fake_stage.py").write_text(FAKE_STAGE)
    (tmp_path / "fake.py").write_text(FAKE_PIPELINE.format(path=data["text"]))
    seen = []
    monkeypatch.setattr(pdb, "post_mortem", lambda tb=None: seen.append(tb))
    result = CliRunner().invoke(stage, [str(tmp_path / "fake.py"), "boom", "--pdb"])
    assert result.exit_code == 3, result.output
    assert len(seen) == 1 and seen[0] is not None
    frames = []
    tb = seen[0]
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "forward"  # the debugger opens where the stage raised
    assert "FloatingPointError: boom in forward" in result.output
    assert "rerun with --pdb" not in result.output  # found in QA: said after the --pdb session too

    seen.clear()
    plain = CliRunner().invoke(stage, [str(tmp_path / "fake.py"), "boom"])
    assert plain.exit_code == 3 and not seen and "rerun with --pdb" in plain.output


def test_stage_registered_in_main_cli():
    from maestro_flow.cli import main

    if "stage" not in main.commands:
        pytest.skip("cli.py does not register `stage` yet")
    result = CliRunner().invoke(main, ["stage", "--help"])
    assert result.exit_code == 0 and "--replay RUN_DIR" in result.output


def test_runner_inputs_are_grad_leaves(data):
    pipeline, _ = load_pipeline(VLM, {"data.path": data["vlm"]})
    runner = SectionRunner(pipeline, "llm")
    [batch] = synthetic_batches(pipeline, "llm", 4)
    prepared, leaves = runner.prepare(batch)
    assert leaves and all(t.requires_grad and t.is_leaf for t in leaves.values())
    assert all(t is None or not t.requires_grad for t in batch.inputs["image_embeds"])
    assert isinstance(prepared.inputs["image_embeds"][0], (torch.Tensor, type(None)))


def _replicated_recording(run_dir: Path, data: str, num_replicas: int = 2) -> None:
    """A recording of the distill student by `num_replicas` replicas, two micro-batches each at
    steps 0 and 1, with each replica's weights of both steps (as `maestro run --record` writes)."""
    from maestro_flow.runtime.record import save_weights

    pipeline, _ = load_pipeline(DISTILL, {"data.path": data})
    runner = SectionRunner(pipeline, "student")
    batches = synthetic_batches(pipeline, "student", 4)
    for replica in range(num_replicas):
        folder = record_dir(str(run_dir), "student", replica)
        for step in (0, 1):
            save_weights(folder, step, runner.stage)
            for index, batch in enumerate(batches[:2]):
                batch.step, batch.index = step, index
                prepared, _ = runner.prepare(batch)
                save_micro_batch(folder, prepared, runner.run(batch).outputs)


@pytest.mark.timeout(120)
def test_replicas_replay_one_after_the_other_and_say_which(data, tmp_path, monkeypatch):
    """Found in review: micro-batches were ordered (step, index, replica), so with two replicas
    the weights file was reloaded before every micro-batch, and the headers did not say which
    replica ("step 0 micro-batch 0" twice)."""
    _replicated_recording(tmp_path, data["text"])
    loads = []
    real = SectionRunner.load_weights
    monkeypatch.setattr(SectionRunner, "load_weights", lambda self, path, *a, **k: (loads.append(path),
                                                                                    real(self, path, *a, **k))[1])
    # Found in QA: the stage's ctx.replica was 0 for every replica's micro-batches.
    seen, real_run = [], SectionRunner.run
    monkeypatch.setattr(SectionRunner, "run", lambda self, batch, *a, **k: (seen.append(self.stage.ctx.replica),
                                                                           real_run(self, batch, *a, **k))[1])
    result = _invoke(DISTILL, "student", "--replay", str(tmp_path), "--compare", "--set", f"data.path={data['text']}")
    assert result.exit_code == 0, result.output
    headers = [line.split(":")[0] for line in result.output.splitlines() if line.startswith("step ")]
    assert headers == [f"step {s} micro-batch {i} (replica {r})" for s in (0, 1) for r in (0, 1) for i in (0, 1)]
    assert [Path(p).parent.name for p in loads] == ["student-0", "student-1", "student-0", "student-1"]
    assert seen == [r for s in (0, 1) for r in (0, 1) for i in (0, 1)]
    seen.clear()
    one = _invoke(DISTILL, "student", "--replay", str(tmp_path), "--replica", "1", "--set", f"data.path={data['text']}")
    assert one.exit_code == 0 and seen == [1, 1, 1, 1], (seen, one.output)


@pytest.mark.timeout(120)
def test_flags_that_do_not_apply_are_refused(data, tmp_path):
    """Found in review: --steps/--replica without --replay, and an --input-shape for a tensor the
    section does not receive (image_embed for image_embeds), were ignored: rc 0."""
    text, vlm = ["--set", f"data.path={data['text']}"], ["--set", f"data.path={data['vlm']}"]
    steps = CliRunner().invoke(stage, [DISTILL, "student", "--steps", "1", *text])
    assert steps.exit_code == 2 and "error: --steps needs --replay RUN_DIR" in steps.output, steps.output
    replica = CliRunner().invoke(stage, [DISTILL, "student", "--replica", "1", *text])
    assert replica.exit_code == 2 and "--replica needs --replay" in replica.output, replica.output
    shape = CliRunner().invoke(stage, [VLM, "llm", "--samples", "4", "--input-shape", "image_embed=36x64", *vlm])
    assert shape.exit_code == 2, shape.output
    assert "--input-shape image_embed: section 'llm' has no such input (its inputs are image_embeds)" in shape.output
    # Found in QA: a width other than the one the stage reads failed deep in torch, with a traceback.
    wide = CliRunner().invoke(stage, [DISTILL, "student", "--input-shape", "hidden=Tx64", *text])
    assert wide.exit_code == 2, wide.output
    assert ("--input-shape hidden=Tx64: section 'student' reads hidden 128 wide (sections.student.config.teacher."
            "d_model); give Tx128") in wide.output, wide.output
    # Found in QA: a shape of the wrong rank raised in the stage, with no word on the random inputs.
    rank = CliRunner().invoke(stage, [DISTILL, "student", "--samples", "1", "--input-shape", "hidden=128", *text])
    assert rank.exit_code == 3, rank.output
    assert ("teacher 'hidden' must be [" in rank.output and "(on random inputs, --input-shape hidden=128: only their "
            "last dimension is checked, against the width a stage declares with input_widths, and never their number "
            "of dimensions)") in rank.output
    # Found in QA: a sharded section ran whole here without a word.
    whole = CliRunner().invoke(stage, [DISTILL, "student", "--samples", "1", "--set", "sections.student.tp=2", *text])
    assert whole.exit_code == 0 and ("layout: a run shards this section (tp=2); here it runs whole, in one process"
                                     in whole.output), whole.output
    _fake_recording(DISTILL, "student", tmp_path, {"data.path": data["text"]}, samples=2)
    samples = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path), "--samples", "4", *text])
    assert samples.exit_code == 2 and "--samples applies to synthetic inputs only" in samples.output
    assert "Traceback" not in steps.output + replica.output + shape.output + wide.output + samples.output


@pytest.mark.timeout(120)
def test_huge_step_range_selects_the_recorded_steps(data, tmp_path):
    """Found in review: `--steps 2-999999999` expanded the range in memory (MemoryError, exit 3
    blamed on the stage)."""
    _replicated_recording(tmp_path, data["text"], num_replicas=1)
    result = _invoke(DISTILL, "student", "--replay", str(tmp_path), "--steps", "1-999999999", "--compare",
                     "--set", f"data.path={data['text']}")
    assert result.exit_code == 0, result.output
    assert "step(s) 1\n" in result.output and "step 0 micro-batch" not in result.output
    none = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path), "--steps", "5-999999999",
                                      "--set", f"data.path={data['text']}"])
    assert none.exit_code == 2 and "--steps: none of 5-999999999 recorded" in none.output, none.output


@pytest.mark.timeout(120)
def test_corrupt_recorded_weights_are_not_blamed_on_weights_flag(data, tmp_path):
    """Found in review: "error: --weights .../weights-step000000.safetensors: not a readable
    safetensors file" though no --weights was given."""
    from maestro_flow.runtime.record import recorded_weights

    _replicated_recording(tmp_path, data["text"], num_replicas=1)
    path = recorded_weights(record_dir(str(tmp_path), "student", 0), 0)
    Path(path).write_bytes(b"truncated")
    result = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path), "--set",
                                        f"data.path={data['text']}"])
    assert result.exit_code == 2, result.output
    assert f"error: recorded weights of step 0 ({path}): not a readable safetensors file" in result.output
    assert "--weights" not in result.output and "Traceback" not in result.output
    # found in QA: a checkpoint folder as --weights got click's "is a directory" and no way on
    result = CliRunner().invoke(stage, [DISTILL, "student", "--weights", str(tmp_path), "--set",
                                        f"data.path={data['text']}"])
    assert result.exit_code == 2, result.output
    assert f"error: --weights {tmp_path}: a folder, not a weights file: for a checkpoint, `maestro export {tmp_path} " \
           "--section student -o OUT` writes OUT/student.safetensors" in result.output, result.output


@pytest.mark.timeout(120)
def test_a_recorded_failure_that_raises_again_does_not_stop_the_replay(data, tmp_path):
    """Found in review: the micro-batch a run failed on, raising again in the replay, ended it:
    the micro-batches after it were never replayed, nor the --compare summary printed."""
    overrides = {"data.path": data["text"]}
    n = _fake_recording(DISTILL, "student", tmp_path, overrides, samples=8)
    folder = Path(record_dir(str(tmp_path), "student", 0))
    first = sorted(folder.glob("step*-mb*.safetensors"))[0]
    batch, outputs = load_micro_batches(str(folder))[0]
    batch.inputs["hidden"] = [h[:, :3] for h in batch.inputs["hidden"]]  # a shape its forward refuses
    save_micro_batch(str(folder), batch, {}, failed="forward")
    assert first.exists()
    result = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path), "--compare", "--set",
                                        f"data.path={data['text']}"])
    assert result.exit_code == 3, result.output
    assert sum(line.startswith("step ") for line in result.output.splitlines()) == n
    assert "raised as the run did: " in result.output
    assert "replay: 1 micro-batch(es) raised as the run did" in result.output
    assert "compare: all outputs match the recording" in result.output  # the others', compared


@pytest.mark.timeout(120)
def test_a_micro_batch_with_a_column_recorded_as_text_is_refused(data, tmp_path):
    """Found in review: a column value recorded as text only (not JSON-able) reached the stage as
    a string, which raised: exit 3, blamed on the stage."""
    _fake_recording(DISTILL, "student", tmp_path, {"data.path": data["text"]}, samples=2)
    folder = record_dir(str(tmp_path), "student", 0)
    [(batch, outputs)] = load_micro_batches(folder)
    column = "tokens"  # one the stage reads
    batch.columns[column][1] = {"not": torch.zeros(2)}  # kept as its repr only
    save_micro_batch(folder, batch, outputs)
    result = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path), "--set",
                                        f"data.path={data['text']}"])
    assert result.exit_code == 2, result.output
    assert "error: --replay: cannot replay step 0 micro-batch 0 of replica 0" in result.output
    assert f"column {column!r} of sample {batch.sample_ids[1]} was recorded as text only" in result.output
    assert "Traceback" not in result.output


@pytest.mark.timeout(120)
def test_every_repetition_starts_from_the_recorded_rng(data, tmp_path, monkeypatch):
    """`SectionRunner.run(batch, repeat, rng)`: each forward of the `repeat` draws what the run's
    forward drew from the recorded RNG states."""
    from maestro_flow.runtime.record import rng_states

    (tmp_path / "replay_fake_stage.py").write_text(FAKE_STAGE)
    (tmp_path / "drawing.py").write_text(FAKE_PIPELINE.format(path=data["text"]).replace(
        "replay_fake_stage:Exploding", "replay_fake_stage:Drawing"))
    monkeypatch.syspath_prepend(str(tmp_path))
    pipeline, _ = load_pipeline(str(tmp_path / "drawing.py"), {})
    runner = SectionRunner(pipeline, "boom")
    [batch] = synthetic_batches(pipeline, "boom", 2)
    states = rng_states(runner.device)
    expected = float(torch.rand(()))  # what a forward starting from `states` draws
    result = runner.run(batch, 3, rng=states)
    assert runner.stage.draws == [expected] * 3
    assert float(result.outputs["loss"]) == expected


@pytest.mark.timeout(240)
def test_a_run_with_dropout_replays_to_its_recorded_outputs(demo_data, tmp_path):
    """Found in review: the replay ran the forward from whatever RNG state it had, so a student
    with dropout never reproduced the run's loss (--compare: MISMATCH). The recording keeps the
    RNG states taken before each forward; the replay restores them before every repetition."""
    from tests.integration.conftest import maestro

    sets = ["--set", f"data.path={demo_data}", "--set", "sections.student.config.student.dropout=0.1"]
    run = maestro("run", DISTILL, "--colocated", "--quiet", "--steps", "2", "--record", "student",
                  "--record-steps", "1", "--run-dir", str(tmp_path), *sets, timeout=200)
    assert run.returncode == 0, run.stderr
    replay = maestro("stage", DISTILL, "student", "--replay", str(tmp_path), "--compare", "--repeat", "2", *sets)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "random state: as recorded before each forward" in replay.stdout
    assert "MISMATCH" not in replay.stdout and "all outputs match the recording" in replay.stdout


@pytest.mark.timeout(120)
def test_a_step_without_its_recorded_weights_is_refused(data, tmp_path):
    """Found in review: step 1 replayed with step 0's weights (nothing said so), and --compare
    then blamed the stage for the difference."""
    from maestro_flow.runtime.record import recorded_weights

    _replicated_recording(tmp_path, data["text"], num_replicas=1)
    Path(recorded_weights(record_dir(str(tmp_path), "student", 0), 1)).unlink()
    sets = ["--set", f"data.path={data['text']}"]
    result = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path), "--compare", *sets])
    assert result.exit_code == 2, result.output
    assert "the recording holds no weights for step(s) 1 (weights-step000001.safetensors missing)" in result.output
    only = _invoke(DISTILL, "student", "--replay", str(tmp_path), "--steps", "0", "--compare", *sets)
    assert only.exit_code == 0, only.output


@pytest.mark.parametrize("flags, message", [
    (["--compare", "--atol", "-1"], "Invalid value for '--atol': must be a finite number >= 0, got -1.0"),
    (["--compare", "--rtol", "nan"], "Invalid value for '--rtol': must be a finite number >= 0, got nan"),
    (["--atol", "0.1"], "--atol set --compare's tolerance: add --compare"),
])
def test_tolerances_are_checked(data, tmp_path, flags, message):
    """Found in review: a negative or NaN tolerance made identical outputs a mismatch (exit 1),
    and one given without --compare was ignored."""
    result = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(tmp_path), *flags,
                                        "--set", f"data.path={data['text']}"])
    assert result.exit_code == 2 and message in result.output, result.output


def test_synthetic_inputs_too_large_to_make_are_bad_input_not_the_stages(data):
    """Found in review: the allocation failed before the stage ran, and was reported as the stage
    raising (exit 3, "rerun with --pdb")."""
    result = CliRunner().invoke(stage, [DISTILL, "student", "--input-shape", "hidden=999999999999x128",
                                        "--set", f"data.path={data['text']}"])
    assert result.exit_code == 2, result.output
    assert "error: --input-shape hidden=999999999999x128: cannot make 2 such tensor(s) (RuntimeError" in result.output
    assert "--pdb" not in result.output


def test_a_recording_folder_given_to_replay_points_to_the_run_folder(data, tmp_path):
    """Found in review: --replay RUN_DIR/record failed with "no recording ... in RUN_DIR/record/record"."""
    _replicated_recording(tmp_path, data["text"], num_replicas=1)
    for given in (tmp_path / "record", tmp_path / "record" / "student-0"):
        result = CliRunner().invoke(stage, [DISTILL, "student", "--replay", str(given),
                                            "--set", f"data.path={data['text']}"])
        assert result.exit_code == 2, result.output
        assert f"error: --replay takes the run folder, not its recording: --replay {tmp_path}" in result.output


@pytest.mark.timeout(120)
def test_a_reader_that_stops_early_is_not_the_stages_error(data):
    """Found in review: `maestro stage ... | head -2` exited 3, 'section raised BrokenPipeError'."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "maestro_flow.cli", "stage", DISTILL, "student", "--samples", "2",
                             "--set", f"data.path={data['text']}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().startswith(b"section student")
        proc.stdout.close()  # as head does once it has its lines
        _, err = proc.communicate(timeout=100)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"BrokenPipeError" not in err and b"error:" not in err
