"""runtime/build.load_pipeline: a pipeline file is imported once per process while unchanged."""

from __future__ import annotations

import os

import pytest

from maestro_flow.errors import PipelineError
from maestro_flow.runtime.build import imports_once, load_pipeline

BODY = """
import os
from maestro_flow import Pipeline, Section

with open(os.environ["IMPORT_LOG"], "a") as f:
    f.write("x")


def pipeline(steps={steps}, **over):
    return Pipeline(name="p", steps=steps, global_batch=2,
                    sections=[Section(name="s", stage="stages.causal_lm:CausalLM", config={{"vocab_size": 8}})],
                    data={{"path": "unused"}}).override(**over)
"""


def test_a_pipeline_file_is_imported_once_until_it_changes(tmp_path, monkeypatch):
    log = tmp_path / "imports.txt"
    monkeypatch.setenv("IMPORT_LOG", str(log))
    path = tmp_path / "once.py"
    path.write_text(BODY.format(steps=3))
    with imports_once():  # one maestro command
        first, _ = load_pipeline(str(path))
        again, _ = load_pipeline(str(path), {"steps": 5})  # the factory runs each time, with its overrides
        assert (first.steps, again.steps) == (3, 5)
        assert log.read_text() == "x"
        path.write_text(BODY.format(steps=4))
        os.utime(path, ns=(1, 1))  # a changed file is imported again, even at the same size and in the same tick
        assert load_pipeline(str(path))[0].steps == 4
        assert log.read_text() == "xx"
    # Outside a command (a program loading pipelines in a loop): imported every time, as before
    # (found in review: a pipeline reading os.environ at import kept its first value).
    load_pipeline(str(path))
    load_pipeline(str(path))
    assert log.read_text() == "xxxx"


def test_a_file_that_failed_to_import_is_tried_again(tmp_path, monkeypatch):
    monkeypatch.setenv("IMPORT_LOG", str(tmp_path / "imports.txt"))
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('not yet')\n")
    with pytest.raises(PipelineError, match="importing the pipeline file failed: RuntimeError: not yet"):
        load_pipeline(str(path))
    with pytest.raises(PipelineError, match="not yet"):
        load_pipeline(str(path))


def test_a_file_that_is_not_python_is_refused_in_one_line(tmp_path):
    """Found in review: a run folder's pipeline.json gave every command a traceback, and
    `maestro stage` blamed the section for it."""
    from click.testing import CliRunner

    from maestro_flow.cli import main

    path = tmp_path / "pipeline.json"
    path.write_text("{}")
    with pytest.raises(PipelineError, match=r"pipeline.json: not a Python pipeline file \(give a \.py file"):
        load_pipeline(str(path))
    for args in (["validate", str(path)], ["stage", str(path), "student"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.output.strip().endswith("not a Python pipeline file (give a .py file that defines "
                                              "pipeline(**overrides))"), result.output
