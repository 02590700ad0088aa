"""What a checkpoint is on disk (checkpoint/manifest.py), the coordinator's bookkeeping of them
(checkpoint/checkpointer.py) and the RNG states (checkpoint/rng.py). No processes, no DCP."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from maestro_flow import ArrowData, Edge, Pipeline, PipelineError, Section
from maestro_flow.checkpoint import manifest as mf
from maestro_flow.checkpoint import rng
from maestro_flow.checkpoint.checkpointer import Checkpointer, CheckpointOptions, resume_point
from maestro_flow.errors import CheckpointError

PIPELINE = Pipeline(name="p", data=ArrowData(path="d"), global_batch=4,
                    sections=[Section(name="teacher", stage="m:T", trainable=False), Section(name="student", stage="m:S")],
                    edges=[Edge(src="teacher", dst="student", tensors=("h",))])
SAMPLER = {"step": 4, "epoch": 1, "batch_in_epoch": 1, "batches_per_epoch": 3, "num_samples": 12, "global_batch": 4,
           "seed": 0, "shuffle": True}


def manifest(step: int, pipeline: Pipeline = PIPELINE) -> mf.Manifest:
    sections = {s.name: {"stage": s.stage, "dp": s.dp, "optimizer": dict(s.optimizer), "params": {"w": [2, 3]}}
                for s in pipeline.sections if s.trainable}
    return mf.Manifest(step=step, pipeline=pipeline.to_dict(), sections=sections, sampler={**SAMPLER, "step": step},
                       files={"student/__0_0.distcp": [6, "0a1b2c3d"]})


def save(root, step: int, complete: bool = True) -> str:
    folder = mf.step_dir(str(root), step)
    os.makedirs(folder)
    if complete:
        mf.write(folder, manifest(step))
    return folder


def test_the_newest_complete_checkpoint_is_the_one_resumed(tmp_path):
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    save(tmp_path, 6, complete=False)  # a save that was interrupted
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [(s, ok) for s, _, ok in mf.checkpoints(str(tmp_path))] == [(2, True), (4, True), (6, False)]
    assert mf.latest(str(tmp_path)) == newest
    assert mf.latest(newest) == newest
    folder, m = resume_point(str(tmp_path))
    assert folder == newest and m == manifest(4)


def test_no_complete_checkpoint_is_a_clear_error(tmp_path):
    save(tmp_path, 2, complete=False)
    with pytest.raises(PipelineError, match=r"no complete checkpoint there \(1 incomplete"):
        resume_point(str(tmp_path))
    with pytest.raises(PipelineError, match="is not a complete checkpoint"):
        mf.read(mf.step_dir(str(tmp_path), 2))
    save_dir = tmp_path / "save"  # found in QA: a --save-dir given to --resume said only "no complete checkpoint"
    save_dir.mkdir()
    (save_dir / "pipeline.json").write_text("{}")
    (save_dir / "student.safetensors").write_bytes(b"")
    with pytest.raises(PipelineError, match=r"no complete checkpoint there: it is a --save-dir \(the trained"):
        resume_point(str(save_dir))


def test_what_keeps_a_checkpoint_from_resuming_a_pipeline():
    m = manifest(4)
    assert mf.incompatibilities(m, PIPELINE.to_dict()) == []
    assert mf.incompatibilities(m, PIPELINE.override(**{"sections.student.dp": 4}).to_dict()) == []  # reshards
    other = PIPELINE.override(**{"sections.student.stage": "m:Other", "sections.student.optimizer.name": "sgd",
                                 "global_batch": 8, "data.shuffle": False})
    assert mf.incompatibilities(m, other.to_dict()) == [
        "sections.student.stage: 'm:Other' here, 'm:S' in the checkpoint",
        "sections.student.optimizer.name: 'sgd' here, 'adamw' in the checkpoint",
        "global_batch: 8 here, 4 in the checkpoint (the sampler position would mean other samples)",
        "data.shuffle: False here, True in the checkpoint (the sampler position would mean other samples)",
    ]
    frozen = PIPELINE.override(**{"sections.student.trainable": False, "sections.teacher.trainable": True})
    assert mf.incompatibilities(m, frozen.to_dict()) == [
        "the checkpoint has trainable section 'student', the pipeline does not",
        "sections.teacher: trainable here, but not in the checkpoint",
    ]
    amsgrad = PIPELINE.override(**{"sections.student.optimizer.amsgrad": True})
    assert mf.incompatibilities(m, amsgrad.to_dict()) == [
        "sections.student.optimizer.amsgrad: on here, off in the checkpoint (its optimizer state has no maximum of "
        "the second moments to go on from)"]
    assert mf.incompatibilities(manifest(4, amsgrad), PIPELINE.to_dict()) == []  # turned off: a hyperparameter
    with pytest.raises(PipelineError, match="the dataset has 10 usable samples, the checkpoint was trained on 12"):
        mf.check_samples(m, 10, "x")
    mf.check_samples(m, 12, "anything")  # a checkpoint from before fingerprints: the count alone


def test_a_rebuilt_dataset_of_the_same_size_is_refused_on_resume():
    # Suspected in review: only the sample count was compared, so a dataset rebuilt with the same
    # count (another `maestro data demo --seed`) resumed silently, the position meaning other samples.
    from maestro_flow.runtime.sampler import EpochSampler, data_fingerprint
    from maestro_flow.samples import SampleMeta

    data = [SampleMeta(id=i, row=i, num_tokens=3) for i in range(12)]
    position = EpochSampler(data, 4, 0).position(4)
    m = mf.Manifest(step=4, pipeline=PIPELINE.to_dict(), sections=manifest(4).sections, sampler=position)
    mf.check_samples(m, 12, data_fingerprint(data))
    rebuilt = [SampleMeta(id=i + 100, row=i, num_tokens=3) for i in range(12)]
    with pytest.raises(PipelineError, match="the dataset is not the one the checkpoint was trained on"):
        mf.check_samples(m, 12, data_fingerprint(rebuilt))
    # Found in review: rebuilt with the same ids (0..n-1, as `maestro data demo --seed` writes them)
    # and other samples, it was taken as the same. Their sizes differ.
    same_ids = [SampleMeta(id=i, row=i, num_tokens=3 + (i == 5)) for i in range(12)]
    mf.check_samples(m, 12, data_fingerprint(data), data_fingerprint(data, sizes=True))
    with pytest.raises(PipelineError, match="the same ids in the same rows, but other samples"):
        mf.check_samples(m, 12, data_fingerprint(same_ids), data_fingerprint(same_ids, sizes=True))
    images = [SampleMeta(id=i, row=i, num_tokens=3, modalities=frozenset({"text", "image"})) for i in range(12)]
    with pytest.raises(PipelineError, match="but other samples"):
        mf.check_samples(m, 12, data_fingerprint(images), data_fingerprint(images, sizes=True))
    del m.sampler["data_sizes"]  # a checkpoint from before sizes were recorded: ids by row alone
    mf.check_samples(m, 12, data_fingerprint(same_ids), data_fingerprint(same_ids, sizes=True))


def test_plans_stop_at_each_checkpoint_boundary():
    c = Checkpointer(CheckpointOptions(dir="x", every=3))
    assert [c.due(n) for n in range(7)] == [False, False, False, True, False, False, True]
    assert [c.due(n, total=5) for n in range(6)] == [False, False, False, True, False, True]  # and the last
    assert [c.plan_limit(n) for n in (0, 2, 3, 5, 6)] == [3, 3, 6, 6, 9]
    off = Checkpointer(CheckpointOptions())
    assert not off.due(3) and off.plan_limit(3) is None


def test_commit_writes_the_manifest_and_keeps_the_newest_k(tmp_path):
    c = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2, keep_last=2))
    save(tmp_path, 1, complete=False)  # left over by an interrupted save
    for step in (2, 4, 6):
        folder = c.begin(step)
        assert os.path.isdir(os.path.join(folder, mf.RNG_DIR))
        assert c.commit(step, manifest(step))
        assert c.committed == folder
    assert [(s, ok) for s, _, ok in mf.checkpoints(str(tmp_path))] == [(4, True), (6, True)]


def test_checkpoints_of_another_training_are_never_mixed_in(tmp_path):
    """Found in review: a run resuming another directory's checkpoint into this one, with
    --keep-last 1, deleted the complete checkpoints another run had left here at lower steps."""
    import dataclasses

    theirs = dataclasses.replace(manifest(0), lineage="theirs")
    for step in (10, 20):
        os.makedirs(mf.step_dir(str(tmp_path), step))
        mf.write(mf.step_dir(str(tmp_path), step), dataclasses.replace(theirs, step=step))
    fresh = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=5, keep_last=1))
    with pytest.raises(PipelineError, match=r"holds another training's checkpoints \(.*step-00000010\): resume from "
                                            r"it with --resume"):
        fresh.claim(None)
    # Found in review: --resume was offered for another pipeline's checkpoints, then refused.
    other = Pipeline(name="q", data=ArrowData(path="d"), global_batch=8, sections=[Section(name="lm", stage="m:L")])
    cannot = (r"holds another training's checkpoints \(.*step-00000010; this pipeline cannot resume from them\): "
              r"choose another --checkpoint-dir$")
    with pytest.raises(PipelineError, match=cannot):
        Checkpointer(CheckpointOptions(dir=str(tmp_path), every=5)).claim(None, other.to_dict())
    with pytest.raises(PipelineError, match=r"step-00000010\): resume from it with --resume"):
        Checkpointer(CheckpointOptions(dir=str(tmp_path), every=5)).claim(None, PIPELINE.to_dict())
    # Found in review: --resume ROOT takes the newest, which is what must fit (here: damaged).
    newest = os.path.join(mf.step_dir(str(tmp_path), 20), mf.MANIFEST)
    kept = open(newest, "rb").read()
    open(newest, "wb").write(b"\xff\xfe not a manifest")
    with pytest.raises(PipelineError, match=r"step-00000010; this pipeline cannot resume from them\)"):
        Checkpointer(CheckpointOptions(dir=str(tmp_path), every=5)).claim(None, PIPELINE.to_dict())
    open(newest, "wb").write(kept)
    elsewhere = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=5, keep_last=1))
    with pytest.raises(PipelineError, match=r"another training's checkpoints .*: choose another --checkpoint-dir"):
        elsewhere.claim(dataclasses.replace(manifest(4), lineage="mine"))  # resumed from another directory
    own = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=5, keep_last=1))
    own.claim(dataclasses.replace(manifest(20), lineage="theirs"))  # resuming this directory's newest: its own
    own.begin(25)
    own.commit(25, manifest(25))
    assert mf.read(own.committed).lineage == "theirs"
    assert [s for s, _, _ in mf.checkpoints(str(tmp_path))] == [25]  # keep-last 1 among its own
    own.close()


def test_a_purge_only_removes_its_own_trainings_checkpoints(tmp_path):
    import dataclasses

    os.makedirs(mf.step_dir(str(tmp_path), 3))
    mf.write(mf.step_dir(str(tmp_path), 3), dataclasses.replace(manifest(3), lineage="theirs"))
    c = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=5, keep_last=1))
    c.lineage = "mine"  # as claim() sets it (which would have refused this directory)
    for step in (5, 10):
        c.begin(step)
        c.commit(step, manifest(step))
    assert [s for s, _, _ in mf.checkpoints(str(tmp_path))] == [3, 10]


def test_going_back_to_an_earlier_checkpoint_in_the_same_directory_is_refused_with_the_way_out(tmp_path):
    """Found in review: this was refused as "checkpoints ... from another run"."""
    import dataclasses

    for step in (2, 4):
        os.makedirs(mf.step_dir(str(tmp_path), step))
        mf.write(mf.step_dir(str(tmp_path), step), dataclasses.replace(manifest(step), lineage="L"))
    c = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2))
    with pytest.raises(PipelineError, match=r"holds this training's checkpoints past step 2 \(newest: .*step-00000004\)"
                                            r", which this run would overwrite: resume from the newest with --resume "
                                            r".*, or to go back to step 2, move the later ones away"):
        c.claim(dataclasses.replace(manifest(2), lineage="L"))
    c.claim(dataclasses.replace(manifest(4), lineage="L"))
    c.close()


def test_checkpoints_from_before_lineages_resume_in_their_directory(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)  # lineage None
    c = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2, keep_last=1))
    c.claim(mf.read(mf.step_dir(str(tmp_path), 4)))
    c.begin(6)
    c.commit(6, manifest(6))
    assert [s for s, _, _ in mf.checkpoints(str(tmp_path))] == [6] and mf.read(c.committed).lineage == c.lineage
    c.close()
    # Found in review: the next resume (from step 6, now with a lineage) refused the checkpoints
    # written before lineages as another training's.
    save(tmp_path, 2)
    again = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2))
    again.claim(mf.read(mf.step_dir(str(tmp_path), 6)))
    again.close()
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000003" / mf.MANIFEST).write_text("{not json")  # unreadable: in no one's way
    fresh = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2))
    fresh.claim(mf.read(mf.step_dir(str(tmp_path), 6)))
    fresh.close()


def test_the_checkpoint_lock_is_not_the_run_directorys(tmp_path):
    """Found in review: one folder as --run-dir and --checkpoint-dir was refused as in use."""
    from maestro_flow.runtime.outputs import hold_folder

    run_lock = hold_folder(str(tmp_path), "in use")
    c = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2))
    c.claim(None)
    c.close()
    run_lock.close()


def test_two_runs_cannot_share_a_checkpoint_directory(tmp_path):
    """Found in review: two runs given one --checkpoint-dir replaced and deleted each other's
    checkpoints, and the one that lost them exited 0."""
    first = Checkpointer(CheckpointOptions(dir=str(tmp_path / "ck"), every=1))
    first.claim(None)
    second = Checkpointer(CheckpointOptions(dir=str(tmp_path / "ck"), every=1))
    with pytest.raises(PipelineError, match=r"--checkpoint-dir .*ck is in use by a run still going"):
        second.claim(None)
    first.close()
    second.claim(None)
    second.close()


def test_a_failed_save_is_discarded_and_stops_or_is_skipped(tmp_path):
    logged = []
    stop = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2))
    stop.begin(2)
    stop.commit(2, manifest(2))
    stop.begin(4)
    with pytest.raises(CheckpointError, match=r"checkpoint at step 4 failed: rank 1, rank 2: OSError: \[Errno 28\] No "
                                              r"space left on device; the newest complete checkpoint is .*step-00000002"):
        stop.failed(4, {"rank 1": "OSError: [Errno 28] No space left on device",
                        "rank 2": "OSError: [Errno 28] No space left on device"})
    assert [s for s, _, _ in mf.checkpoints(str(tmp_path))] == [2]
    go_on = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2, on_error="continue"), log=logged.append)
    go_on.begin(4)
    go_on.failed(4, {"rank 1": "OSError: boom"})
    assert len(logged) == 1 and logged[0].startswith("warning: checkpoint at step 4 failed: rank 1: OSError: boom")
    (tmp_path / "step-00000006").write_text("a file where the folder must go")
    with pytest.raises(CheckpointError, match="checkpoint at step 6: cannot create"):
        stop.begin(6)
    assert go_on.begin(6) is None and logged[-1].startswith("warning: checkpoint at step 6: cannot create")


def test_a_step_folder_may_be_named_by_its_unpadded_number(tmp_path):
    """README and --help say ckpt/step-N; the folders are step-00000002 (sorted by name)."""
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    folder, m = resume_point(str(tmp_path / "step-4"))
    assert folder == newest and m.step == 4
    CheckpointOptions(resume=str(tmp_path / "step-2")).validate()
    assert mf.find_folder(str(tmp_path / "step-00000002"), "--resume") == str(tmp_path / "step-00000002")


def test_a_missing_checkpoint_folder_lists_the_checkpoints_beside_it(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4, complete=False)
    listed = rf"--resume: no such folder: .*step-3 \(checkpoints in {tmp_path}: step-00000002, step-00000004 \(incomplete\)\)"
    with pytest.raises(PipelineError, match=listed):
        CheckpointOptions(resume=str(tmp_path / "step-3")).validate()
    with pytest.raises(PipelineError, match=listed):
        resume_point(str(tmp_path / "step-3"))


def test_export_takes_a_step_folder_by_number_and_lists_the_checkpoints_when_missing(tmp_path):
    from click.testing import CliRunner

    from maestro_flow.cli import main

    save(tmp_path, 2)  # a manifest, no parameters: export finds the folder, then says what it lacks
    found = CliRunner().invoke(main, ["export", str(tmp_path / "step-2"), "--section", "student", "-o",
                                      str(tmp_path / "out")])
    assert found.exit_code == 2 and "step-00000002 holds no parameters for it" in found.stderr, found.output
    missing = CliRunner().invoke(main, ["export", str(tmp_path / "step-9"), "--section", "student", "-o",
                                        str(tmp_path / "out")])
    assert missing.exit_code == 2 and missing.stderr.strip() == (
        f"error: SOURCE: no such folder: {tmp_path / 'step-9'} (checkpoints in {tmp_path}: step-00000002)")


def test_a_run_directory_given_for_checkpoints_says_where_its_run_wrote_them(tmp_path):
    """Found in QA: `--resume RUN_DIR` and `export RUN_DIR` said "no complete checkpoint there",
    though the run directory's events.jsonl names the checkpoints."""
    from click.testing import CliRunner

    from maestro_flow.checkpoint.checkpointer import resume_point
    from maestro_flow.cli import main

    run, ck = tmp_path / "run", tmp_path / "ck"
    run.mkdir()
    (run / "pipeline.json").write_text(json.dumps({"pipeline": PIPELINE.to_dict(), "overrides": {}}))  # as RunDir
    (run / "events.jsonl").write_text('{"ended": "done"}\n')
    with pytest.raises(PipelineError, match="it is a run directory, and its run wrote no checkpoint "
                                            r"\(a run writes them with --checkpoint-dir\)$"):
        resume_point(str(run))
    events = [{"checkpoint": str(ck / f"step-0000000{n}"), "step": n} for n in (2, 4)] + [{"ended": "done"}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + "{cut sho")
    note = (f"it is a run directory; its run wrote its checkpoints in {ck} (the last: {ck / 'step-00000004'}): "
            f"give {ck}")
    with pytest.raises(PipelineError, match=re.escape(f"--resume {run}: no complete checkpoint there: {note}")):
        resume_point(str(run))
    out = CliRunner().invoke(main, ["export", str(run), "--section", "student", "-o", str(tmp_path / "out")])
    assert out.exit_code == 2 and out.stderr.strip().endswith(note), out.output


