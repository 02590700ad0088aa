"""Recording of one micro-batch (runtime/record.py): save/load round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from maestro_flow.runtime.record import (
    load_micro_batches,
    record_dir,
    recorded_weights,
    recording_dirs,
    save_micro_batch,
    save_weights,
)
from maestro_flow.stage import MicroBatch


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert type(a) is type(b) and a == b


def _check(batch: MicroBatch, outputs: dict, tmp_path) -> tuple[MicroBatch, dict]:
    path = save_micro_batch(str(tmp_path), batch, outputs)
    assert path.endswith(f"step{batch.step:06d}-mb{batch.index:04d}.safetensors")
    [(got, got_out)] = load_micro_batches(str(tmp_path))
    assert (got.step, got.index, got.sample_ids, got.modalities) == (
        batch.step, batch.index, batch.sample_ids, batch.modalities)
    assert set(got.columns) == set(batch.columns) and set(got.inputs) == set(batch.inputs)
    for name in batch.columns:
        _same([v.detach() if isinstance(v, torch.Tensor) else v for v in batch.columns[name]], got.columns[name])
    for name in batch.inputs:
        _same([None if v is None else v.detach() for v in batch.inputs[name]], got.inputs[name])
    assert set(got_out) == set(outputs)
    for name, value in outputs.items():
        want = [None if v is None else v.detach() for v in value] if isinstance(value, list) else (
            value.detach() if isinstance(value, torch.Tensor) else value)
        _same(want, got_out[name])
    return got, got_out


def test_text_micro_batch_round_trip(tmp_path):
    hidden = [torch.randn(5, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)]
    loss = (hidden[0].sum() + hidden[1].sum()) * 2  # a non-leaf 0-dim tensor with a grad_fn
    batch = MicroBatch(step=12, index=3, sample_ids=[40, 7], modalities=[frozenset({"text"})] * 2,
                       columns={"tokens": [torch.arange(5), torch.arange(3) + 100], "id": [40, 7]},
                       inputs={"hidden": hidden})
    _, out = _check(batch, {"loss": loss, "loss_denominator": 8}, tmp_path)
    assert out["loss"].dim() == 0 and out["loss_denominator"] == 8
    assert out["loss"].dtype == torch.float32


def test_image_micro_batch_with_bytes_none_and_list_outputs(tmp_path):
    png = b"\x89PNG\r\n\x1a\nabc\x00\xff"
    embeds = [torch.randn(4, 16, dtype=torch.float64), None, torch.randn(9, 16, dtype=torch.float64)]
    batch = MicroBatch(step=0, index=0, sample_ids=[1, 2, 3],
                       modalities=[frozenset({"text", "image"}), frozenset({"text"}), frozenset({"image", "text"})],
                       columns={"image": [png, None, b""], "tokens": [torch.arange(4), torch.arange(2), torch.arange(0)]},
                       inputs={"image_embeds": embeds})
    got, out = _check(batch, {"image_embeds": [torch.ones(2, 2), None, torch.zeros(1, 2)],
                              "pooled": torch.randn(3, 16)}, tmp_path)
    assert got.columns["image"] == [png, None, b""]
    assert got.inputs["image_embeds"][1] is None
    assert out["image_embeds"][1] is None and out["pooled"].shape == (3, 16)


def test_audio_columns_numpy_and_scalars(tmp_path):
    wave = np.linspace(-1, 1, 160, dtype=np.float32)
    batch = MicroBatch(step=2, index=1, sample_ids=[5], modalities=[frozenset({"audio", "text"})],
                       columns={"audio": [wave], "sample_rate": [np.int64(16000)], "text": ["hello"]})
    path = save_micro_batch(str(tmp_path), batch, {"frames": [torch.randn(3, 4).to(torch.bfloat16)]})
    [(got, out)] = load_micro_batches(str(tmp_path))
    assert torch.equal(got.columns["audio"][0], torch.from_numpy(wave))
    assert got.columns["sample_rate"] == [16000] and got.columns["text"] == ["hello"]
    assert out["frames"][0].dtype == torch.bfloat16
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == {"columns/audio/0", "outputs/frames/0"}
    assert json.loads(meta["columns"])["sample_rate"] == [{"kind": "scalar", "value": 16000}]
    assert json.loads(meta["sample_ids"]) == [5]


def test_sorted_by_step_and_index_and_dirs(tmp_path):
    for step, index in [(3, 0), (1, 2), (1, 0), (10, 1)]:
        save_micro_batch(record_dir(str(tmp_path), "llm", 1), MicroBatch(
            step=step, index=index, sample_ids=[step], modalities=[frozenset({"text"})], columns={}), {})
    (tmp_path / "record" / "llm-0").mkdir()
    (tmp_path / "record" / "llm-x").mkdir()
    (tmp_path / "record" / "llm-extra-0").mkdir()
    dirs = recording_dirs(str(tmp_path), "llm")
    assert [d.rsplit("/", 1)[1] for d in dirs] == ["llm-0", "llm-1"]
    assert recording_dirs(str(tmp_path), "vision") == []
    assert [(b.step, b.index) for b, _ in load_micro_batches(dirs[1])] == [(1, 0), (1, 2), (3, 0), (10, 1)]


def test_weights_once_per_step(tmp_path):
    from maestro_flow.stage import Stage, StageContext

    class Tiny(Stage):
        def __init__(self, config, ctx):
            super().__init__(config, ctx)
            self.lin = torch.nn.Linear(2, 2)

    stage = Tiny({}, StageContext(section="tiny"))
    assert save_weights(str(tmp_path), 4, stage) is not None
    assert save_weights(str(tmp_path), 4, stage) is None
    assert recorded_weights(str(tmp_path), 4) and recorded_weights(str(tmp_path), 5) is None
    assert load_micro_batches(str(tmp_path)) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32, torch.bool])
def test_dtypes(tmp_path, dtype):
    t = torch.ones(3, dtype=dtype)
    batch = MicroBatch(step=0, index=0, sample_ids=[0], modalities=[frozenset({"text"})], columns={},
                       inputs={"x": [t]})
    _check(batch, {"y": t.clone()}, tmp_path)


def test_views_sharing_storage(tmp_path):
    base = torch.randn(4, 6)
    batch = MicroBatch(step=0, index=0, sample_ids=[0, 1], modalities=[frozenset({"text"})] * 2, columns={},
                       inputs={"x": [base[:2], base[2:].T]})
    _check(batch, {"y": [base[1:3], base[:, 1]]}, tmp_path)


def test_random_inputs_leave_their_producer_unbuilt() -> None:
    """`maestro stage --input-shape` for one input builds only the sections that compute the
    others (multimodal: random image_embeds still runs the audio encoder, and not vision)."""
    from pathlib import Path

    from maestro_flow.graph import SectionGraph
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.replay_runner import ancestors

    pipeline, _ = load_pipeline(str(Path(__file__).resolve().parents[2] / "pipelines" / "multimodal.py"), {})
    graph = SectionGraph(pipeline)
    assert set(ancestors(graph, "llm")) == {"vision", "audio"}
    assert ancestors(graph, "llm", {"image_embeds"}) == ["audio"]
    assert ancestors(graph, "llm", {"image_embeds", "audio_embeds"}) == []


@pytest.mark.parametrize("mixed", [None, "bf16"])
def test_replay_hands_inputs_in_the_dtype_they_cross_sections_in(mixed) -> None:
    """A replay feeds a section what the executor would: under bf16 mixed precision its inputs
    stay bf16 (as they arrive over the wire), else they take the pipeline's dtype."""
    from pathlib import Path

    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.replay_runner import SectionRunner

    overrides = {"dtype": "float64"} | ({"mixed_precision": mixed} if mixed else {})
    pipeline, _ = load_pipeline(str(Path(__file__).resolve().parents[2] / "pipelines" / "distill.py"), overrides)
    runner = SectionRunner(pipeline, "student")
    [name] = [t for e in runner.graph.inputs("student") for t in e.edge.tensors]
    batch = MicroBatch(step=0, index=0, sample_ids=[7], modalities=[frozenset({"text"})], columns={},
                       inputs={name: [torch.ones(3, 4, dtype=torch.bfloat16)]})
    prepared, _ = runner.prepare(batch)
    assert prepared.inputs[name][0].dtype == (torch.bfloat16 if mixed else torch.float64)


