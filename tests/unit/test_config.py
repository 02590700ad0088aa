"""Configuration records (maestro_flow/config.py): overrides, `--set` parsing, field checks.

Every refusal must name the field to change, in the `--set` path form a user would type
(`sections.student.dp`), so the tests match on that path.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from maestro_flow import ArrowData, Cost, Edge, Pipeline, PipelineError, Section
from maestro_flow.overrides import parse_set


def distill(**overrides) -> Pipeline:
    """The shape of pipelines/distill.py, with stage paths that are never imported here."""
    return Pipeline(
        name="distill",
        data=ArrowData(path="data/demo/text.arrow", placeholder_ids={"image": 259}),
        global_batch=16, steps=20, seed=0,
        sections=[
            Section(name="teacher", stage="stages.lm:CausalLM", config={"role": "teacher", "d_model": 128},
                    trainable=False, dp=1, micro_batch=8, cost=Cost(per_sample_s=2e-3, per_token_s=1e-4)),
            Section(name="student", stage="stages.distill:KDStudent",
                    config={"student": {"d_model": 64, "n_layers": 2}, "temperature": 2.0},
                    trainable=True, dp=2, micro_batch=2, optimizer={"name": "adamw", "lr": 3e-3},
                    columns=("tokens",)),
        ],
        edges=[Edge(src="teacher", dst="student", tensors=("hidden",))],
    ).override(**overrides)


# -- override ------------------------------------------------------------------------------


def test_override_top_level_fields():
    p = distill().override(global_batch=8, dtype="float64", steps=3)
    assert (p.global_batch, p.dtype, p.steps) == (8, "float64", 3)
    assert distill().global_batch == 16  # the original is untouched (records are immutable)


def test_override_section_field_by_dotted_path_and_by_keyword():
    dotted = distill().override(**{"sections.student.dp": 4})
    keyword = distill(sections__student__dp=4)
    assert dotted.section("student").dp == keyword.section("student").dp == 4
    assert dotted.section("teacher").dp == 1


def test_override_nested_dict_paths():
    p = distill().override(**{"sections.student.optimizer.lr": 1e-4,
                              "sections.student.config.student.d_model": 32,
                              "sections.teacher.cost.per_token_s": 0.5,
                              "data.path": "elsewhere.arrow"})
    assert p.section("student").optimizer == {"name": "adamw", "lr": 1e-4}  # sibling "name" kept
    assert p.section("student").config == {"student": {"d_model": 32, "n_layers": 2}, "temperature": 2.0}
    assert p.section("teacher").cost == Cost(per_sample_s=2e-3, per_token_s=0.5)
    assert p.data == ArrowData(path="elsewhere.arrow", placeholder_ids={"image": 259})


def test_override_can_add_a_key_inside_a_dict_field():
    p = distill().override(**{"sections.student.config.alpha": 0.25})
    assert p.section("student").config["alpha"] == 0.25


@pytest.mark.parametrize(("key", "named"), [
    ("global_bach", "'global_bach'"),
    ("sections.student.micro_bach", "'micro_bach'"),
    ("sections.ghost.dp", "'ghost'"),
])
def test_override_unknown_names_are_refused_naming_them(key, named):
    with pytest.raises(PipelineError, match=f"--set {key}:.*{named}"):
        distill().override(**{key: 1})


def test_override_unknown_section_error_lists_the_sections():
    with pytest.raises(PipelineError, match="sections: teacher, student"):
        distill().override(**{"sections.ghost.dp": 1})


def test_override_through_a_non_mapping_is_refused():
    with pytest.raises(PipelineError, match=r"--set sections\.student\.dp\.x: dp is not a mapping"):
        distill().override(**{"sections.student.dp.x": 1})


def test_override_unknown_nested_dataclass_field_names_it():
    with pytest.raises(PipelineError, match="bogus"):
        distill().override(**{"sections.teacher.cost.bogus": 1.0})


def test_from_dict_names_the_full_path_of_an_unknown_field():
    """A pipeline.json (a run dir's, a checkpoint's) with a field this version does not know."""
    data = distill().to_dict()
    data["sections"][1]["cost"]["per_sampl_s"] = 1.0
    with pytest.raises(PipelineError, match=r"unknown cost field 'per_sampl_s' at sections\.student\.cost\.per_sampl_s; "
                                            r"did you mean 'per_sample_s'\?"):
        Pipeline.from_dict(data)
    data = distill().to_dict()
    data["edges"][0]["tensor"] = data["edges"][0].pop("tensors")
    with pytest.raises(PipelineError, match=r"unknown edge field 'tensor' at edges\[0\]\.tensor; did you mean 'tensors'"):
        Pipeline.from_dict(data)
    data["data"] = "x.arrow"
    with pytest.raises(PipelineError, match="data must be a mapping of data fields, got 'x.arrow'"):
        Pipeline.from_dict(data)


def test_records_written_in_python_name_a_misspelt_field():
    with pytest.raises(PipelineError, match=r"unknown data field 'pth' at data\.pth; did you mean 'path'\?"):
        ArrowData(pth="x.arrow")
    with pytest.raises(PipelineError, match=r"unknown section field 'optimiser' at sections\.s\.optimiser; "
                                            r"did you mean 'optimizer'\?"):
        Section(name="s", stage="m:C", optimiser={})


# -- parse_set -----------------------------------------------------------------------------


@pytest.mark.parametrize(("item", "key", "value"), [
    ("global_batch=8", "global_batch", 8),
    ("sections.student.optimizer.lr=1e-3", "sections.student.optimizer.lr", 1e-3),
    ("sections.student.trainable=false", "sections.student.trainable", False),
    ("sections.student.activates_on=null", "sections.student.activates_on", None),
    ("sections.student.columns=[\"tokens\"]", "sections.student.columns", ["tokens"]),
    ('sections.student.optimizer={"name": "sgd", "lr": 0.1}', "sections.student.optimizer", {"name": "sgd", "lr": 0.1}),
    ('name="quoted"', "name", "quoted"),
    ("dtype=float64", "dtype", "float64"),  # not JSON: stays a string
    ("sections.student.device=cuda:1", "sections.student.device", "cuda:1"),
    ("data.path=a=b.arrow", "data.path", "a=b.arrow"),  # only the first '=' splits
    ("name=", "name", ""),
    (" steps =3", "steps", 3),
])
def test_parse_set_values_are_json_when_they_can_be_else_strings(item, key, value):
    assert parse_set([item]) == {key: value}


def test_parse_set_later_items_win_and_all_keys_are_kept():
    assert parse_set(["steps=1", "seed=4", "steps=2"]) == {"steps": 2, "seed": 4}


def test_parse_set_without_equals_is_refused_naming_the_item():
    with pytest.raises(PipelineError, match="key.path=value.*'global_batch'"):
        parse_set(["global_batch"])


@pytest.mark.parametrize(("item", "why"), [("sections.student dp=1", "its key holds a space"),
                                          ("--sett steps=1", "its key starts like a flag")])
def test_parse_set_refuses_a_key_with_a_space_or_like_a_flag_saying_why(item, why):
    """Found in QA: `--set "sections.student dp=1"` said "sections is not a mapping"; a --set-file
    line refused it, so --set and --set-file now share one check."""
    with pytest.raises(PipelineError, match=f"key.path=value, got {item!r} \\({why}"):
        parse_set([item])
    assert parse_set(["sections.t.config.a b=1"]) == {"sections.t.config.a b": 1}  # the stage's own dict


def test_parse_set_feeds_override():
    p = distill().override(**parse_set(["sections.student.dp=4", "dtype=float64"]))
    assert (p.section("student").dp, p.dtype) == (4, "float64")


# -- to_dict / from_dict -------------------------------------------------------------------


def test_to_dict_from_dict_round_trip():
    p = distill()
    assert Pipeline.from_dict(p.to_dict()) == p


def test_json_round_trip_gives_an_equal_pipeline():
    # What workers receive is JSON-like data; tuples must come back as tuples.
    p = distill()
    back = Pipeline.from_dict(json.loads(p.to_json()))
    assert back == p
    assert isinstance(back.edges[0].tensors, tuple) and isinstance(back.section("student").columns, tuple)
    assert isinstance(back.section("teacher").cost, Cost) and isinstance(back.data, ArrowData)


def test_to_dict_is_plain_data():
    d = distill().to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["sections"][1]["name"] == "student" and d["edges"] == [
        {"src": "teacher", "dst": "student", "tensors": ["hidden"]}]


def test_from_dict_with_an_unknown_field_is_a_pipeline_error():
    d = distill().to_dict()
    d["sections"][0]["dpp"] = 2
    with pytest.raises(PipelineError, match="dpp"):
        Pipeline.from_dict(d)


def test_lists_given_by_users_are_stored_as_tuples():
    p = distill()
    assert isinstance(p.sections, tuple) and isinstance(p.edges, tuple)
    e = Pipeline(name="x", data=ArrowData(path="d"), sections=[Section(name="a", stage="m:A")],
                 edges=[Edge(src="a", dst="b", tensors=["h"])]).edges[0]
    assert e.tensors == ("h",)


# -- validate ------------------------------------------------------------------------------


def test_the_distill_shape_validates():
    distill().validate()


@pytest.mark.parametrize(("key", "value", "field"), [
    ("sections.student.dp", 0, "sections.student.dp"),
    ("sections.student.dp", -2, "sections.student.dp"),
    ("sections.student.dp", 1.5, "sections.student.dp"),
    ("sections.student.dp", True, "sections.student.dp"),
    ("sections.teacher.micro_batch", 0, "sections.teacher.micro_batch"),
    ("sections.student.activates_on", "video", "sections.student.activates_on"),
    ("sections.student.device", "tpu", "sections.student.device"),
    ("sections.student.optimizer.name", "adam", "sections.student.optimizer.name"),
    ("sections.student.optimizer.lr", -1.0, "sections.student.optimizer.lr"),
    ("sections.student.stage", "stages.distill.KDStudent", "sections.student.stage"),
    ("sections.teacher.cost.per_sample_s", -1.0, "sections.teacher.cost.per_sample_s"),
    ("sections.teacher.cost.per_token_s", float("nan"), "sections.teacher.cost.per_token_s"),  # crashed the planner
    ("sections.teacher.cost.per_sample_s", float("inf"), "sections.teacher.cost.per_sample_s"),
    ("sections.teacher.cost.per_token_s", 1.7e308, "sections.teacher.cost.per_token_s"),  # summed to inf (review)
    ("sections.teacher.cost.backward_factor", "2", "sections.teacher.cost.backward_factor"),
    ("global_batch", 0, "global_batch"),
    ("data.path", "", "data.path"),  # found in review: read the current folder
    ("data.path", "data/*.parquet", "data.path:"),  # a glob is not expanded
    ("steps", 0, "steps"),
    ("lookahead_steps", -1, "lookahead_steps"),
    ("dtype", "float8", "dtype"),
    ("schedule", "lifo", "schedule"),
    ("sections.student.columns", "tokens", "sections.student.columns"),  # read as its letters (review)
    ("sections.student.columns", ["tokens", "tokens"], "sections.student.columns"),
    ("sections.student.columns", [1], "sections.student.columns"),
    ("sections.student.columns", [["tokens"]], "sections.student.columns"),
])
def test_validate_names_the_field(key, value, field):
    p = distill().override(**{key: value})
    with pytest.raises(PipelineError, match=rf"^{field.replace('.', '[.]')} "):
        p.validate()


def test_section_name_must_be_an_identifier():
    with pytest.raises(PipelineError, match=r"sections\.a b\.name"):
        Section(name="a b", stage="m:A").validate()
    Section(name="vision_enc-2", stage="m:A").validate()


@pytest.mark.parametrize("name", ["a/b", "../../escape", "", "a b", ".", 3])
def test_pipeline_name_must_be_an_identifier(name):
    # Reproduced before: the name went unchecked, and `maestro run` made its folder runs/NAME-TIME
    # from it: "a/b" crashed with FileNotFoundError, "../../escape" wrote outside runs/.
    p = distill().override(name=name)
    with pytest.raises(PipelineError, match=r"^name must be a non-empty identifier .*, got "):
        p.validate()
    distill().override(name="tiny-distill_2").validate()


def test_frozen_section_optimizer_is_not_checked():
    Section(name="t", stage="m:A", trainable=False, optimizer={"name": "whatever"}).validate()


@pytest.mark.parametrize("device", ["cpu", "cuda", "auto", "cuda:3"])
def test_known_devices_are_accepted(device):
    Section(name="s", stage="m:A", device=device).validate()


@pytest.mark.parametrize("modality", [None, "text", "image", "audio"])
def test_known_modalities_are_accepted(modality):
    Section(name="s", stage="m:A", activates_on=modality).validate()


def test_config_must_hold_plain_data_and_names_the_key():
    with pytest.raises(PipelineError, match=r"sections\.s\.config\.model must hold plain data.*object"):
        Section(name="s", stage="m:A", config={"model": object()}).validate()
    with pytest.raises(PipelineError, match=r"sections\.s\.config\.layers\[1\]"):
        Section(name="s", stage="m:A", config={"layers": [1, {1, 2}]}).validate()
    with pytest.raises(PipelineError, match=r"sections\.s\.config keys must be strings"):
        Section(name="s", stage="m:A", config={1: "x"}).validate()


def test_pipeline_needs_a_section():
    with pytest.raises(PipelineError, match="^sections must name at least one section"):
        Pipeline(name="x", data=ArrowData(path="d"), sections=[]).validate()


def test_section_lookup_by_name():
    p = distill()
    assert p.section("student").dp == 2 and p.section_names == ["teacher", "student"]
    with pytest.raises(PipelineError, match="no section named 'ghost'.*teacher, student"):
        p.section("ghost")


def test_activates():
    image = Section(name="v", stage="m:A", activates_on="image")
    assert image.activates(frozenset({"text", "image"})) and not image.activates(frozenset({"text"}))
    assert Section(name="a", stage="m:A").activates(frozenset())


# -- refusals of mistyped fields ----------------------------------------------------------


def test_non_string_device_is_a_pipeline_error():
    with pytest.raises(PipelineError, match=r"sections\.student\.device"):
        distill().override(**parse_set(["sections.student.device=0"])).validate()


def test_non_mapping_optimizer_is_a_pipeline_error():
    with pytest.raises(PipelineError, match=r"sections\.student\.optimizer"):
        distill().override(**parse_set(["sections.student.optimizer=adamw"])).validate()


def test_non_integer_seed_is_refused():
    with pytest.raises(PipelineError, match="seed"):
        distill().override(seed="abc").validate()


def test_a_string_tensors_field_is_one_name_or_a_clear_error():
    p = dataclasses.replace(distill(), edges=[Edge(src="teacher", dst="student", tensors="hidden")])
    try:
        p.validate()
    except PipelineError as exc:
        assert "edges[0]" in str(exc) and "tensors" in str(exc)
    else:
        assert p.edges[0].tensors == ("hidden",)


def test_float16_cannot_train():
    # Found in review: gradients are summed in the parameters' dtype before the division by the
    # loss denominator, which float16 (no loss scaling) overflows on real batches.
    from maestro_flow import ArrowData, Pipeline, PipelineError, Section

    p = Pipeline(name="p", data=ArrowData(path="d"), dtype="float16", sections=[Section(name="s", stage="m:S")])
    with pytest.raises(PipelineError, match="dtype=float16 cannot train.*mixed_precision='bf16'"):
        p.validate()


def test_data_path_may_be_a_path_object_or_a_file_whose_name_looks_like_a_pattern(tmp_path, monkeypatch):
    """Found in review of the glob check: a pathlib.Path was refused, and so was an existing
    ~/name[v2].arrow (the check did not expand the home folder)."""
    from pathlib import Path

    from maestro_flow import ArrowData

    ArrowData(path=Path(tmp_path / "x.arrow")).validate()
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "text[v2].arrow").write_bytes(b"")
    ArrowData(path="~/text[v2].arrow").validate()


def test_a_misnamed_learning_rate_is_named():
    """Found in QA: `learning_rate` for `lr` said only "lr must be ..., got None"."""
    spec = {"name": "adamw", "learning_rate": 1e-2}
    with pytest.raises(PipelineError, match=r"^sections.student.optimizer.lr must be a finite number >= 0, got None "
                                            r"\(it has 'learning_rate': the field is 'lr'\)$"):
        distill().override(**{"sections.student.optimizer": spec}).validate()