@pytest.mark.parametrize("options, message", [
    (CheckpointOptions(every=2), "--checkpoint-every needs --checkpoint-dir"),
    (CheckpointOptions(dir="x", every=0), r"--checkpoint-every must be a number of steps >= 1, got 0$"),
    (CheckpointOptions(dir="x", every=2, keep_last=0), "--keep-last must be a count >= 1, got 0"),
    (CheckpointOptions(keep_last=2), "--keep-last says how many of --checkpoint-dir's checkpoints to keep: give "
                                     "--checkpoint-dir too"),
    (CheckpointOptions(dir="x"), "--checkpoint-dir needs --checkpoint-every N"),
    (CheckpointOptions(on_error="continue"), "--checkpoint-errors says what a failed save into --checkpoint-dir "
                                             "does: give --checkpoint-dir too"),
    (CheckpointOptions(on_error="stop"), "--checkpoint-errors says what a failed save"),
    (CheckpointOptions(max_restarts=-1), "--max-restarts must be >= 0"),
    (CheckpointOptions(resume="/no/such/folder"), "--resume: no such folder"),
    (CheckpointOptions(on_term=True), "--checkpoint-on-term saves into --checkpoint-dir: give --checkpoint-dir DIR and "
                                      "--checkpoint-every N too"),
])
def test_checkpoint_options_are_checked(options, message):
    with pytest.raises(PipelineError, match=message):
        options.validate()


