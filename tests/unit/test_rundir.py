"""Run directories and the outputs that must not take training down (runtime/rundir.py,
runtime/guard.py, runtime/report.py)."""

from __future__ import annotations

import json
import os
import threading

import pytest

from maestro_flow import ArrowData, Pipeline, Section
from maestro_flow.errors import Diverged
from maestro_flow.runtime.guard import WriteGuard
from maestro_flow.runtime.report import RunReport
from maestro_flow.runtime.rundir import RunDir, default_run_dir

PIPELINE = Pipeline(name="p", data=ArrowData(path="d.arrow"),
                    sections=[Section(name="lm", stage="stages.lm:CausalLM")])


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    paths: list[str] = []
    threads = [threading.Thread(target=lambda: paths.append(default_run_dir(PIPELINE, str(tmp_path))))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 8 and all(os.path.isdir(p) for p in paths)


def test_a_default_run_dir_that_cannot_be_made_is_one_line(tmp_path):
    """Found in QA: a read-only working folder ended `maestro run` in a traceback (exit 1)."""
    from maestro_flow.errors import PipelineError

    (tmp_path / "file").write_text("")
    with pytest.raises(PipelineError, match=rf"^{tmp_path / 'file' / 'runs'}: cannot create a run directory there "
                                            r"\(Not a directory\): pass --run-dir DIR somewhere writable, or "
                                            r"--no-run-dir$"):
        default_run_dir(PIPELINE, str(tmp_path / "file" / "runs"))


def test_a_reused_run_dir_sets_the_earlier_run_aside(tmp_path):
    path = str(tmp_path / "run")
    first = RunDir(path, PIPELINE, {})
    first.event({"what": "first"})
    with open(os.path.join(path, "workers", "lm-0.log"), "w") as f:
        f.write("first run\n")
    first.close()
    second = RunDir(path, PIPELINE, {})
    second.close()
    assert second.set_aside == os.path.join(path, "previous-1")
    assert open(os.path.join(path, "previous-1", "workers", "lm-0.log")).read() == "first run\n"
    assert json.loads(open(os.path.join(path, "previous-1", "events.jsonl")).read())["what"] == "first"
    assert os.listdir(os.path.join(path, "workers")) == []  # nothing of the first run is appended to
    assert not os.path.exists(os.path.join(path, "events.jsonl"))
    assert RunDir(path, PIPELINE, {}).set_aside == os.path.join(path, "previous-2")


def test_plans_jsonl_is_written_only_by_a_run_that_plans(tmp_path):
    """Found in QA: another node's folder (an agent's, which plans nothing) held an empty plans.jsonl."""
    agent = RunDir(str(tmp_path / "node-1"), PIPELINE, {})
    agent.close()
    assert sorted(os.listdir(tmp_path / "node-1")) == [".lock", "pipeline.json", "workers"]
    coordinator = RunDir(str(tmp_path / "run"), PIPELINE, {})
    coordinator.plan({"step": 0})
    coordinator.close()
    coordinator.plan({"step": 1})  # after the job: dropped
    assert [json.loads(line) for line in open(tmp_path / "run" / "plans.jsonl")] == [{"step": 0}]


def test_a_full_disk_drops_the_output_and_says_so_once():
    said: list[str] = []
    guard = WriteGuard("metrics to /dev/full", said.append)
    with open("/dev/full", "wb", buffering=0) as f:
        for _ in range(3):
            assert not guard(f.write, b"x" * 10)
    assert said == ["maestro: cannot write metrics to /dev/full (No space left on device); the run goes on "
                    "without it"]


def test_metrics_on_a_full_disk_do_not_stop_the_report(capsys):
    report = RunReport(total_steps=2, metrics_out="/dev/full", show_progress=False)
    for step in range(2):
        report.step({"step": step, "loss": 1.0, "step_time_s": 0.1, "sections": {}})
    report.close()
    assert len(report.rows) == 2
    assert capsys.readouterr().err.count("cannot write metrics to /dev/full") == 1
    # found in QA: said once mid-run, then nothing: the summary says it too
    assert report.summary().endswith("\nmetrics to /dev/full: stopped at step 1 (No space left on device); the file "
                                      "lacks that step and the later ones")


def test_a_metrics_row_is_strict_json_and_written_whole_or_not_at_all(tmp_path):
    """Found in QA: a NaN loss was written as NaN (not JSON outside Python), and a full disk left
    half a row, which the next row then followed on the same line."""
    import errno

    from maestro_flow.runtime.report import _write_line, json_line

    assert json_line({"step": 1, "loss": float("nan"), "sections": {"a": {"grad_norm": float("inf")}},
                      "l": [float("-inf"), 1.5]}) == b'{"step": 1, "loss": null, "sections": {"a": {"grad_norm": null}}, "l": [null, 1.5]}\n'
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 0}\n')

    class HalfThenFull:  # what a disk filling up mid-write does: part of the bytes, then ENOSPC
        def __init__(self, f):
            self.f, self.calls = f, 0

        def fileno(self):
            return self.f.fileno()

        def write(self, data):
            self.calls += 1
            if self.calls > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(bytes(data[:7]))

    with open(path, "ab", buffering=0) as f, pytest.raises(OSError, match="No space"):
        _write_line(HalfThenFull(f), b'{"step": 1, "loss": 2.0}\n')
    assert path.read_bytes() == b'{"step": 0}\n'