def test_outputs_kept_as_text_are_not_compared_and_strings_are(tmp_path):
    """A str output is recorded as itself; a value JSON cannot hold (a dict of tensors) as its
    text only, which `--compare` reports as not compared instead of a mismatch. A list entry that
    turns from a number into a tensor is a mismatch (it passed unseen before)."""
    from maestro_flow.runtime.record import TextOnly
    from maestro_flow.runtime.replay_report import compare_outputs

    metrics = {"acc": torch.tensor(0.5)}
    batch = MicroBatch(step=0, index=0, sample_ids=[1], modalities=[frozenset({"text"})], columns={})
    save_micro_batch(str(tmp_path), batch, {"name": "student", "metrics": metrics, "mixed": [1.0, metrics],
                                            "n": [3]})
    [(_, out)] = load_micro_batches(str(tmp_path))
    assert out["name"] == "student" and not isinstance(out["name"], TextOnly)
    assert isinstance(out["metrics"], TextOnly) and "acc" in out["metrics"]
    assert out["mixed"][0] == 1.0 and isinstance(out["mixed"][1], TextOnly)
    live = {"name": "student", "metrics": {"acc": torch.tensor(0.5000001)}, "mixed": [1.0, metrics],
            "n": [torch.tensor(3)]}
    diffs = {d.name: d for d in compare_outputs(live, out, atol=1e-6, rtol=0.0)}
    assert diffs["name"].ok and diffs["name"].compared
    assert diffs["metrics"].ok and not diffs["metrics"].compared
    assert diffs["mixed"].ok and diffs["mixed"].compared and "1 of 2 entries" in diffs["mixed"].problem
    assert not diffs["n"].ok and "a tensor vs recorded 3" in diffs["n"].problem
    assert not compare_outputs({"name": "teacher"}, {"name": "student"}, 0.0, 0.0)[0].ok