def test_rng_states_round_trip(tmp_path):
    path = str(tmp_path / "rng" / "s-0.pt")
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    rng.save(path, torch.device("cpu"))
    first = (torch.rand(3), random.random(), np.random.rand(2))
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    rng.load(path, torch.device("cpu"))
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and np.array_equal(first[2], again[2])


def test_files_another_node_wrote_to_its_own_disk_keep_the_checkpoint_incomplete(tmp_path):
    # Suspected in review: with --checkpoint-dir on each node's local disk, node 0 wrote a manifest
    # for a checkpoint whose other parts were elsewhere (a resume then took another replica's RNG
    # states, saying the dp had changed). The coordinator now checks what it can see first.
    from types import SimpleNamespace

    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner.plan import Placement
    from maestro_flow.runtime.coordinator import Coordinator

    pipeline = PIPELINE.override(**{"sections.student.dp": 2})
    graph = SectionGraph(pipeline)
    coordinator = SimpleNamespace(graph=graph, placement=Placement.build(graph.order, {"teacher": 1, "student": 2}))
    folder = tmp_path / "step-00000002"
    infos = {0: {}, 1: {"params": {"w": [2, 3]}}, 2: {}}  # ranks: teacher 0 | student 1 2
    (folder / "student").mkdir(parents=True)
    (folder / "student" / ".metadata").write_bytes(b"x")
    (folder / "rng").mkdir()
    for name in ("teacher-0", "student-0"):  # node 0's ranks; student replica 1 (rank 2) saved elsewhere
        (folder / "rng" / f"{name}.pt").write_bytes(b"x")
    assert Coordinator._not_written(coordinator, str(folder), infos) == [str(folder / "rng" / "student-1.pt")]
    (folder / "rng" / "student-1.pt").write_bytes(b"x")
    assert Coordinator._not_written(coordinator, str(folder), infos) == []
    assert Coordinator._not_written(coordinator, str(folder), {**infos, 1: {}}) == []  # no training state: no DCP


