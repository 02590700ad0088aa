"""Sections at scale, the pure parts: rank placement of tensor-parallel replicas, tp-plan matching
and its checks (what `maestro validate` refuses), and the plans of the built-in stages against
modules built on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from maestro_flow.parallel.tp import STYLES, check_plan, matches, sharded, stage_modules
from maestro_flow.planner import Placement


def test_placement_groups_a_replicas_ranks_behind_its_leader():
    p = Placement.build(["teacher", "student"], {"teacher": 2, "student": 2}, tp={"student": 2})
    assert p.world_size == 6
    assert p.ranks == {"teacher": (0, 1), "student": (2, 4)}
    assert p.group(2) == (2, 3) and p.group(4) == (4, 5) and p.group(0) == (0,)
    assert p.section_ranks("student") == [2, 3, 4, 5]
    assert [p.who(r) for r in range(6)] == [("teacher", 0), ("teacher", 1), ("student", 0), ("student", 0),
                                            ("student", 1), ("student", 1)]
    assert [p.tp_index(r) for r in range(6)] == [0, 0, 0, 1, 0, 1]
    assert p.tp("student") == 2 and p.tp("teacher") == 1 and p.dp("student") == 2
    assert [p.worker_name(r) for r in (0, 3, 4)] == ["teacher-0", "student-0.1", "student-1.0"]
    assert Placement.from_dict(p.to_dict()) == p


def test_placement_gives_each_rank_its_device_in_order():
    p = Placement.build(["llm"], {"llm": 2}, devices={"llm": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]}, tp={"llm": 2})
    assert p.devices == {0: "cuda:0", 1: "cuda:1", 2: "cuda:2", 3: "cuda:3"}


class Toy:
    """A stage-shaped object: modules() by attribute, as Stage.modules() gives them."""

    def __init__(self) -> None:
        self.body = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"up": nn.Linear(8, 12), "down": nn.Linear(12, 8),
                                                                           "norm": nn.LayerNorm(8)}) for _ in range(2)]),
                                   "emb": nn.Embedding(10, 8)})

    def modules(self) -> dict[str, nn.Module]:
        return {"body": self.body}


def test_a_star_matches_one_name_part_and_later_entries_win():
    modules = stage_modules(Toy())
    assert matches({"body.layers.*.up": "colwise"}, modules) == {"body.layers.0.up": "colwise",
                                                                 "body.layers.1.up": "colwise"}
    assert matches({"body.*.up": "colwise"}, modules) == {}  # `*` never spans a dot
    assert matches({"body.layers.*.up": "colwise", "body.layers.1.up": "replicate"}, modules)["body.layers.1.up"] \
        == "replicate"


def test_a_good_plan_has_no_problems():
    plan = {"body.layers.*.up": "colwise", "body.layers.*.down": "rowwise", "body.emb": "rowwise"}
    assert check_plan(Toy(), plan, 2) == []
    assert set(STYLES) >= set(plan.values())


@pytest.mark.parametrize(("plan", "tp", "problem"), [
    ({"body.layers.*.up": "sideways"}, 2, "tp_plan entry 'body.layers.*.up': style 'sideways' is not supported"),
    ({"body.layers.*.gate": "colwise"}, 2, "tp_plan entry 'body.layers.*.gate' names no module of the stage (its "
                                           "modules: body, body.layers, body.layers.*, body.layers.*.up, "
                                           "body.layers.*.down, body.layers.*.norm, body.emb)"),
    ({"0": "colwise", "2": "rowwise"}, 2, "tp_plan entries '0', '2' name no module of the stage (its modules: body,"),
    ({"body.layers.*.up": "colwise"}, 5, "body.layers.*.up (colwise): its 12 output features do not divide by tp=5"),
    ({"body.layers.*.down": "rowwise"}, 5, "body.layers.*.down (rowwise): its 12 input features do not divide by tp=5"),
    ({"body.emb": "rowwise"}, 3, "body.emb (rowwise): its 10 embeddings do not divide by tp=3"),
    ({"body.layers.*.norm": "colwise"}, 2, "LayerNorm cannot be sharded"),
])
def test_check_plan_names_what_cannot_be_sharded(plan, tp, problem):
    problems = check_plan(Toy(), plan, tp)
    assert any(problem in p for p in problems), problems


def test_a_dimension_that_does_not_divide_is_said_once_for_every_layer_naming_its_field():
    """Found in QA: an indivisible intermediate_size gave one clause per layer and projection,
    naming modules only."""
    fields = {12: ["sections.s.config.width"], 3: ["sections.s.config.other"]}
    assert check_plan(Toy(), {"body.layers.*.up": "colwise", "body.layers.*.down": "rowwise"}, 5, fields) == [
        "body.layers.*.up (colwise): its 12 output features do not divide by tp=5 (sections.s.config.width is 12)",
        "body.layers.*.down (rowwise): its 12 input features do not divide by tp=5"]


def test_a_tp_plan_that_is_no_classmethod_and_a_plan_that_breaks_shapes_say_so():
    """Found in QA: a tp_plan without @classmethod failed with "missing 1 required positional
    argument: 'config'"; a plan sharding a layer whose consumer it leaves whole failed at run time
    with a bare "mat1 and mat2 shapes cannot be multiplied"."""
    from maestro_flow.config import ArrowData, Pipeline, Section
    from maestro_flow.errors import PipelineError
    from maestro_flow.runtime.checks import check_tensor_parallel
    from maestro_flow.runtime.executor_state import tp_hint
    from maestro_flow.stage import Stage

    class Forgot(Stage):
        def tp_plan(self, config):
            return {"mlp.0": "colwise"}

    section = Section(name="lm", stage="mine:Forgot", tp=2)
    pipeline = Pipeline(name="p", data=ArrowData(path="unused.arrow"), sections=[section])
    with pytest.raises(PipelineError, match=r"sections.lm.stage: mine:Forgot.tp_plan must be a @classmethod"):
        check_tensor_parallel(pipeline, section, Forgot)

    class Plain(Stage):  # no decorator and no self: called on the class, it works (found in review)
        def tp_plan(config):
            return {"nothing": "colwise"}

    with pytest.raises(PipelineError, match=r"^sections.lm.stage: cannot import 'mine:Forgot'"):  # past that check
        check_tensor_parallel(pipeline, section, Plain)
    error = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (384x32 and 64x32)\n"
    assert "pair each colwise layer with the rowwise one that reads it" in tp_hint(error, 2, "lm")
    assert tp_hint(error, 1, "lm") == "" and tp_hint("ValueError: bad token\n", 2, "lm") == ""
    from stages.hf import HFCausalLM  # transformers' own plan: nothing of ours to pair (found in review)
    hf = tp_hint(error, 2, "lm", HFCausalLM)
    assert "transformers (base_model_tp_plan)" in hf and "pair each colwise" not in hf and "tp=1 tells" in hf

    class Exported(Stage):  # an export marker with a plan of its own: the plan is ours to pair (found in review)
        hugging_face_model = "lm"

        @classmethod
        def tp_plan(cls, config):
            return {"lm.fc": "colwise"}

    assert "pair each colwise layer" in tp_hint(error, 2, "lm", Exported)


STAGES = [  # stage, config, tp the config allows
    ("stages.lm:CausalLM", {"role": "lm", "vocab_size": 64, "d_model": 16, "n_layers": 2, "n_heads": 4,
                            "max_seq_len": 32}, 4),
    ("stages.chain:TransformerLM", {"vocab_size": 64, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 32}, 2),
    ("stages.vision:VisionEncoder", {"d_model": 16, "n_layers": 1, "n_heads": 2, "patch": 8, "max_grid": 4, "decode": {"max_side": 32},
                                     "project_to": 16}, 2),
    ("stages.audio:AudioEncoder", {"d_model": 16, "n_layers": 1, "n_heads": 2, "n_mels": 8, "project_to": 16}, 2),
    ("stages.multimodal:MultimodalLM", {"vocab_size": 64, "d_model": 16, "n_layers": 1, "n_heads": 2,
                                        "max_seq_len": 32}, 2),
    ("stages.distill:KDStudent", {"student": {"vocab_size": 64, "d_model": 16, "n_layers": 1, "n_heads": 2,
                                              "max_seq_len": 32},
                                  "teacher": {"vocab_size": 64, "d_model": 8, "n_layers": 1, "n_heads": 2, "init_seed": 1,
                                              "max_seq_len": 32}}, 2),
]


@pytest.mark.parametrize(("stage", "config", "tp"), STAGES, ids=[s[0] for s in STAGES])
def test_built_in_plans_shard_every_layer_of_their_stage(stage, config, tp):
    from maestro_flow.runtime.build import resolve
    from maestro_flow.stage import StageContext

    cls = resolve(stage, "stage")
    plan = cls.tp_plan(config)
    cls.check_tp(config, tp)
    with torch.device("meta"):
        built = cls(config, StageContext(section="x", dtype="float32"))
    assert check_plan(built, plan, tp) == []
    split = sharded(plan, stage_modules(built))
    assert split and all(isinstance(stage_modules(built)[n], nn.Linear | nn.Embedding) for n in split)
    with pytest.raises(ValueError, match="is not divisible by tp=3"):
        cls.check_tp(config, 3)


def test_the_largest_fsdp_unit_of_a_teacher_is_one_block():
    """What a frozen FSDP teacher gathers at once (`maestro profile` writes it as unit_mb)."""
    from maestro_flow.parallel.fsdp import largest_unit_bytes
    from maestro_flow.runtime.build import build_stage, load_pipeline

    root = Path(__file__).resolve().parents[2]
    pipeline, _ = load_pipeline(str(root / "pipelines" / "distill.py"), {})
    stage = build_stage(pipeline, pipeline.section("teacher"), 0, "cpu", meta=True)
    blocks = [b for top in stage.modules().values() for m in top.modules() if isinstance(m, nn.ModuleList) for b in m]
    assert len(blocks) == 4
    block = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    assert largest_unit_bytes(stage) == block  # a block outweighs the embeddings and the head here


def test_tied_weights_stay_in_one_fsdp_unit():
    # Reproduced before: gpt2's wte and lm_head (one matrix) were two units, so FSDP2 sharded the
    # matrix twice and the two trained apart. Their common ancestor holds it now; blocks stay units.
    from maestro_flow.parallel.fsdp import fsdp_units
    from maestro_flow.runtime.build import resolve
    from maestro_flow.stage import StageContext

    config = {"role": "lm", "model_type": "gpt2", "init_seed": 3,
              "hf_config": {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 16}}
    with torch.device("meta"):
        stage = resolve("stages.hf:HFCausalLM", "stage")(config, StageContext(section="x", dtype="float32"))
    model = stage.model
    assert model.lm_head.weight is model.transformer.wte.weight
    units = fsdp_units(stage)
    assert model.transformer.wte not in units and model.lm_head not in units
    assert units[-1] is model and all(block in units for block in model.transformer.h)
    assert model.transformer.wpe in units  # untied modules keep their own units


@pytest.mark.parametrize("counts, same", [([3, 3, 3, 3], True), ([0, 0], True), ([3, 3, 4, 3], False),
                                          ([2, 4], False), ([100, 101], False)])
def test_lockstep_replicas_check_their_unit_counts_from_two_sums(counts, same):
    from maestro_flow.parallel.fsdp import same_counts

    assert same_counts([sum(counts), sum(c * c for c in counts)], len(counts)) is same


@pytest.mark.parametrize(("state", "expected"), [
    ({"_fsdp_param_groups": ["a", "b"]}, ["a", "b"]),  # torch 2.13: a list of parameter groups
    ({"_fsdp_param_group": "a"}, ["a"]),  # earlier releases (2.11 on the GPU machine): one, or None
    ({"_fsdp_param_group": None}, []),
])
def test_fsdp_parameter_groups_across_torch_releases(state, expected):
    from types import SimpleNamespace

    from maestro_flow.parallel.fsdp import FSDPSection

    unit = SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))
    assert FSDPSection._groups(None, unit) == expected
