"""The monolithic baseline's pipeline (maestro_flow/baseline/monolithic.py) and CPU shares
(runtime/cpus.py): pure transformations, no processes."""

from __future__ import annotations

import pytest

from maestro_flow import ArrowData, Edge, Pipeline, Section
from maestro_flow.baseline.monolithic import MODEL, monolithic_pipeline
from maestro_flow.errors import PipelineError
from maestro_flow.runtime.cpus import cpu_shares, search_share, threads


def vlm(**kw) -> Pipeline:
    return Pipeline(name="vlm", data=ArrowData(path="d"), global_batch=12, sections=[
        Section(name="vision", stage="m:V", activates_on="image", dp=2, micro_batch=8, columns=("image",),
                optimizer={"name": "sgd", "lr": 0.1}),
        Section(name="llm", stage="m:L", dp=4, micro_batch=3, tp=2, fsdp=True, columns=("tokens",),
                optimizer={"name": "adamw", "lr": 1e-3}, **kw)],
        edges=[Edge(src="vision", dst="llm", tensors=("e",))])


def test_one_section_of_n_ranks_holding_every_section():
    fused = monolithic_pipeline(vlm(), devices=5)
    fused.validate()
    (model,) = fused.sections
    assert (model.name, model.dp, model.micro_batch, model.tp, model.fsdp) == (MODEL, 5, 3, 1, False)
    assert model.columns == ("image", "tokens") and fused.schedule == "fifo" and not fused.edges
    inner = Pipeline.from_dict(model.config["pipeline"])
    assert [(s.name, s.dp, s.tp, s.fsdp) for s in inner.sections] == [("vision", 1, 1, False), ("llm", 1, 1, False)]
    assert [s.optimizer["name"] for s in inner.sections] == ["sgd", "adamw"]  # each keeps its own
    assert monolithic_pipeline(vlm(), devices=2, micro_batch=7).sections[0].micro_batch == 7


def test_a_section_reading_every_column_makes_the_model_read_every_column():
    p = vlm().override(**{"sections.llm.columns": None})
    assert monolithic_pipeline(p, devices=2).sections[0].columns is None


def test_what_it_refuses():
    two_losses = Pipeline(name="p", data=ArrowData(path="d"), sections=[
        Section(name="a", stage="m:A"), Section(name="b", stage="m:B")])
    with pytest.raises(PipelineError, match="2 loss sections"):
        monolithic_pipeline(two_losses, devices=2)
    frozen = Pipeline(name="p", data=ArrowData(path="d"), sections=[Section(name="a", stage="m:A", trainable=False)])
    with pytest.raises(PipelineError, match="trains nothing"):
        monolithic_pipeline(frozen, devices=2)
    with pytest.raises(PipelineError, match="different devices"):
        monolithic_pipeline(vlm(device="cuda"), devices=2)
    with pytest.raises(PipelineError, match="--devices"):
        monolithic_pipeline(vlm(), devices=0)
    # 100 ranks for 16 samples a step started, then timed out on this machine
    assert monolithic_pipeline(vlm(), devices=12).sections[0].dp == 12
    with pytest.raises(PipelineError, match="--devices 13 is more than global_batch=12: .* pass --devices 12 or fewer"):
        monolithic_pipeline(vlm(), devices=13)


def test_the_default_devices_beyond_the_global_batch_are_refused_before_any_process_starts(tmp_path):
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    with pytest.raises(PipelineError, match="--devices defaults to the 3 ranks .* global_batch=2 .* --devices 2 or"):
        run_pipeline("pipelines/distill.py", RunOptions(baseline="monolithic", overrides={"global_batch": 2, "steps": 1},
                                                        run_dir=str(tmp_path)))


@pytest.mark.parametrize(("workers", "cores", "expected"), [
    (2, [0, 1], [(0,), (1,)]),
    (3, [0, 1, 2, 3, 4, 5, 6, 7], [(0, 1), (2, 3, 4), (5, 6, 7)]),
    (3, [4, 5], [(4, 5)] * 3),  # more workers than cores: shared by all
    (1, [2, 3], [(2, 3)]),
    (0, [0, 1], []),
])
def test_cpu_shares(workers, cores, expected):
    shares = cpu_shares(workers, cores)
    assert shares == expected
    if workers <= len(cores):
        assert sorted(c for s in shares for c in s) == sorted(cores) or not workers


def test_threads_per_pinned_worker():
    assert threads(2, [0, 1]) == 1 and threads(2, list(range(8))) == 4 and threads(3, [0, 1]) == 1
    # Uneven blocks: each worker runs as many threads as its own block has cores.
    assert [threads(2, [0, 1, 2], s) for s in cpu_shares(2, [0, 1, 2])] == [1, 2]
    assert threads(3, [0, 1], (0, 1)) == 1  # more workers than cores: a part of the shared cores