def test_each_replica_draws_its_own_random_numbers_from_the_sections_weights():
    """Found in QA: every replica continued the section's one seeded stream, so replicas drew the
    same dropout masks. The weights stay the section's; the draws after them are the replica's
    (a replica's tp ranks build with its index, so they draw alike); the same on every build."""
    from maestro_flow.runtime.build import build_stage

    lm = PIPELINE.override(**{"sections.student.stage": "stages.lm:CausalLM", "sections.student.config": {
        "vocab_size": 32, "d_model": 8, "n_layers": 1, "n_heads": 2, "max_seq_len": 16}})
    built = {}
    for replica in (0, 1, 1):
        stage = build_stage(lm, lm.section("student"), replica, "cpu")
        weights = torch.cat([p.detach().flatten() for p in stage.parameters()])
        built.setdefault(replica, []).append((weights, torch.rand(4), random.random(), np.random.rand()))
    (w0, t0, r0, n0), (w1, t1, r1, n1), (w1b, t1b, r1b, n1b) = built[0] + built[1]
    assert torch.equal(w0, w1) and torch.equal(w1, w1b)
    assert not torch.equal(t0, t1) and r0 != r1 and n0 != n1
    assert torch.equal(t1, t1b) and (r1, n1) == (r1b, n1b)


def test_a_missing_rng_file_is_refused_unless_the_layout_changed(tmp_path):
    """Found in review: with one replica's RNG file deleted, a resume at the same dp took
    replica 0's states and buffers with a note saying the dp had changed (it had not): the resume
    was no longer bitwise and said otherwise. Now refused; at another dp, the note stands."""
    from maestro_flow.checkpoint.section_state import CheckpointMismatch, SectionState

    two = PIPELINE.override(**{"sections.teacher.dp": 2, "sections.student.dp": 2})
    folder = mf.step_dir(str(tmp_path), 4)
    os.makedirs(folder)
    mf.write(folder, manifest(4, two))
    rng.save(mf.rng_file(folder, "teacher", 0), torch.device("cpu"))  # replica 1's is gone

    def load(layout):
        state = SectionState(torch.nn.Linear(2, 2), None, section="teacher", replica=1, group=None,
                             device=torch.device("cpu"))
        return state.load(folder, layout=layout)

    with pytest.raises(CheckpointMismatch, match=r"teacher-1\.pt is missing: the RNG states and buffers of teacher "
                                                 r"replica 1, which a checkpoint of this section at dp 2, tp 1 holds; "
                                                 r"the checkpoint is incomplete \(resume from another one\)$"):
        load((2, 1))
    before = save(tmp_path, 2)  # found in QA: the one to go back to was not named, as for a damaged DCP file
    with pytest.raises(CheckpointMismatch, match=rf"the checkpoint is incomplete; the complete checkpoint before it: "
                                                 rf"{before} \(--resume {before}; "):
        load((2, 1))
    torch.manual_seed(5)
    zeroth = torch.get_rng_state()
    rng.save(mf.rng_file(folder, "teacher", 0), torch.device("cpu"))
    assert load((3, 1)) == ("teacher replica 1: no RNG state or buffers saved for it (the section's dp or tp "
                            "changed); using replica 0's buffers and RNG states seeded for it")
    assert not torch.equal(torch.get_rng_state(), zeroth)  # its own, not replica 0's (found in QA)
    with open(mf.rng_file(folder, "teacher", 0), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointMismatch, match=rf"cannot read the RNG state of teacher replica 1 .*; the complete "
                                                 rf"checkpoint before it: {before} "):
        load((3, 1))


def test_export_refuses_an_output_folder_it_cannot_make_in_one_line(tmp_path):
    """Found in review: -o under a file gave a Python traceback (exit 1)."""
    from click.testing import CliRunner

    from maestro_flow.cli import main

    save(tmp_path, 2)
    (tmp_path / "f").write_text("a file")
    result = CliRunner().invoke(main, ["export", str(tmp_path / "step-2"), "--section", "student", "-o",
                                       str(tmp_path / "f" / "sub")])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: -o {tmp_path / 'f' / 'sub'}: {tmp_path / 'f'} is a file, not a folder"


def test_a_save_dir_never_pairs_a_new_pipeline_with_an_earlier_runs_weights(tmp_path, capsys):
    """And a save that fails keeps the earlier run's files (found in QA: a full disk at the save lost
    them, deleted before the write)."""
    from maestro_flow.checkpoint.savedir import PIPELINE_FILE, begin_save, end_save

    for saved in (False, True):
        (tmp_path / "student.safetensors").write_bytes(b"an earlier run's")
        (tmp_path / PIPELINE_FILE).write_text("{}")
        (tmp_path / "notes.txt").write_text("the user's")
        begin_save(str(tmp_path), PIPELINE.to_dict())
        assert sorted(os.listdir(tmp_path)) == ["notes.txt", PIPELINE_FILE, f"{PIPELINE_FILE}.previous",
                                                "student.safetensors.previous"]  # the workers write student's next
        assert json.loads((tmp_path / PIPELINE_FILE).read_text())["name"] == "p"
        end_save(str(tmp_path), PIPELINE.to_dict(), saved=saved)
        err = capsys.readouterr().err
        if saved:  # the save completed: the earlier files go
            assert sorted(os.listdir(tmp_path)) == ["notes.txt", PIPELINE_FILE] and not err
        else:
            assert (tmp_path / "student.safetensors.previous").read_bytes() == b"an earlier run's"
            assert err == (f"note: --save-dir {tmp_path}: this run's save did not complete; the files an earlier run "
                           f"saved there are kept as {PIPELINE_FILE}.previous, student.safetensors.previous (drop the "
                           "'.previous' to use them again)\n")
            # Found in review: the next save replaced what was kept with what the failed one wrote.
            (tmp_path / "student.safetensors").write_bytes(b"the failed run's")
            begin_save(str(tmp_path), PIPELINE.to_dict())
            assert not (tmp_path / "student.safetensors").exists()
            assert (tmp_path / "student.safetensors.previous").read_bytes() == b"an earlier run's"
            failure = OSError("No space left on device")  # the run's own error: the note goes with it
            end_save(str(tmp_path), PIPELINE.to_dict(), saved=False, failure=failure)
            assert not capsys.readouterr().err and "kept as" in failure.__notes__[0]


