"""`maestro run --record SECTION` end to end: what a real run records replays to the run's own
outputs (`maestro stage --replay --compare`), and a sharded section records without failing."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from tests.integration.conftest import maestro

ROOT = Path(__file__).resolve().parents[2]
STATEFUL = str(ROOT / "tests" / "integration" / "assets" / "stateful.py")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_a_recorded_step_replays_to_what_the_run_computed(demo_data, tmp_path, dropout):
    """Step 1 of a stage whose forward changes a buffer (and, with dropout, draws random numbers).
    Before: the weights were saved after micro-batch 0's forward (the buffer one call ahead), and
    no RNG state was kept, so --compare said MISMATCH on a correct stage."""
    sets = ["--set", f"data.path={demo_data}", "--set", f"sections.counter.config.dropout={dropout}"]
    run = maestro("run", STATEFUL, "--colocated", "--quiet", "--record", "counter", "--record-steps", "1",
                  "--run-dir", str(tmp_path), *sets)
    assert run.returncode == 0, run.stderr
    folder = tmp_path / "record" / "counter-0"
    with safe_open(str(folder / "weights-step000001.safetensors"), framework="pt") as f:
        assert f.get_tensor("emb.calls").item() == 2  # the two forwards of step 0, none of step 1's
    with safe_open(str(folder / "step000001-mb0000.safetensors"), framework="pt") as f:
        assert "rng/cpu" in f.keys()
    replay = maestro("stage", STATEFUL, "counter", "--replay", str(tmp_path), "--compare", *sets)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "MISMATCH" not in replay.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("section", "layout", "replicas"), [
    ("student", ("sections.student.fsdp=true",), 2),
    ("student", ("sections.student.tp=2", "sections.student.dp=1"), 1),
    ("teacher", ("sections.teacher.fsdp=true", "sections.teacher.dp=2"), 2),  # lockstep: gathers per micro-batch
])
def test_a_sharded_section_records_its_micro_batches_without_weights(demo_data, tmp_path, section, layout, replicas):
    """FSDP (the teacher's in lockstep) and tensor-parallel sections: the run records and ends
    well (it died before: their state_dict is sharded, which the weights file cannot hold). They
    record no weights (a replay takes --weights); a tensor-parallel replica is recorded by its
    leader alone."""
    sets = [a for item in layout for a in ("--set", item)]
    run = maestro("run", "pipelines/distill.py", "--steps", "2", "--quiet", "--record", section,
                  "--record-steps", "1", "--run-dir", str(tmp_path), "--set", f"data.path={demo_data}", *sets,
                  timeout=240)
    assert run.returncode == 0, run.stderr
    folders = sorted((tmp_path / "record").iterdir())
    assert [f.name for f in folders] == [f"{section}-{r}" for r in range(replicas)]
    for folder in folders:
        files = sorted(p.name for p in folder.iterdir())
        assert files and all(f.startswith("step000001-mb") for f in files), files
    if section == "teacher":  # frozen: the weights it is built with are the run's (found in QA: told to export them)
        replay = maestro("stage", "pipelines/distill.py", "teacher", "--replay", str(tmp_path), "--compare",
                         "--set", f"data.path={demo_data}", *sets)
        assert replay.returncode == 0 and "MISMATCH" not in replay.stdout, replay.stdout + replay.stderr
        assert "weights: as built from the section's config (it is frozen" in replay.stdout + replay.stderr
    else:  # found in QA: nothing said the recording holds no weights, and --compare then differed on every step
        assert "note: --record student: a sharded section records no weights" in run.stderr, run.stderr
        replay = maestro("stage", "pipelines/distill.py", "student", "--replay", str(tmp_path), "--compare",
                         "--set", f"data.path={demo_data}", *sets)
        assert replay.returncode == 2, replay.stdout + replay.stderr
        assert "the recording holds no weights (a sharded section, fsdp or tp, records none), so step(s) 1 would " \
               "run with fresh weights" in replay.stderr, replay.stderr


@pytest.mark.timeout(300)
def test_a_sharded_sections_recording_replays_with_a_checkpoints_weights(demo_data, tmp_path):
    """What the replay says to do for a section recorded without weights: a checkpoint taken at
    the recorded step, exported whole, as --weights, and --compare matches. Before, the exported
    file lacked the student's frozen teacher head, which --weights required."""
    sets = ["--set", f"data.path={demo_data}", "--set", "sections.student.fsdp=true"]
    run = maestro("run", "pipelines/distill.py", "--steps", "2", "--quiet", "--record", "student",
                  "--record-steps", "1", "--run-dir", str(tmp_path / "run"), "--checkpoint-dir",
                  str(tmp_path / "ck"), "--checkpoint-every", "1", *sets, timeout=240)
    assert run.returncode == 0, run.stderr
    [step1] = [p for p in (tmp_path / "ck").iterdir() if p.name.endswith("1")]
    export = maestro("export", str(step1), "--section", "student", "-o", str(tmp_path / "ex"))
    assert export.returncode == 0, export.stderr
    replay = maestro("stage", "pipelines/distill.py", "student", "--replay", str(tmp_path / "run"), "--weights",
                     str(tmp_path / "ex" / "student.safetensors"), "--compare", *sets)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "MISMATCH" not in replay.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", ["forward", "prepare"])
def test_the_micro_batch_a_stage_fails_on_is_recorded_and_replays_to_its_error(demo_data, tmp_path, phase):
    """Found in QA: the recording lacked the very micro-batch the run died on (saved after the
    forward), and `stage --replay --compare` then said all outputs match; found in review: a
    failure in Stage.prepare (where the vision encoder decodes) was not recorded either. Replica 0
    fails, and its replay raises again (exit 3, after the replay of every other recorded
    micro-batch); so does replica 1, whose failure depends on its ctx.replica (found in QA: a
    replay gave the stage replica 0's, so it did not raise and --compare exited 1)."""
    faulty = str(ROOT / "tests" / "integration" / "assets" / "faulty.py")
    sets = ["--set", f"data.path={demo_data}", "--set", f"sections.student.config.fail={phase}",
            "--set", "sections.student.config.at_step=1"]
    for replica in (0, 1):
        run_dir = tmp_path / f"r{replica}"
        more = ["--set", f"sections.student.config.on_replica={replica}"]
        run = maestro("run", faulty, "--quiet", "--record", "student", "--run-dir", str(run_dir), *sets, *more,
                      timeout=180)
        assert run.returncode == 1 and "during forward at step 2" in run.stderr, run.stderr[-2000:]
        failing = run_dir / "record" / f"student-{replica}" / "step000001-mb0000.safetensors"
        with safe_open(str(failing), framework="pt") as f:
            assert f.metadata()["failed"] == '"forward"'
        replay = maestro("stage", faulty, "student", "--replay", str(run_dir), "--replica", str(replica),
                         "--steps", "1", "--compare", *sets, *more)
        out = replay.stdout + replay.stderr
        assert "the run's forward raised on this micro-batch (its step 2, counted from 1" in out, out
        assert replay.returncode == 3 and f"raised as the run did: ValueError: deliberate failure in {phase} at " \
            "step 1" in out, out
        if replica == 0:
            every = maestro("stage", faulty, "student", "--replay", str(run_dir), "--replica", "0", "--compare",
                            *sets, *more)
            files = len(list((run_dir / "record").glob("student-0/step*-mb*.safetensors")))
            assert every.returncode == 3, every.stdout + every.stderr
            assert sum(line.startswith("step ") for line in every.stdout.splitlines()) == files > 1, every.stdout
            assert "replay: 1 micro-batch(es) raised as the run did" in every.stdout
        else:  # what made the run fail not replayed (here: the fault moved to another replica): --compare exits 1
            moved = maestro("stage", faulty, "student", "--replay", str(run_dir), "--replica", "1", "--steps", "1",
                            "--compare", *sets, "--set", "sections.student.config.on_replica=0")
            out = moved.stdout + moved.stderr
            assert moved.returncode == 1, out
            assert "the replay's forward did not raise, the run's did" in out
            assert "replay: 1 micro-batch(es) the run failed on ran without error here" in out


@pytest.mark.timeout(240)
def test_a_backward_that_raises_in_a_section_that_is_not_the_loss_is_recorded_as_failed(demo_data, tmp_path):
    """Found in review: a non-loss section's micro-batch was recorded after its forward, as if it
    had passed, when its backward (run later, once the gradients came) raised."""
    plain = str(ROOT / "tests" / "integration" / "assets" / "plain.py")
    sets = ["--set", f"data.path={demo_data}", "--set", "sections.embed.config.fail_backward_at_step=1"]
    run = maestro("run", plain, "--quiet", "--record", "embed", "--run-dir", str(tmp_path), *sets, timeout=180)
    assert run.returncode == 1 and "section 'embed' replica 0 (rank 0) during backward at step 2" in run.stderr, \
        run.stderr[-2000:]
    with safe_open(str(tmp_path / "record" / "embed-0" / "step000001-mb0000.safetensors"), framework="pt") as f:
        assert f.metadata()["failed"] == '"backward"'
    replay = maestro("stage", plain, "embed", "--replay", str(tmp_path), "--steps", "1", *sets)
    out = replay.stdout + replay.stderr
    assert replay.returncode == 3 and "the run's backward raised on this micro-batch" in out, out
    assert "raised as the run did: ValueError: deliberate failure in backward" in out, out


@pytest.mark.timeout(240)
def test_recording_an_encoder_says_at_which_steps_no_sample_activated_it(tmp_path):
    """Found in QA: `--record vision` at steps without an image wrote nothing and said nothing,
    and `maestro stage --replay` then advised recording the section, as the user had. In file
    order at 4 samples a step, images sit in rows 5, 7 and 15: steps 1 and 3 record, 0 and 2 do not."""
    from loaders.demo import image_demo_table, write_arrow

    data = write_arrow(image_demo_table(num_samples=32, image_share=0.15, seed=1), tmp_path / "few.arrow")
    sets = ["--set", f"data.path={data}", "--set", "data.shuffle=false", "--set", "global_batch=4"]
    run = maestro("run", "pipelines/vlm.py", "--colocated", "--steps", "4", "--record", "vision",
                  "--run-dir", str(tmp_path / "run"), *sets, timeout=200)
    assert run.returncode == 0, run.stderr
    assert "note: --record vision: no sample activated it at steps 0, 2, so nothing was recorded there" in run.stderr
    files = sorted(p.name for p in (tmp_path / "run" / "record" / "vision-0").glob("step*.safetensors"))
    assert {f[:10] for f in files} == {"step000001", "step000003"}, files
    replay = maestro("stage", "pipelines/vlm.py", "vision", "--replay", str(tmp_path / "run"), "--steps", "0", *sets)
    assert replay.returncode == 2
    assert "none of 0 recorded for 'vision' (recorded steps: 1, 3; no sample activated it at step 0)" in replay.stderr