def test_two_runs_given_one_metrics_file_the_second_is_refused(tmp_path):
    """Found in QA: two runs given the same --metrics-out cut each other's rows into one file."""
    from maestro_flow.errors import PipelineError

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "loss": 9.0}\n')  # an earlier run's: a fresh run starts the file again
    first = RunReport(total_steps=2, metrics_out=str(path), show_progress=False)
    with pytest.raises(PipelineError, match=f"--metrics-out {path}: another run is writing this file"):
        RunReport(total_steps=2, metrics_out=str(path), show_progress=False)
    first.step({"step": 0, "loss": 1.0, "step_time_s": 0.1, "sections": {}})
    first.close()
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [1.0]
    os.link(path, tmp_path / "hard.jsonl")
    again = RunReport(total_steps=1, metrics_out=[str(path), str(tmp_path / "." / "m.jsonl"), str(tmp_path / "hard.jsonl")],
                      show_progress=False)
    again.step({"step": 0, "loss": 3.0, "step_time_s": 0.1, "sections": {}})  # one file, given thrice: written once
    again.close()
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [3.0]
    # Found in review: a refusal of a later file came after the earlier ones were emptied.
    other = tmp_path / "other.jsonl"
    holder = RunReport(total_steps=1, metrics_out=str(other), show_progress=False)
    with pytest.raises(PipelineError, match="other.jsonl: another run"):
        RunReport(total_steps=1, metrics_out=[str(path), str(other)], show_progress=False)
    holder.close()
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [3.0]  # not emptied
    # A resumed run cuts the rows from its step on, rewriting nothing before them.
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 3.0}\n')
    inode = path.stat().st_ino
    resumed = RunReport(total_steps=3, metrics_out=str(path), show_progress=False, resume_at=1)
    resumed.close()
    assert path.read_text() == '{"step": 0, "loss": 1.0}\n' and path.stat().st_ino == inode