def test_the_note_of_what_a_failed_save_kept_comes_after_the_error(tmp_path):
    """Found in review: the note on the files set aside printed before the error it explains. A
    real colocated run whose save fails (a folder in the way of the student's file; this session:
    a traceback before, and the .tmp file stayed), through run.py's end_save and the CLI."""
    from click.testing import CliRunner

    from loaders.demo import build_text_demo
    from maestro_flow.cli import main

    data = build_text_demo(tmp_path / "data", num_samples=32, parquet=False)
    out = tmp_path / "out"
    (out / "student.safetensors").mkdir(parents=True)
    (out / "pipeline.json").write_text("{}")  # an earlier run's
    result = CliRunner().invoke(main, ["run", "pipelines/distill.py", "--colocated", "--steps", "1", "--quiet",
                                       "--no-run-dir", "--save-dir", str(out), "--set", f"data.path={data}"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.stderr.splitlines() == [
        f"error: --save-dir {out}: cannot write section 'student': Is a directory",
        f"note: --save-dir {out}: this run's save did not complete; the files an earlier run saved there are kept "
        "as pipeline.json.previous (drop the '.previous' to use them again)"], result.stderr
    assert sorted(os.listdir(out)) == [".save.lock", "pipeline.json", "pipeline.json.previous", "student.safetensors"]


def test_a_save_dir_sets_aside_files_only_and_the_baselines_sections(tmp_path, capsys):
    """Found in review: a folder in the way was set aside (the save then passed, where it must
    fail) and made the end a traceback; the monolithic baseline set aside its own one section's
    name, not the files its sections write."""
    from maestro_flow.baseline.monolithic import monolithic_pipeline
    from maestro_flow.checkpoint.savedir import begin_save, end_save

    (tmp_path / "student.safetensors").mkdir()
    begin_save(str(tmp_path), PIPELINE.to_dict())
    assert (tmp_path / "student.safetensors").is_dir() and not (tmp_path / "student.safetensors.previous").exists()
    (tmp_path / "student.safetensors.previous").mkdir()
    end_save(str(tmp_path), PIPELINE.to_dict(), saved=True)  # no traceback: not a file of ours
    assert capsys.readouterr().err == ""
    base = tmp_path / "base"
    base.mkdir()
    (base / "student.safetensors").write_bytes(b"an earlier run's")
    begin_save(str(base), monolithic_pipeline(PIPELINE, devices=1).to_dict())
    assert (base / "student.safetensors.previous").read_bytes() == b"an earlier run's"


def test_a_discarded_checkpoint_loses_its_manifest_first(tmp_path, monkeypatch):
    """A process stopped while a checkpoint is purged leaves an incomplete folder, not one with a
    manifest and part of its data."""
    import shutil

    folder = save(tmp_path, 2)
    (tmp_path / "step-00000002" / "data.distcp").write_bytes(b"x")
    seen = []
    monkeypatch.setattr(shutil, "rmtree", lambda path, **kw: seen.append(os.listdir(path)))
    Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2))._discard(folder)
    assert seen == [["data.distcp"]]


def test_saved_weights_are_readable_as_the_umask_says_and_a_failed_write_is_an_oserror(tmp_path, monkeypatch):
    """Found in review: --save-dir and export files were 0600 (safetensors' own mode), and a full
    disk raised safetensors' own error type, a traceback where an OSError is one line."""
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from maestro_flow.checkpoint import savedir

    path = str(tmp_path / "student.safetensors")
    savedir.write_safetensors({"w": torch.zeros(3)}, path, {"section": "student"})
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~savedir._umask() and savedir._umask() == os.umask(savedir._umask())

    def full(state, filename, metadata=None):
        open(filename, "wb").close()
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(savedir, "save_file", full)
    with pytest.raises(OSError, match="No space left on device"):
        savedir.write_safetensors({"w": torch.ones(3)}, path, {"section": "student"})
    assert os.listdir(tmp_path) == ["student.safetensors"]  # the earlier file stays, the partial one went
    assert torch.equal(safetensors.torch.load_file(path)["w"], torch.zeros(3))


