"""Options of the VLM benchmarks (tools/bench/vlm_text_only.py): checked before anything runs."""

from __future__ import annotations

import pytest

from tools.bench import vlm_text_only


def test_shares_are_comma_separated_fractions():
    assert vlm_text_only.parse_shares("0.33,1") == (0.33, 1.0)
    assert vlm_text_only.parse_shares("0") == (0.0,)


@pytest.mark.parametrize("text", ["1.5", "0.33,-0.1", "a", "", "0.33,"])
def test_a_share_outside_0_to_1_is_a_usage_error_before_any_run(text, capsys):
    with pytest.raises(SystemExit) as exc:
        vlm_text_only.main(["--shares", text])
    assert exc.value.code == 2
    assert "--shares: expected fractions from 0 to 1" in capsys.readouterr().err