def test_a_metrics_file_is_held_from_the_first_check_to_the_report(tmp_path):
    """Found in review: the check before a run set anything up let go of the lock, so a second run
    starting then passed it and was refused only after its run dir had moved files aside."""
    import subprocess
    import sys

    from maestro_flow.errors import PipelineError
    from maestro_flow.runtime.report import hold, release_held

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0, "loss": 9.0}\n')
    probe = ("import fcntl, sys; f = open(sys.argv[1], 'ab')\n"
             "try: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError: sys.exit(7)")
    other_run = [sys.executable, "-c", probe, str(path)]  # another process: what a second run finds
    hold(str(path))
    assert subprocess.run(other_run).returncode == 7  # held between the check and the report
    report = RunReport(total_steps=1, metrics_out=str(path), show_progress=False)  # takes it over, locked
    assert subprocess.run(other_run).returncode == 7
    report.step({"step": 0, "loss": 1.0, "step_time_s": 0.1, "sections": {}})
    report.close()
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [1.0]
    assert subprocess.run(other_run).returncode == 0
    hold(str(path))  # a run refused before its report: released with it
    release_held()
    assert subprocess.run(other_run).returncode == 0
    hold(str(tmp_path / "none.jsonl"))  # not there: nothing held, nothing made
    assert not (tmp_path / "none.jsonl").exists()
    holder = RunReport(total_steps=1, metrics_out=str(path), show_progress=False)
    with pytest.raises(PipelineError, match="m.jsonl: another run is writing this file"):
        hold(str(path))
    holder.close()


def test_the_summary_gives_the_stage_counters_of_the_run():
    """Found in QA: the corrupt images a run skipped (decode.skip_corrupt) were in its metrics
    only. Stage.stats are running totals: the last step's are the run's; zero ones are left out."""
    report = RunReport(total_steps=2, metrics_out=None, show_progress=False)
    for step, skipped in enumerate((2, 5)):
        report.step({"step": step, "loss": 1.0, "step_time_s": 0.1,
                     "sections": {"vision": {"stage": {"corrupt_images": skipped, "other": 0}}, "llm": {}}})
    assert report.summary().endswith("\nstage counters: vision corrupt_images 5")
    report.step({"step": 1, "loss": 1.0, "step_time_s": 0.1, "restarts": 1,  # step 1 again, after a restart
                 "sections": {"vision": {"stage": {"corrupt_images": 3}}}})
    assert report.summary().startswith("2 steps (1 replayed after restarts) in ")  # found in QA: "3 steps"
    assert report.summary().endswith("\nstage counters: vision corrupt_images 3")  # the row's (ledger.carry_counters)


def test_the_busy_table_leaves_out_the_first_step_after_each_start():
    """Found in QA: the table summed step 0, which holds the workers' start (an encoder's first
    step), and showed a 93%-busy LLM as 75% busy."""
    report = RunReport(total_steps=4, metrics_out=None, show_progress=False)
    assert report.table() == ""

    def row(step, busy, idle, restarts=0):
        return {"step": step, "loss": 1.0, "step_time_s": 0.1, "restarts": restarts,
                "sections": {"llm": {"busy_s": busy, "idle_s": idle}}}

    report.step(row(0, 1.0, 3.0))
    assert report.table().splitlines()[1].split() == ["llm", "25.0%", "75.0%", "0.0%"]  # one step: it is all there is
    report.step(row(1, 9.0, 1.0))
    report.step(row(2, 9.0, 1.0))
    llm, note = report.table().splitlines()[1:]
    assert llm.split() == ["llm", "90.0%", "10.0%", "0.0%"]
    assert note == "(over 2 of the 3 steps run: not counting the first after each start of the workers)"
    report.step(row(2, 1.0, 3.0, restarts=1))  # an automatic restart replays step 2: its workers start again
    report.step(row(3, 7.0, 3.0, restarts=1))
    llm, note = report.table().splitlines()[1:]
    assert llm.split() == ["llm", "83.3%", "16.7%", "0.0%"]
    assert note == "(over 3 of the 5 steps run: not counting the first after each start of the workers)"  # step 2 ran twice