def test_ctrl_c_while_dcp_reads_is_an_interrupt_not_a_damaged_checkpoint():
    """Found in review: `maestro export` stopped by Ctrl-C said it cannot read the section (exit 2)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from maestro_flow.checkpoint.section_state import interrupted

    assert interrupted(CheckpointException("load", {0: KeyboardInterrupt()}))
    assert not interrupted(CheckpointException("load", {0: EOFError()}))
    assert interrupted(KeyboardInterrupt()) and not interrupted(ValueError())


def test_a_frozen_section_whose_config_changed_is_warned_of_on_resume():
    """Found in review: a distill teacher's init_seed changed on resume without a word (frozen
    sections are rebuilt from their config, not read from the checkpoint)."""
    import dataclasses

    saved = manifest(4)
    assert mf.resume_warnings(saved, PIPELINE.to_dict()) == []
    # Last note: a checkpoint whose manifest has no checksums (or had them taken out) was not checked, silently.
    assert mf.resume_warnings(dataclasses.replace(saved, files={}), PIPELINE.to_dict()) == [
        "the checkpoint records no checksums of its files (written before they were kept, or `files` was taken out "
        "of its manifest.json), so a file damaged since the save is not found before the workers load it"]
    teacher = dataclasses.replace(PIPELINE.sections[0], config={"init_seed": 7})
    changed = dataclasses.replace(PIPELINE, sections=[teacher, PIPELINE.sections[1]])
    assert mf.resume_warnings(saved, changed.to_dict()) == [
        "sections.teacher is frozen, so its weights are not in the checkpoint but built from its config, and "
        "config.init_seed differs from the run that wrote it: what the trained sections learn from has changed"]
    student = dataclasses.replace(PIPELINE.sections[1], config={"lr_note": 1})
    other = dataclasses.replace(PIPELINE, sections=[dataclasses.replace(PIPELINE.sections[0], stage="m:U"), student])
    assert "and stage differs from" in mf.resume_warnings(saved, other.to_dict())[0]
    # Found in review: a NaN in a config (NaN != NaN) was warned of at every resume.
    nan = dataclasses.replace(PIPELINE, sections=[dataclasses.replace(PIPELINE.sections[0], config={"x": float("nan")}),
                                                  PIPELINE.sections[1]])
    assert mf.resume_warnings(manifest(4, nan), nan.to_dict()) == []
    # Found in QA: a float64 checkpoint resumed in float32 (no --set dtype) without a word.
    f32 = dataclasses.replace(PIPELINE, dtype="float32")
    assert mf.resume_warnings(manifest(4, dataclasses.replace(PIPELINE, dtype="float64")), f32.to_dict()) == [
        "dtype is 'float32', not 'float64' as in the run that wrote the checkpoint: its state is cast to 'float32', so "
        "the run does not go on as that one would have (--set dtype=float64 does)"]
    # Found in QA: said that bf16 casts the state, which mixed precision keeps in dtype.
    bf16 = dataclasses.replace(PIPELINE, mixed_precision="bf16")
    assert mf.resume_warnings(saved, bf16.to_dict()) == [
        "mixed_precision is 'bf16', not None as in the run that wrote the checkpoint: the forward and backward run in "
        "'bf16' (parameters and optimizer state stay in dtype), so the run does not go on as that one would have "
        "(--set mixed_precision=null does)"]


def test_a_trainable_section_whose_config_or_optimizer_changed_is_warned_of_on_resume():
    """Found in QA: a KD student's alpha changed on resume, and its loss jumped without a word; a
    changed d_model failed in the workers naming a parameter, not the field."""
    import dataclasses

    saved = manifest(4)
    student = PIPELINE.sections[1]
    config = {**student.config, "student": {**student.config.get("student", {}), "d_model": 32}, "alpha": 0.9}
    changed = dataclasses.replace(student, config=config, optimizer={**student.optimizer, "lr": 0.5})
    [warning] = mf.resume_warnings(saved, dataclasses.replace(PIPELINE, sections=[PIPELINE.sections[0], changed])
                                   .to_dict())
    assert warning.startswith(f"sections.{student.name}: config.alpha (0.9 now, "), warning
    assert "config.student.d_model (32 now, unset then)" in warning and "optimizer.lr (0.5 now, " in warning
    assert warning.endswith("differ from the run that wrote the checkpoint: the section trains on from its weights "
                            "and optimizer state with the new values"), warning
    many = dataclasses.replace(student, config={k: 1 for k in "abcdef"})  # found in review: "and 2 more"
    [warning] = mf.resume_warnings(saved, dataclasses.replace(PIPELINE, sections=[PIPELINE.sections[0], many])
                                   .to_dict())
    assert "config.d (1 now, unset then), and config.e, config.f differ from" in warning, warning
    # Found in review: 2 for 2.0 was a change; a trainable model's own init_seed (its weights come
    # from the checkpoint) was said to be used. A KD teacher copy's seed makes its frozen head.
    same = dataclasses.replace(student, config={"temperature": 2, "init_seed": 9, "student": {"checkpoint": "b"}})
    before = dataclasses.replace(student, config={"temperature": 2.0, "init_seed": 1, "student": {"checkpoint": "a"}})
    saved = manifest(4, dataclasses.replace(PIPELINE, sections=[PIPELINE.sections[0], before]))
    assert mf.resume_warnings(saved, dataclasses.replace(PIPELINE, sections=[PIPELINE.sections[0], same])
                              .to_dict()) == []
    seeded = dataclasses.replace(before, config={**before.config, "teacher": {"init_seed": 1}})
    [warning] = mf.resume_warnings(saved, dataclasses.replace(PIPELINE, sections=[PIPELINE.sections[0], seeded])
                                   .to_dict())
    assert "config.teacher.init_seed (1 now, unset then)" in warning, warning


def test_a_resume_names_the_newer_incomplete_folders_it_passed_over(tmp_path):
    """Found in QA: with the newest checkpoint's manifest gone, a resume took the one before and
    said "resuming from step-4", nothing of step-6."""
    four = save(tmp_path, 4)
    save(tmp_path, 6, complete=False)
    save(tmp_path, 10, complete=False)
    save(tmp_path, 2, complete=False)  # older: not passed over
    assert resume_point(str(tmp_path))[0] == four
    assert mf.skipped_note(four) == ("; newer, incomplete (an interrupted or failed save, never resumed from): "
                                     "step-00000006, step-00000010")
    assert mf.skipped_note(save(tmp_path, 12)) == ""


def test_where_to_go_on_from_is_this_training_s_newest_checkpoint(tmp_path, monkeypatch):
    """Found in QA: an interrupted or failed run said nothing of what was kept; found in review:
    the note named --resume for a checkpoint after the last step (refused), another training's
    checkpoints, and could raise in the error handler on an unreadable folder."""
    from maestro_flow.checkpoint import checkpointer as ck

    ck._CLAIMED = None
    assert ck.go_on_note() is None  # no folder claimed: refused before, or not node 0
    job = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2), log=lambda text: None)
    job.claim(None, {**PIPELINE.to_dict(), "steps": 6})
    assert ck.go_on_note() == f"checkpoints: none complete in {tmp_path} yet"
    save(tmp_path, 2)  # another training's (no lineage): not offered
    assert ck.go_on_note() == f"checkpoints: none complete in {tmp_path} yet"
    for step in (4, 6):
        job.begin(step)
        job.commit(step, manifest(step))
    four, six = mf.step_dir(str(tmp_path), 4), mf.step_dir(str(tmp_path), 6)
    assert ck.go_on_note() == (f"checkpoints: the newest complete one, {six}, is after the last step: `maestro export "
                               f"{six} --section SECTION -o DIR` takes a section's weights from it")
    shutil.rmtree(six)
    assert ck.go_on_note() == (f"checkpoints: the newest complete one is {four}; go on from it with the same command "
                               f"and --resume {tmp_path}")
    assert ck.go_on_note(failed=True).endswith(f"--resume {tmp_path}, once the cause above is dealt with")
    (Path(four) / mf.MANIFEST).write_text("{cut")
    assert ck.go_on_note() == f"checkpoints: none complete in {tmp_path} yet"  # unreadable: not ours to offer
    job.resumed_from = "/elsewhere/step-00000002"  # found in review: not said, where it was the one place
    assert ck.go_on_note() == (f"checkpoints: none complete in {tmp_path} yet; the run resumed from "
                               "/elsewhere/step-00000002 (--resume /elsewhere/step-00000002)")

    def unreadable(root):
        raise PermissionError(13, "Permission denied", root)

    monkeypatch.setattr(mf, "checkpoints", unreadable)
    assert ck.go_on_note() is None
    job.close()
    ck._CLAIMED = None


def test_keep_last_keeps_the_newest_checkpoint_from_before_a_non_finite_step(tmp_path):
    """Found in QA: one NaN step, the run trained on (the default), and --keep-last 2 deleted every
    checkpoint whose weights were not NaN."""
    from maestro_flow.checkpoint import checkpointer as ck

    said: list[str] = []
    job = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2, keep_last=1), log=said.append)
    job.claim(None, {**PIPELINE.to_dict(), "steps": 12})
    diverged: list[int | None] = [None]
    job.diverged_from = lambda: diverged[0]

    def steps() -> list[int]:
        return [s for s, _, ok in mf.checkpoints(str(tmp_path)) if ok]

    for step in (2, 4):
        job.begin(step)
        job.commit(step, manifest(step))
    assert steps() == [4] and not said
    diverged[0] = 5  # step index 5 (the progress line's step 6) was not finite: step-4's weights came before it
    for step in (6, 8, 10):
        job.begin(step)
        job.commit(step, manifest(step))
        assert steps() == [4, step]
    assert said == [f"maestro: --keep-last keeps {mf.step_dir(str(tmp_path), 4)} too: the newest checkpoint from "
                    "before step 6, whose loss or gradient norm was not finite"]  # once
    job.close()
    ck._CLAIMED = None


def test_a_sigterm_before_training_under_checkpoint_on_term_is_said_to_have_saved_nothing(tmp_path):
    """Found in QA: a SIGTERM during a slow startup said "interrupted", not why nothing was saved."""
    job = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2, on_term=True), log=lambda text: None)
    job.claim(None, {**PIPELINE.to_dict(), "steps": 6})
    none = f"checkpoints: none complete in {tmp_path} yet"
    assert job.go_on_note() == none
    assert not job.take_term()  # startup: stops at once
    assert job.go_on_note() == ("--checkpoint-on-term: the SIGTERM came while no training was under way (startup, "
                                f"a restart or the final save), so no checkpoint was written for it\n{none}")
    job.term_untaken, job.training = False, True
    assert job.take_term() and not job.take_term()  # the first is taken; a second stops at once, as documented
    assert job.go_on_note() == none
    job.resumed_from = "/else where/step-00000002"  # found in QA: a path with a space broke the command
    assert job.go_on_note().endswith("(--resume '/else where/step-00000002')")
    job.close()
    plain = Checkpointer(CheckpointOptions(dir=str(tmp_path / "b"), every=2), log=lambda text: None)
    assert not plain.take_term() and not plain.term_untaken  # the option off: an interrupt, nothing to explain
    from maestro_flow.checkpoint import checkpointer as ck

    ck._CLAIMED = None


def test_the_checkpoint_before_a_damaged_one_is_given_with_what_to_run(tmp_path):
    """Found in QA: a damaged checkpoint's export was advised to --resume from the one before."""
    before = save(tmp_path, 2)
    after = save(tmp_path, 4)
    assert mf.earlier(after, move=False) == f"; the complete checkpoint before it: {before} (--resume {before})"
    assert mf.earlier(after, move=False, use="maestro export {} --section lm") == (
        f"; the complete checkpoint before it: {before} (maestro export {before} --section lm)")


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]"], ids=["json", "binary", "list"])
def test_a_damaged_manifest_names_the_checkpoint_before_it(tmp_path, content):
    """Found in QA: a damaged manifest.json in the newest checkpoint named no checkpoint to go back
    to (and bytes that are not text gave a traceback: UnicodeDecodeError was not caught)."""
    from maestro_flow.checkpoint.checkpointer import resume_point

    before = save(tmp_path, 2)
    (Path(save(tmp_path, 4)) / mf.MANIFEST).write_bytes(content)
    with pytest.raises(PipelineError, match=rf"step-00000004/manifest.json: unreadable checkpoint manifest \(.*\); "
                                            rf"the complete checkpoint before it: {before} \(--resume {before}\)$"):
        resume_point(str(tmp_path))  # (an unreadable manifest is no checkpoint past it: nothing to move away)
    job = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=2))
    job.claim(mf.read(before), PIPELINE.to_dict())  # accepted with the damaged one there
    job.close()
    with pytest.raises(PipelineError, match="unreadable checkpoint manifest"):
        resume_point(str(tmp_path))