def test_nested_plain_values_are_recorded_as_values(tmp_path):
    """A column of boxes (lists of lists) or of dicts comes back as it was (it was kept as text
    only before, which a replay fed to the stage as a string)."""
    boxes = [[[0.0, 0.0, 4.0, 4.0]], [[1.0, 1.0, 2.0, 2.0], [3.0, 3.0, 5.0, 5.0]]]
    meta = [{"source": "a", "tags": ["x", None]}, {"source": "b", "tags": []}]
    batch = MicroBatch(step=0, index=0, sample_ids=[1, 2], modalities=[frozenset({"text"})] * 2,
                       columns={"boxes": boxes, "meta": meta, "pair": [(1, 2), (3, 4)]}, inputs={})
    save_micro_batch(str(tmp_path), batch, {})  # (tuples come back as lists)
    [(got, _)] = load_micro_batches(str(tmp_path))
    assert got.columns["boxes"] == boxes and got.columns["meta"] == meta
    assert got.columns["pair"] == [[1, 2], [3, 4]]


def test_a_recorder_records_the_steps_its_ranges_name(tmp_path):
    """--record-steps takes ranges as `maestro stage --steps` does (0,3-5 was refused before)."""
    from maestro_flow.runtime.record import Recorder, Steps

    stage = torch.nn.Linear(2, 2)
    rec = Recorder(str(tmp_path), Steps(ranges=((0, 0), (3, 5))))
    assert [s for s in range(8) if rec.begin(s, 1, stage, None) is not None] == [0, 3, 4, 5]


def test_a_recording_links_a_frozen_sections_unchanged_weights(tmp_path):
    """Found in QA: a frozen section's whole weights were written again at every recorded step.
    A frozen section's step whose state has the same content is a hard link to the last file; a
    change (a BatchNorm's running stats in a forward, a `.data` update, which bumps no version
    counter: found in review) or a buffer replaced writes a new file. A trainable section's
    weights are always written (found in review: a fused optimizer's step bumps no counter)."""
    import os

    from maestro_flow.runtime.record import Recorder
    from maestro_flow.stage import Stage

    class Frozen(Stage):
        def __init__(self) -> None:
            super().__init__({}, None)
            self.lin, self.norm = torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)
            for p in self.parameters():
                p.requires_grad_(False)  # as build_stage leaves a trainable=False section

    stage = Frozen()
    rec = Recorder(str(tmp_path), None)

    inodes = []

    def record() -> None:
        step = len(inodes)
        rec.begin(step, 0, stage, None)
        inodes.append(os.stat(tmp_path / f"weights-step{step:06d}.safetensors").st_ino)

    for _ in range(3):
        record()
    assert len(set(inodes)) == 1  # unchanged: one file on disk
    stage.norm(torch.randn(4, 3))  # training mode: its running stats change in place
    record()
    stage.lin.weight.data.add_(1.0)  # no version counter moves
    record()
    record()
    stage.norm.running_mean = torch.zeros(3)  # a buffer replaced
    record()
    assert inodes[3] != inodes[2] and inodes[4] != inodes[3] and inodes[5] == inodes[4] and inodes[6] != inodes[5]
    for p in stage.parameters():
        p.requires_grad_(True)  # trainable: written at every step, even unchanged
    record()
    record()
    assert inodes[8] != inodes[7] != inodes[6]
    rec.begin(9, 1, stage, None)  # weights are saved at a step's first micro-batch only
    assert not (tmp_path / "weights-step000009.safetensors").exists()
    # A state the digest cannot view as bytes (a conjugate view: found in review, the recording
    # stopped) is hashed from its values, and recorded.
    for p in stage.parameters():
        p.requires_grad_(False)
    stage.norm.register_buffer("phase", torch.polar(torch.ones(2), torch.ones(2)).conj())
    record()
    record()
    assert not rec.stopped and inodes[10] == inodes[9] != inodes[8]