def test_stage_counters_are_carried_from_the_checkpoint_a_run_resumed_from():
    """Found in review: a restart or a resume started every stage counter again at 0."""
    from maestro_flow.checkpoint.manifest import Manifest
    from maestro_flow.runtime.ledger import carry_counters

    row = {"sections": {"vision": {"stage": {"corrupt_images": 2}}, "llm": {}}}
    carry_counters(row, {"vision": {"corrupt_images": 5, "retries": 1}, "llm": {"dropped": 4}, "gone": {"x": 1}})
    assert row["sections"] == {"vision": {"stage": {"corrupt_images": 7, "retries": 1}}, "llm": {"stage": {"dropped": 4}}}
    kept = Manifest(step=3, pipeline={}, sections={}, sampler={}, counters={"vision": {"corrupt_images": 7}})
    assert Manifest.from_dict(json.loads(kept.to_json())).counters == {"vision": {"corrupt_images": 7}}
    older = {k: v for k, v in json.loads(kept.to_json()).items() if k != "counters"}  # written before counters were
    assert Manifest.from_dict(older).counters == {}


@pytest.mark.parametrize("show", [True, False])
def test_a_loss_that_is_not_finite_is_warned_about_once(capsys, show):
    # Found by review: a NaN loss trained to the end, printed as "loss nan -> nan", exit 0, no word.
    report = RunReport(total_steps=5, metrics_out=None, show_progress=show)
    rows = [{"loss": 2.0, "grad_norm": 1.0}, {"loss": 1.5, "grad_norm": float("inf")},
            {"loss": float("nan"), "grad_norm": float("nan")}, {"loss": {"a": 1.0, "b": float("nan")}, "grad_norm": None}]
    for step, row in enumerate(rows):
        report.step({"step": step, "step_time_s": 0.1, "sections": {}, **row})
    err = capsys.readouterr().err
    assert err.count("warning") == 1
    # Counted from 1, as the progress line counts (found in QA: "step 1: loss nan" under "step 2/4 loss nan")
    assert "maestro: warning: step 2: gradient norm inf is not finite" in err and "--stop-on-nan stops it" in err
    assert report.summary().endswith("(not finite from step 2)")
    clean = RunReport(total_steps=1, metrics_out=None, show_progress=show)
    clean.step({"step": 0, "step_time_s": 0.1, "sections": {}, "loss": {"a": 1.0}, "grad_norm": None})
    assert "warning" not in capsys.readouterr().err and "not finite" not in clean.summary()


