"""`maestro stage` helpers without running a stage: --steps parsing, synthetic sample picking,
`--compare` of numbers, the run-settings note (runtime/replay.py, replay_runner.py, replay_report.py)."""

from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path

import pytest
import torch

from maestro_flow.runtime.build import load_pipeline
from maestro_flow.runtime.replay_runner import ReplayError
from maestro_flow.samples import SampleMeta

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def test_step_ranges_stay_ranges():
    """Found in review: "2-999999999" was expanded into a set of a billion ints (MemoryError,
    blamed on the stage). A range costs two numbers now, whatever its length."""
    from maestro_flow.runtime.replay import parse_steps

    tracemalloc.start()
    try:
        steps = parse_steps("0-2000000")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"parse_steps took {peak:,} bytes for one range"
    assert 2_000_000 in steps and 2_000_001 not in steps
    huge = parse_steps("2-999999999")
    assert 2 in huge and 999_999_999 in huge and 1 not in huge and 10**9 not in huge
    mixed = parse_steps("0, 4-7,9")
    assert [s for s in range(12) if s in mixed] == [0, 4, 5, 6, 7, 9]
    assert str(mixed) == "0,4-7,9"
    assert parse_steps(None) is None
    for bad in ("7-3", "x", "-3", "1-2-3", ",", "", " "):  # (found in QA: "" was taken as every step)
        with pytest.raises(ReplayError, match="--steps"):
            parse_steps(bad)


def test_a_replay_names_the_micro_batches_a_recording_lacks(tmp_path):
    """Found in QA: a recording with a micro-batch removed (or one that stopped part-way) replayed
    and compared as complete. What the run ran comes from plans.jsonl at a step it finished
    (metrics.jsonl), else up to the last index (found in review: a failed step's unrun rest)."""
    import json

    from maestro_flow.runtime.replay import _missing

    def rec(step, replica, index):
        return step, replica, index, "folder", "file"

    recorded = [rec(0, 0, 0), rec(0, 0, 1), rec(0, 0, 3), rec(0, 1, 0), rec(1, 0, 0)]
    assert _missing(str(tmp_path), "s", recorded) == {(0, 0): [2]}  # no plans.jsonl: the gap below index 3
    plans = [{"step": 0, "sections": {"s": {"replicas": [[[1]] * 4, [[2]] * 2]}}},
             {"step": 1, "sections": {"s": {"replicas": [[[3]], [[4]]]}}}]
    (tmp_path / "plans.jsonl").write_text("".join(json.dumps(p) + "\n" for p in plans) + '{"step": 2, "cut')
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 2.0}\n')  # the run failed in step 1
    assert _missing(str(tmp_path), "s", recorded) == {(0, 0): [2], (0, 1): [1]}
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 2.0}\n{"step": 1, "loss": 1.9}\n{"cut')
    assert _missing(str(tmp_path), "s", recorded) == {(0, 0): [2], (0, 1): [1], (1, 1): [0]}
    # Found in review: an automatic restart planned step 1 again (replica 1 given two micro-batches)
    # and failed in it; the earlier attempt's row is not this plan's.
    again = {"step": 1, "sections": {"s": {"replicas": [[[3]], [[4], [5]]]}}}
    with open(tmp_path / "plans.jsonl", "a") as f:
        f.write("\n" + json.dumps(again) + "\n")
    assert _missing(str(tmp_path), "s", recorded) == {(0, 0): [2], (0, 1): [1]}
    assert _missing(str(tmp_path), "s", [r for r in recorded if r[1] == 0]) == {(0, 0): [2]}  # --replica 0


def _meta(i: int, *mods: str) -> SampleMeta:
    return SampleMeta(id=i, row=i, modalities=frozenset({"text", *mods}))


def test_synthetic_samples_cover_every_producer():
    """Found in review: with two producers (vision, audio) and room for two samples, adding the
    audio sample evicted the image one, so the image input was never exercised."""
    from maestro_flow.graph import SectionGraph
    from maestro_flow.runtime.replay_runner import _pick_samples

    pipeline, _ = load_pipeline(str(PIPELINES / "multimodal.py"), {})
    graph = SectionGraph(pipeline)
    meta = [_meta(0), _meta(1), _meta(2), _meta(3, "image"), _meta(4), _meta(5, "audio"), _meta(6, "image")]

    def ids(n: int, samples=meta) -> list[int]:
        return [s.id for s in _pick_samples(graph, "llm", samples, n)]

    assert ids(2) == [3, 5]  # one per producer, text-only ones make room
    assert ids(3) == [0, 3, 5]
    assert ids(6) == [0, 1, 2, 3, 4, 5]  # the first six already hold both
    assert ids(1) == [3]  # no room for both: the first producer's
    both = [*meta, _meta(7, "image", "audio")]
    assert ids(1, both) == [7]  # one sample that activates both producers
    assert ids(2, both) == [0, 7]
    assert ids(2, meta[:3]) == [0, 1]  # the data has neither: file order


def test_compare_numbers_in_lists_use_the_tolerances_and_nan_matches_nan():
    """Found in review: numbers inside a list output were compared exactly while a top-level one
    took atol/rtol, and a recorded NaN never matched a NaN (tensors treat both-NaN as equal)."""
    from maestro_flow.runtime.replay_report import compare_outputs

    def diff(got, want, atol=1e-6, rtol=0.0):
        [d] = compare_outputs({"x": got}, {"x": want}, atol, rtol)
        return d

    assert diff([1.0, 2.0 + 1e-9], [1.0, 2.0]).ok
    near = diff([1.0, 2.0 + 1e-9], [1.0, 2.0])
    assert 0 < near.max_abs < 1e-8
    far = diff([1.0, 2.5], [1.0, 2.0])
    assert not far.ok and far.max_abs == pytest.approx(0.5) and "entry 1" in far.problem
    assert diff(float("nan"), float("nan")).ok
    assert diff(torch.tensor(float("nan")), float("nan")).ok
    assert diff([3, float("nan")], [3, float("nan")]).ok
    assert not diff(float("nan"), 1.0).ok and not diff(1.0, float("nan")).ok
    assert diff(math.inf, math.inf).ok and not diff(-math.inf, math.inf).ok
    assert not diff([torch.tensor(3)], [3]).ok  # a tensor where a number was recorded is still a mismatch
    assert not diff([True], [False]).ok and diff([True], [True]).ok


def test_run_settings_note_names_mixed_precision(tmp_path):
    """Found in review: a recording made with mixed_precision=bf16 replayed without it got no note."""
    from maestro_flow.runtime.replay import _run_settings_note

    path = str(PIPELINES / "distill.py")
    run, _ = load_pipeline(path, {"mixed_precision": "bf16"})
    (tmp_path / "pipeline.json").write_text(json.dumps({"pipeline": run.to_dict(), "overrides": {}}))
    plain, _ = load_pipeline(path, {})
    note = _run_settings_note(str(tmp_path), plain, "student")
    assert note is not None and "mixed_precision" in note
    assert _run_settings_note(str(tmp_path), run, "student") is None
    # Found in QA: another pipeline file with the same section said nothing, or advised --set.
    other, _ = load_pipeline(path, {"name": "other", "mixed_precision": "bf16"})
    assert _run_settings_note(str(tmp_path), other, "student") == "note: the recording is of pipeline 'distill', " \
                                                                     "this is 'other'"
    other, _ = load_pipeline(path, {"name": "other"})
    assert _run_settings_note(str(tmp_path), other, "student").endswith(
        "it ran pipeline 'distill', not 'other': replay with its file")
