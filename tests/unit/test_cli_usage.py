"""cli_usage: a pipeline taken as `--trace`'s optional FILE is named in the usage error."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from maestro_flow.cli import main


@pytest.mark.parametrize("args", [["--trace", "pipelines/vlm.py"], ["--trace", "pipelines/vlm.py", "--steps", "2"]])
def test_a_pipeline_taken_as_the_trace_file_is_named(args):
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 2
    assert "--trace took 'pipelines/vlm.py' as its FILE" in result.output
    assert "Put --trace after PIPELINE, or write --trace=FILE" in result.output


@pytest.mark.parametrize("args", [["--steps", "2"], ["--trace=t.json"], ["--trace", "--steps", "2"]])
def test_a_missing_pipeline_alone_keeps_clicks_words(args):
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 2
    assert "Missing argument 'PIPELINE'." in result.output
    assert "took" not in result.output


def test_the_version_is_the_package_s():
    from importlib.metadata import version

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"maestro_flow {version('maestro_flow')}\n"