def test_stop_on_nan_raises_once_the_row_is_written(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    report = RunReport(total_steps=5, metrics_out=str(metrics), show_progress=False, stop_on_nan=True)
    finite = {"step": 0, "step_time_s": 0.1, "sections": {}, "loss": 2.0, "grad_norm": 1.0}
    nan = {**finite, "step": 1, "loss": {"a": 1.0, "b": float("nan")}}
    assert not report.stops_at(finite) and report.stops_at(nan)
    report.step(finite)
    with pytest.raises(Diverged, match=r"^step 2: loss nan is not finite; the run stopped \(--stop-on-nan\)"):
        report.step(nan)
    report.close()
    assert [json.loads(line)["loss"] for line in metrics.read_text().splitlines()] == [2.0, {"a": 1.0, "b": None}]
    assert "warning" not in capsys.readouterr().err  # the error says it, once
    assert not RunReport(total_steps=1, metrics_out=None, show_progress=False).stops_at(nan)  # the default: warn


@pytest.mark.parametrize("show", [True, False])
def test_a_trainable_section_whose_gradient_is_all_zero_is_warned_about_once(capsys, show):
    """Found in review: a distill teacher set trainable (its student reads its outputs under
    no_grad) trained nothing, saved its weights unchanged, and nothing said so."""
    report = RunReport(total_steps=6, metrics_out=None, show_progress=show)
    sections = [{"teacher": {"samples": 8, "grad_norm": 0.0}, "vision": {"samples": 1, "grad_norm": 0.0}},
                {"teacher": {"samples": 0, "grad_norm": 0.0}, "vision": {"samples": 2, "grad_norm": 0.5}},
                {"teacher": {"samples": 8, "grad_norm": 0.0}, "vision": {"samples": 0, "grad_norm": 0.0}},
                {"teacher": {"samples": 8, "grad_norm": 0.0}, "vision": {"samples": 1, "grad_norm": 0.0}},
                {"student": {"samples": 8}}]  # frozen: no grad_norm
    for step, secs in enumerate(sections):
        report.step({"step": step, "loss": 1.0, "grad_norm": 1.0, "step_time_s": 0.1, "sections": secs})
    err = capsys.readouterr().err
    # The teacher: zero in every step it ran samples (0, 2, 3), warned of once. The vision section
    # (its only image skipped as corrupt in step 0, say) had a gradient in between: not judged
    # on one step alone.
    assert err.count("warning") == 1, err
    assert ("maestro: warning: step 3: section 'teacher' is trainable but its gradient has been all zero for 2 steps "
            "(the loss does not reach its parameters") in err
    zero = RunReport(total_steps=3, metrics_out=None, show_progress=show)  # found in QA: rows of one token
    for step in range(2):
        zero.step({"step": step, "loss": {"student": 0.0}, "grad_norm": 0.0, "step_time_s": 0.1,
                   "sections": {"student": {"samples": 8, "grad_norm": 0.0}}})
    err = capsys.readouterr().err
    assert "gradient has been all zero for 2 steps (the loss is exactly 0: do the samples hold anything" in err, err


def test_a_run_dir_that_a_live_run_uses_is_refused(tmp_path):
    """Reproduced before: a second `maestro run --run-dir R` moved the running first run's
    status.json and metrics to R/previous-1 (top then said it was not running). Refused now,
    naming the live run's pid; a run dir whose run is gone is set aside as before."""
    import pytest

    from maestro_flow.errors import PipelineError

    path = tmp_path / "run"
    path.mkdir()
    other = os.getppid()  # a live process that is not this one: the run that uses the folder
    (path / "status.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": other}))
    (path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(PipelineError, match=rf"--run-dir {path} is in use by a run still going \(pid {other}\)"):
        RunDir(str(path), PIPELINE, {})
    assert sorted(os.listdir(path)) == ["metrics.jsonl", "status.json"]  # nothing moved, nothing written
    (path / "status.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": None}))
    reused = RunDir(str(path), PIPELINE, {})  # a stale status file: the folder is free
    reused.close()
    assert sorted(os.listdir(path / "previous-1")) == ["metrics.jsonl", "status.json"]


def test_the_job_removes_its_own_status_file_only(tmp_path):
    """status.json is the job's: its RunDir removes it when the job is over (an attempt's status
    server leaves it, runtime/status.py), and never a file another run wrote."""
    path = tmp_path / "run"
    mine = RunDir(str(path), PIPELINE, {})
    (path / "status.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": os.getpid()}))
    mine.close()
    assert not (path / "status.json").exists()
    mine = RunDir(str(path), PIPELINE, {})
    (path / "status.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": os.getpid() + 10**7}))
    mine.close()
    assert (path / "status.json").exists()


def test_of_two_runs_starting_together_in_one_folder_the_second_is_refused(tmp_path):
    """Reproduced before: the refusal read status.json, which a run writes only once its
    coordinator starts; a second run in that window moved the first's files aside. The folder's
    lock is taken before anything moves."""
    import pytest

    from maestro_flow.errors import PipelineError

    path = tmp_path / "run"
    first = RunDir(str(path), PIPELINE, {})
    before = sorted(os.listdir(path))
    with pytest.raises(PipelineError, match=r"is in use by a run still going \(it holds \.lock there\)"):
        RunDir(str(path), PIPELINE, {})
    assert sorted(os.listdir(path)) == before  # nothing moved aside
    first.close()
    second = RunDir(str(path), PIPELINE, {})  # free again
    second.close()
    assert "pipeline.json" in os.listdir(path / "previous-1") and ".lock" not in os.listdir(path / "previous-1")