def _plain_executor(tmp_path, layout=None):
    """The `embed` section of tests/integration/assets/plain.py, recording every step."""
    from pathlib import Path

    from loaders.demo import build_text_demo
    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner.plan import Placement
    from maestro_flow.runtime.build import build_stage, load_pipeline, open_source
    from maestro_flow.runtime.executor import SectionExecutor
    from maestro_flow.runtime.record import Recorder
    from maestro_flow.transport.tensor_comm import Stats

    class Comm:
        stats, in_flight = Stats(), 0

        def send(self, *args):
            pass

        def notify(self, *args):
            pass

        def reap(self):
            pass

    plain = Path(__file__).resolve().parents[1] / "integration" / "assets" / "plain.py"
    data = build_text_demo(tmp_path / "data", num_samples=64, parquet=False)
    pipeline, _ = load_pipeline(str(plain), {"data.path": str(data)})
    graph = SectionGraph(pipeline)
    placement = Placement.build(graph.order, {n: graph.sections[n].dp for n in graph.order})
    source = open_source(pipeline)
    return pipeline, graph, source, SectionExecutor(
        stage=build_stage(pipeline, graph.sections["embed"], 0, "cpu"), graph=graph, placement=placement,
        section="embed", replica=0, source=source, comm=Comm(), report=lambda kind, body: None,
        device=torch.device("cpu"), dtype=torch.float32, reducer=None, layout=layout,
        record=Recorder(str(tmp_path / "rec"), None))


def test_recording_is_not_timed_as_the_sections_work(tmp_path, monkeypatch):
    """Saving the step's weights (a large model, a slow disk) counted in the forward's time, so
    in busy time and the fitted costs: --record changed the plans (found by a review)."""
    import time

    from maestro_flow.planner import make_planner
    from maestro_flow.runtime import record
    from maestro_flow.runtime.ledger import plan_message
    from maestro_flow.runtime.sampler import EpochSampler

    slow = record.save_weights
    monkeypatch.setattr(record, "save_weights", lambda *a: (time.sleep(0.5), slow(*a))[1])
    pipeline, graph, source, executor = _plain_executor(tmp_path)
    plan = make_planner("wavefront", graph, search=0.0).plan(0, EpochSampler(source.metadata(), 8, 0).batch(0))
    executor.add_plan(plan_message(plan, graph, "embed", 0))
    executor.poll()
    assert (tmp_path / "rec" / "weights-step000000.safetensors").exists()
    assert executor.current.busy_s < 0.25, executor.current.busy_s


def test_a_tensor_parallel_follower_records_nothing(tmp_path):
    """Its leader records the replica (the follower wrote the same files beside it)."""
    from maestro_flow.parallel.section import Layout

    *_, leader = _plain_executor(tmp_path, Layout(replica=0, tp_index=0, members=(0, 1)))
    *_, follower = _plain_executor(tmp_path, Layout(replica=0, tp_index=1, members=(0, 1)))
    assert leader.record is not None and follower.record is None


def test_steps_a_section_had_no_micro_batch_come_from_the_plans(tmp_path):
    """Found in QA: a recording of an encoder that no sample activated was missing without a
    word, and the replay advised recording it. The run dir's plans say at which steps it idled
    (the last plan of a step replayed after a restart; a line cut short is skipped)."""
    from maestro_flow.runtime.record import Steps, idle_steps
    from maestro_flow.runtime.replay import ReplayError, ReplayOptions, _recorded

    def plan(step, audio):
        return json.dumps({"step": step, "sections": {"audio": {"replicas": audio}, "llm": {"replicas": [[[1]]]}}})

    assert idle_steps(str(tmp_path), "audio") == ([], [])  # no plans.jsonl
    (tmp_path / "plans.jsonl").write_text("\n".join([plan(0, [[], []]), plan(1, [[[3]], []]), plan(2, [[[4]], []]),
                                                     plan(2, [[], []]), '{"step": 3, "sect']) + "\n")
    assert idle_steps(str(tmp_path), "audio") == ([0, 2], [0, 1, 2])
    assert idle_steps(str(tmp_path), "audio", Steps(ranges=((1, 2),))) == ([2], [0, 1, 2])
    with pytest.raises(ReplayError, match=r"\(record one with: maestro run PIPELINE.py --record audio; no sample "
                                          r"activated it at steps 0, 2 of this run\)$"):
        _recorded(str(tmp_path), "audio", ReplayOptions())
    (tmp_path / "plans.jsonl").write_text(plan(0, [[], []]) + "\n" + plan(1, [[], []]) + "\n")
    with pytest.raises(ReplayError, match="no sample activated it at any of this run's 2 steps, so there was nothing "
                                          "to record$"):
        _recorded(str(tmp_path), "audio", ReplayOptions())
