"""The Stage contract as users write it (DESIGN 5.2): a stage that declares no outputs passes
`maestro validate`, trains, and is checked when it first returns; `ctx.device` and `ctx.dtype`
are torch objects."""

from __future__ import annotations

import pytest

from tests.integration.conftest import ASSETS, maestro

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
PIPELINE = str(ASSETS / "plain.py")


def test_undeclared_outputs_validate_and_train(demo_data):
    result = maestro("validate", PIPELINE, "--set", f"data.path={demo_data}")
    assert result.returncode == 0, result.stderr
    for mode in ([], ["--colocated"]):
        result = maestro("run", PIPELINE, "--quiet", "--no-run-dir", "--set", f"data.path={demo_data}",
                         "--set", "dtype=float64", *mode)
        assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("setting, expected", [
    ("sections.embed.config.forget=true",
     "section 'embed': plain_stages:Embedder.forward returned no 'feat' (returned: other); edge embed->head carries it"),
    ("sections.head.config.no_loss=true",
     "section 'head': plain_stages:Regressor.forward returned no 'loss' (returned: total)"),
])
def test_a_missing_output_is_named_when_the_stage_first_returns(demo_data, setting, expected):
    result = maestro("run", PIPELINE, "--quiet", "--no-run-dir", "--set", f"data.path={demo_data}", "--set", setting)
    assert result.returncode == 1
    assert expected in result.stderr
    assert "during forward at step 1" in result.stderr


@pytest.mark.parametrize("mode", [[], ["--colocated"]], ids=["sections", "colocated"])
def test_a_broken_output_is_one_stage_error_in_both_modes(demo_data, mode):
    """Found in review: numpy arrays as a stage's output failed inside maestro (a system error with
    maestro's traceback; in colocated mode an uncaught traceback and no `error:` line)."""
    result = maestro("run", PIPELINE, "--quiet", "--no-run-dir", "--set", f"data.path={demo_data}",
                     "--set", "sections.embed.config.numpy=true", *mode)
    assert result.returncode == 1, result.stderr[-2000:]
    assert ("error: stage error in section 'embed' replica 0 (rank 0) during forward at step 1:\n"
            "section 'embed': plain_stages:Embedder.forward returned 'feat' as a list whose entry 0 is ndarray "
            "of shape [") in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