def test_a_hugging_face_export_folder_takes_no_other_section(tmp_path):
    """Found in QA: exporting a second section into the folder of another's Hugging Face export
    overwrote its config.json and model.safetensors, or left them beside the new file."""
    from safetensors.torch import save_file

    from maestro_flow.checkpoint.export import _one_model_folder

    out = tmp_path / "out"
    out.mkdir()
    save_file({"w": torch.zeros(1)}, str(out / "student.safetensors"), metadata={"section": "student"})
    _one_model_folder(str(out), "teacher")  # another section's raw file alone: no model to overwrite
    (out / "config.json").write_text("{}")
    _one_model_folder(str(out), "student")  # the same section again: a re-export
    with pytest.raises(PipelineError, match=r"holds section 'student''s Hugging Face export .* export section "
                                            r"'teacher' into a folder of its own"):
        _one_model_folder(str(out), "teacher")


def test_export_refuses_a_folder_holding_both_saved_weights_and_checkpoints(tmp_path):
    """Found in QA: with --save-dir the same folder as --checkpoint-dir, `maestro export` of it
    gave the saved weights of step 2 though a checkpoint of step 4 was there, saying only "from
    ...student.safetensors"; and an export into a checkpoint folder made it unexportable."""
    import json

    from click.testing import CliRunner

    from maestro_flow.checkpoint.savedir import PIPELINE_FILE
    from maestro_flow.cli import main

    save(tmp_path, 4)
    (tmp_path / "student.safetensors").write_bytes(b"a --save-dir's")
    (tmp_path / PIPELINE_FILE).write_text(json.dumps(PIPELINE.to_dict()))
    both = CliRunner().invoke(main, ["export", str(tmp_path), "--section", "student", "-o", str(tmp_path / "out")])
    assert both.exit_code == 2, both.output
    assert both.stderr.strip() == (f"error: {tmp_path} holds both student.safetensors (a --save-dir's or an export's) "
                                   "and checkpoints: "
                                   f"export {mf.step_dir(str(tmp_path), 4)} for the newest checkpoint, or move "
                                   f"student.safetensors and {PIPELINE_FILE} to a folder of their own for the saved "
                                   "weights")
    into = CliRunner().invoke(main, ["export", str(tmp_path / "elsewhere"), "--section", "student", "-o", str(tmp_path)])
    assert into.exit_code == 2 and (f"-o {tmp_path} holds checkpoints (step-00000004): export into a folder of its own"
                                    in into.stderr), into.stderr
    step = CliRunner().invoke(main, ["export", str(tmp_path / "elsewhere"), "--section", "student", "-o",
                                     mf.step_dir(str(tmp_path), 4)])
    assert step.exit_code == 2 and f"-o {mf.step_dir(str(tmp_path), 4)} is a checkpoint: export" in step.stderr, \
        step.output


@pytest.mark.parametrize("same", [True, False, "step"])
def test_run_refuses_a_save_dir_that_is_or_holds_checkpoints(tmp_path, same):
    """The same finding at its source: `maestro run` refuses, before any worker starts, a
    --save-dir that is the --checkpoint-dir or already holds checkpoints."""
    from click.testing import CliRunner

    from maestro_flow.cli import main

    root = Path(__file__).resolve().parents[2]
    ckpt = tmp_path / "ckpt"
    if same is not True:
        save(ckpt, 2)
    target = mf.step_dir(str(ckpt), 2) if same == "step" else str(ckpt)  # found in review: a checkpoint itself passed
    args = ["run", str(root / "pipelines" / "distill.py"), "--no-run-dir", "--save-dir", target]
    if same is True:
        args += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    want = {True: f"--save-dir and --checkpoint-dir are one folder ({ckpt})",
            False: f"--save-dir {ckpt} holds checkpoints (step-00000002)",
            "step": f"--save-dir {target} is a checkpoint"}[same]
    assert want in result.stderr and "give --save-dir a folder of its own" in result.stderr, result.output