def test_predicted_monolithic_step():
    """A drawn case: vision (trainable, images only: 1 s forward, backward 2x) -> llm (2 s
    forward, backward 1x); 4 samples [img, txt, txt, img] on 2 ranks with micro-batch 2: each
    rank one micro-batch holding one image: vision 1 + 2, llm 2 x (2 + 2), plus one fixed cost
    per section run (0.5 s each) = 12 s; then a 100 MB all-reduce over 2 ranks (0.1 s at
    1000 MB/s) and both optimizer steps (0.25 s each); 3 ranks on 2 cores run 1.5x slower."""
    from maestro_flow.config import Cost
    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner.cost import CostModel
    from maestro_flow.planner.monolithic import best_monolithic, monolithic_step
    from maestro_flow.samples import SampleMeta

    p = Pipeline(name="p", data=ArrowData(path="d"), sections=[
        Section(name="vision", stage="m:V", activates_on="image", cost=Cost(per_sample_s=1.0)),
        Section(name="llm", stage="m:L", cost=Cost(per_sample_s=2.0, backward_factor=1.0))],
        edges=[Edge(src="vision", dst="llm", tensors=("e",))])
    graph = SectionGraph(p)
    costs = CostModel(costs={s.name: s.cost for s in p.sections})
    img, txt = frozenset({"text", "image"}), frozenset({"text"})
    batch = [SampleMeta(id=i, modalities=m) for i, m in enumerate((img, txt, txt, img))]
    calib = {"overhead_s": {"vision": 0.5, "llm": 0.5}, "step_s": {"vision": 0.25, "llm": 0.25},
             "grad_mb": {"vision": 40.0, "llm": 60.0}}
    step = monolithic_step(graph, costs, batch, devices=2, micro_batch=2, **calib)
    assert step.compute_s == pytest.approx(1 + 2 + 2 * (2 + 2) + 2 * 0.5)
    assert step.end_s == pytest.approx(2 * 100 * 0.5 / 1000 + 0.5)
    assert step.step_s == pytest.approx(step.compute_s + step.end_s)
    # micro-batch 1: the image's rank pays vision's fixed cost once, the llm's twice
    one = monolithic_step(graph, costs, batch, devices=2, micro_batch=1, **calib)
    assert one.compute_s == pytest.approx(3 + 8 + 3 * 0.5)
    assert best_monolithic(graph, costs, [batch], devices=2, micro_batches=[1, 2], **calib).micro_batch == 2
    # A size above a rank's share (2 samples each) is that share (found in QA: tune printed 16 for 12)
    assert best_monolithic(graph, costs, [batch], devices=2, micro_batches=[1, 4, 8], **calib).micro_batch == 2
    slow = monolithic_step(graph, costs, batch, devices=3, micro_batch=2, cpu_cores=2)
    assert slow.step_s == pytest.approx(1.5 * monolithic_step(graph, costs, batch, devices=3, micro_batch=2).step_s)


def test_the_planner_searches_only_on_a_spare_core_ahead_of_the_step():
    assert search_share(0.25, 1, workers=3, cores=16) == 0.25  # GPU-node-like: cores to spare
    assert search_share(0.25, 1, workers=0, cores=2) == 0.25  # every worker on a GPU
    assert search_share(0.25, 1, workers=3, cores=2) == 0.0  # the CPU demo: workers fill the host
    assert search_share(0.25, 1, workers=2, cores=2) == 0.0
    assert search_share(0.25, 0, workers=0, cores=16) == 0.0  # plans made just in time
    assert search_share(0.0, 1, workers=0, cores=16) == 0.0


@pytest.mark.parametrize("raw, expected", [("", 0), (" 3 ", 3), ("0", 0), ("two", None), ("²", None), ("-1", None)])
def test_worker_threads_from_the_environment(monkeypatch, raw, expected):
    from maestro_flow.runtime.cpus import env_threads

    monkeypatch.setenv("MAESTRO_WORKER_THREADS", raw)
    if expected is None:  # "²" passed str.isdigit and then failed int() naming nothing (found by review)
        with pytest.raises(ValueError, match="MAESTRO_WORKER_THREADS must be a whole number"):
            env_threads()
    else:
        assert env_threads() == expected


def test_the_baseline_says_it_drops_tp_and_fsdp(capsys):
    """Found in QA: a pipeline's tp and fsdp were dropped in silence (the README says so)."""
    from maestro_flow.graph import SectionGraph
    from maestro_flow.runtime.checks import Checked
    from maestro_flow.runtime.run import RunOptions, _as_baseline

    checked = Checked(graph=SectionGraph(vlm()), source=None, metadata=[])
    fused, _ = _as_baseline(vlm(), checked, RunOptions(overrides={}, baseline="monolithic", devices=2))
    assert fused.sections[0].tp == 1
    assert "the tp and fsdp of sections.llm are not used" in capsys.readouterr().err


def test_the_baseline_refuses_every_checkpoint_flag_first_and_says_it_drops_the_wavefront(capsys):
    """Found in QA: --checkpoint-every alone asked for --checkpoint-dir, which the baseline then
    refused (a circle); --schedule wavefront was dropped in silence."""
    from maestro_flow.checkpoint.checkpointer import CheckpointOptions
    from maestro_flow.errors import PipelineError
    from maestro_flow.graph import SectionGraph
    from maestro_flow.runtime.checks import Checked
    from maestro_flow.runtime.run import RunOptions, _as_baseline

    checked = Checked(graph=SectionGraph(vlm()), source=None, metadata=[])
    for ckpt, flag in ((CheckpointOptions(every=1), "--checkpoint-every"), (CheckpointOptions(keep_last=2), "--keep-last"),
                       (CheckpointOptions(on_term=True), "--checkpoint-on-term"),
                       (CheckpointOptions(on_error="continue"), "--checkpoint-errors"),
                       (CheckpointOptions(on_error="stop"), "--checkpoint-errors")):  # given, though the default
        with pytest.raises(PipelineError, match=f"^--baseline monolithic is a one-node comparison run in its own "
                                                f"layout, without checkpoints or recordings: drop {flag}$"):
            _as_baseline(vlm(), checked, RunOptions(overrides={}, baseline="monolithic", devices=2, checkpoint=ckpt))
    capsys.readouterr()
    _as_baseline(vlm(), checked, RunOptions(overrides={"schedule": "wavefront"}, baseline="monolithic", devices=2))
    assert "--schedule wavefront is not used" in capsys.readouterr().err
    _as_baseline(vlm(), checked, RunOptions(overrides={"schedule": "fifo"}, baseline="monolithic", devices=2))
    assert "--schedule" not in capsys.readouterr().err