def test_a_resumed_run_goes_on_with_its_metrics_file(tmp_path):
    """Found in review: the same command with --resume started --metrics-out again, erasing the
    rows of every step before the checkpoint (a multi-day job's loss curve up to the crash)."""
    import io
    import json

    from maestro_flow.runtime.report import RunReport

    path = tmp_path / "m.jsonl"
    first = RunReport(total_steps=6, metrics_out=str(path), stream=io.StringIO(), show_progress=False)
    for step in range(5):  # the run got to step 4; its checkpoint is at step 3
        first.step({"step": step, "loss": 1.0})
    first.close()
    with open(path, "a") as f:
        f.write("not a row\n")
    resumed = RunReport(total_steps=6, metrics_out=str(path), stream=io.StringIO(), show_progress=False, resume_at=3)
    for step in (3, 4, 5):
        resumed.step({"step": step, "loss": 0.5})
    resumed.close()
    lines = path.read_text().splitlines()
    assert lines[3] == "not a row"
    rows = [json.loads(line) for line in lines if line != "not a row"]
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 0.5), (4, 0.5), (5, 0.5)]


def test_a_restart_replaces_the_rows_past_its_checkpoint(tmp_path):
    """Found in QA: after an automatic restart (--max-restarts) the metrics files held the steps
    since the checkpoint twice, where --resume replaces them; the summary still counts them."""
    import io
    import json

    from maestro_flow.runtime.report import RunReport

    paths = [tmp_path / "m.jsonl", tmp_path / "run" / "metrics.jsonl"]
    paths[1].parent.mkdir()
    report = RunReport(total_steps=6, metrics_out=[str(p) for p in paths], stream=io.StringIO(), show_progress=False)
    for step, restarts in ((0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (3, 1), (4, 1), (5, 1)):  # back to step 3
        report.step({"step": step, "loss": 1.0 + restarts, "step_time_s": 0.1, "restarts": restarts})
    report.close()
    for path in paths:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [(r["step"], r["restarts"]) for r in rows] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert report.summary().startswith("6 steps (2 replayed after restarts) in ")


def test_each_row_and_progress_line_gives_its_epoch(tmp_path):
    """Found in QA: a multi-epoch run said its epoch in no metrics row and no progress line."""
    import io
    import json

    from maestro_flow.runtime.report import RunReport

    path, out = tmp_path / "m.jsonl", io.StringIO()
    report = RunReport(total_steps=5, metrics_out=str(path), stream=out, batches_per_epoch=3)
    for step in range(5):
        report.step({"step": step, "loss": 1.0, "step_time_s": 0.1})
    report.close()
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [0, 0, 0, 1, 1]
    assert "step 5/5  loss 1.0000  epoch 2/2  0.100 s/step" in out.getvalue()
    one = io.StringIO()  # a run within one epoch: the line does not say it
    RunReport(total_steps=2, metrics_out=None, stream=one, batches_per_epoch=3).step(
        {"step": 0, "loss": 1.0, "step_time_s": 0.1})
    assert "epoch" not in one.getvalue()


def test_a_fifo_given_as_metrics_file_gets_the_rows(tmp_path):
    """Found in review: the check before a run opened a FIFO and closed it, ending its reader's
    input, and the report then waited for a reader forever (reading it for the lock hung as well)."""
    from maestro_flow.runtime.report import hold, release_held

    fifo = tmp_path / "m.fifo"
    os.mkfifo(fifo)
    got = []

    def read():
        with open(fifo, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    hold(str(fifo))  # returns at once: not a regular file, nothing to lock
    reader.join(0.5)
    assert reader.is_alive(), got  # its input not ended (before: b"", and the report then waited for a reader)
    report = RunReport(total_steps=1, metrics_out=str(fifo), show_progress=False)
    report.step({"step": 0, "loss": 1.0, "step_time_s": 0.1, "sections": {}})
    report.close()
    release_held()
    reader.join(10)
    assert [json.loads(line)["loss"] for line in got[0].decode().splitlines()] == [1.0]