def test_run_refuses_a_save_dir_holding_weights_it_does_not_write(tmp_path):
    """Found in QA: a --save-dir holding another pipeline's weights (chain's embed and lm) took a
    distill run's student.safetensors and pipeline.json beside them, in silence; only a later
    export said the others were left from an earlier run. Its own section's file is not named."""
    from click.testing import CliRunner

    from loaders.demo import build_text_demo
    from maestro_flow.cli import main

    root = Path(__file__).resolve().parents[2]
    data = build_text_demo(tmp_path / "data", num_samples=16, parquet=False)
    out = tmp_path / "save"
    out.mkdir()
    (out / "lm.safetensors").write_bytes(b"chain's")
    (out / "embed.safetensors").write_bytes(b"chain's")
    (out / "student.safetensors").write_bytes(b"an earlier distill run's")
    result = CliRunner().invoke(main, ["run", str(root / "pipelines" / "distill.py"), "--no-run-dir", "--save-dir",
                                       str(out), "--set", f"data.path={data}"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: --save-dir {out} holds embed.safetensors, lm.safetensors, which this run does not write (it "
        "trains student): its pipeline.json would no longer describe them; give --save-dir a folder of its own, or "
        "move them away"), result.output
    # A file a section's config loads (a frozen teacher's weights, saved when it trained) stays (review).
    weights = out / "lm.safetensors"
    again = CliRunner().invoke(main, ["run", str(root / "pipelines" / "distill.py"), "--no-run-dir", "--save-dir",
                                      str(out), "--set", f"data.path={data}", "--set",
                                      f"sections.teacher.config.checkpoint={weights}", "--set",
                                      f"sections.student.config.teacher.checkpoint={weights}"])
    assert "holds embed.safetensors, which this run does not write" in again.stderr, again.output


def test_failed_saves_leave_at_most_the_newest_incomplete_folder(tmp_path):
    """Found in QA: with --checkpoint-errors continue and every save too slow, the workers wrote on
    into each discarded folder, and step-1..4 all stayed (incomplete) until a save succeeded."""
    go_on = Checkpointer(CheckpointOptions(dir=str(tmp_path), every=1, on_error="continue"), log=lambda text: None)
    for step in (1, 2, 3):
        folder = go_on.begin(step)
        go_on.failed(step, {"rank 0": "too slow"})
        os.makedirs(os.path.join(folder, "student"))  # what its workers wrote after the discard
    assert [s for s, _, _ in mf.checkpoints(str(tmp_path))] == [3]
    go_on.begin(4)
    go_on.commit(4, manifest(4))
    assert [(s, ok) for s, _, ok in mf.checkpoints(str(tmp_path))] == [(4, True)]
    # Judged by step, not by name (found in review): an unpadded later step sorts before by name.
    os.makedirs(tmp_path / "step-00000000030")
    go_on.begin(20)
    assert [s for s, _, _ in mf.checkpoints(str(tmp_path))] == [4, 20, 30]


def test_a_save_dir_is_held_by_one_run(tmp_path):
    """Found in QA: two runs given one --save-dir both said they saved; one's weights were lost,
    or another pipeline's stood beside them. The second is refused before it starts; a folder the
    run made and left empty goes with it."""
    from maestro_flow.runtime.outputs import SAVE_LOCK, hold_save_dir, release_save_dir

    made, kept = tmp_path / "made", tmp_path / "kept"
    kept.mkdir()
    hold_save_dir(str(made))
    hold_save_dir(str(kept))
    try:
        for folder in (made, kept):
            with pytest.raises(PipelineError, match=f"^--save-dir {folder} is in use by a run still going "
                                                    rf"\(it holds {SAVE_LOCK} there\): give each run a --save-dir"):
                hold_save_dir(str(folder))  # another open of the lock: what a second run does
    finally:
        release_save_dir()
    assert not made.exists() and sorted(p.name for p in kept.iterdir()) == [SAVE_LOCK]  # not made here: kept
    hold_save_dir(str(kept))  # free again
    (kept / "lm.safetensors").write_bytes(b"")
    release_save_dir()
    assert (kept / "lm.safetensors").exists()
    hold_save_dir(str(tmp_path / "a" / "b" / "c"))  # every folder it made goes (found in review: the last only)
    release_save_dir()
    assert not (tmp_path / "a").exists()


def test_a_folder_that_is_two_outputs_keeps_its_locks_in_place(tmp_path):
    """Found in review: --run-dir and --save-dir one folder: the run dir moved the save dir's lock
    aside with an earlier run's files, so a second run could take the folder (and a fresh one was
    said to hold an earlier run's files)."""
    from maestro_flow.runtime.outputs import SAVE_LOCK, hold_save_dir, release_save_dir
    from maestro_flow.runtime.rundir import set_aside

    both = tmp_path / "both"
    hold_save_dir(str(both))
    try:
        assert set_aside(str(both)) is None  # nothing of an earlier run: the lock is this run's
        (both / "old.txt").write_text("")
        aside = set_aside(str(both))
        assert sorted(os.listdir(aside)) == ["old.txt"] and (both / SAVE_LOCK).exists()
        with pytest.raises(PipelineError, match="is in use by a run still going"):
            hold_save_dir(str(both))
    finally:
        release_save_dir()


def test_a_folder_that_is_run_dir_and_checkpoint_dir_keeps_its_checkpoints_in_place(tmp_path):
    """Found in review: the run dir's set-aside moved the checkpoint folders of a --checkpoint-dir
    that is the same folder, the one being resumed among them."""
    from maestro_flow.runtime.outputs import CKPT_LOCK
    from maestro_flow.runtime.rundir import set_aside

    for name in ("step-00000004", CKPT_LOCK, "metrics.jsonl"):
        (tmp_path / name).mkdir() if name.startswith("step-") else (tmp_path / name).write_text("")
    aside = set_aside(str(tmp_path))
    assert os.listdir(aside) == ["metrics.jsonl"]
    assert (tmp_path / "step-00000004").is_dir() and (tmp_path / CKPT_LOCK).exists()


def test_outputs_that_name_one_file_are_refused(tmp_path):
    """Found in review: --trace and --metrics-out one file: each took the other for another run."""
    from maestro_flow.runtime.outputs import check_outputs, release_outputs
    from maestro_flow.runtime.run import RunOptions

    path = str(tmp_path / "m.jsonl")
    options = RunOptions(overrides={}, metrics_out=path, trace=path)
    try:
        with pytest.raises(PipelineError, match=f"^--trace and --metrics-out name one file \\({path}\\): give each its "
                                                "own$"):
            check_outputs(options, None, path)
    finally:
        release_outputs()


def test_a_damaged_manifest_names_the_export_to_run_on_the_one_before(tmp_path):
    """Found in review: `maestro export` of a checkpoint whose manifest is damaged advised --resume."""
    before = save(tmp_path, 2)
    (Path(save(tmp_path, 4)) / mf.MANIFEST).write_text("{not json")
    with pytest.raises(PipelineError, match=rf"the complete checkpoint before it: {before} \(maestro export {before} "
                                            r"--section lm -o DIR\)$"):
        mf.read(str(tmp_path / "step-00000004"), use="maestro export {} --section lm -o DIR")


def test_a_damaged_list_of_checksums_is_an_unreadable_manifest(tmp_path):
    """Found in review: a manifest whose "files" was not {path: [size, crc]} ended in a traceback."""
    from maestro_flow.checkpoint import manifest as mf

    for files in ({"student/.metadata": 5}, ["student/.metadata"], {"x": [1]}):
        mf.write(str(tmp_path), mf.Manifest(step=1, pipeline={}, sections={}, sampler={}, files={}))
        data = json.loads((tmp_path / mf.MANIFEST).read_text())
        (tmp_path / mf.MANIFEST).write_text(json.dumps({**data, "files": files}))
        with pytest.raises(PipelineError, match=r"unreadable checkpoint manifest \(its files are not \{path: "
                                                r"\[size, CRC-32\]\}\)"):
            mf.read(str(tmp_path))
