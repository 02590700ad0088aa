"""Cost refinement from measured micro-batch timings (maestro_flow/planner/costfit.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from maestro_flow.config import Cost
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.costfit import CostFitter, Timing, fit_nonnegative


def timings(kind, a, b, n=200, noise=0.0, seed=0):
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        samples, tokens = rnd.randint(1, 8), rnd.randint(10, 2000)
        seconds = (a * samples + b * tokens) * (1 + rnd.uniform(-noise, noise))
        out.append(Timing(kind=kind, samples=samples, tokens=tokens, patches=0, frames=0, seconds=seconds))
    return out


def test_recovers_known_coefficients():
    prior = CostModel(costs={"llm": Cost(per_sample_s=1.0, per_token_s=1.0)})
    fitter = CostFitter(prior, prior_weight=0.01)
    fitter.add("llm", timings("forward", 2e-3, 5e-5))
    fitted = fitter.model().costs["llm"]
    assert fitted.per_sample_s == pytest.approx(2e-3, rel=0.05)
    assert fitted.per_token_s == pytest.approx(5e-5, rel=0.05)


def test_loss_sections_split_forward_and_backward_by_the_factor():
    prior = CostModel(costs={"llm": Cost(per_sample_s=1.0, per_token_s=1.0, backward_factor=2.0)})
    fitter = CostFitter(prior, prior_weight=0.01)
    fitter.add("llm", timings("forward+backward", 3e-3, 3e-5))
    fitted = fitter.model().costs["llm"]
    assert fitted.per_sample_s == pytest.approx(1e-3, rel=0.05)
    assert fitted.per_token_s == pytest.approx(1e-5, rel=0.05)


def test_backward_factor_is_measured_for_trainable_producers():
    prior = CostModel(costs={"vision": Cost(per_sample_s=1.0, per_token_s=1.0, backward_factor=2.0)})
    fitter = CostFitter(prior)
    fitter.add("vision", timings("forward", 1e-3, 1e-5) + timings("backward", 3e-3, 3e-5))
    assert fitter.model().costs["vision"].backward_factor == pytest.approx(3.0, rel=1e-6)


def test_unused_features_stay_zero_and_coefficients_are_never_negative():
    prior = CostModel(costs={"vision": Cost(per_sample_s=1e-3, per_patch_s=1e-5)})
    fitter = CostFitter(prior)
    # Time falls with tokens here, which a linear fit with a token term would follow; the
    # vision section's Cost does not use tokens, so the fit ignores them.
    obs = [Timing(kind="forward", samples=4, tokens=t, patches=p, frames=0, seconds=1e-3 * 4 + 2e-5 * p)
           for t, p in ((100, 64), (2000, 256), (50, 512), (800, 128))]
    fitter.add("vision", obs * 20)
    fitted = fitter.model().costs["vision"]
    assert fitted.per_token_s == 0.0 and fitted.per_frame_s == 0.0
    assert fitted.per_patch_s > 0 and fitted.per_sample_s >= 0
    assert all(c >= 0 for c in fit_nonnegative([((1.0, 5.0), 1.0), ((1.0, 10.0), 0.5)], (0.1, 0.1), 0.01))


def test_the_prior_holds_without_timings_and_keeps_its_shape_with_few():
    prior = CostModel(costs={"llm": Cost(per_sample_s=1e-3, per_token_s=1e-5)})
    fitter = CostFitter(prior, prior_weight=4.0)
    assert fitter.model() == prior
    # One measurement cannot tell samples from tokens: the prior's proportions stay, at the
    # measured scale (ten times slower than the prior said).
    fitter.add("llm", [Timing(kind="forward", samples=2, tokens=100, patches=0, frames=0, seconds=0.03)])
    fitted = fitter.model().costs["llm"]
    assert fitted.per_token_s / fitted.per_sample_s == pytest.approx(1e-2, rel=1e-6)
    assert 2 * fitted.per_sample_s + 100 * fitted.per_token_s == pytest.approx(0.03, rel=1e-6)


# -- padding (Cost.padded) ------------------------------------------------------------------------


def test_a_padded_stage_is_charged_at_its_longest_sample():
    from maestro_flow.samples import SampleMeta

    short, long = SampleMeta(id=0, num_tokens=10), SampleMeta(id=1, num_tokens=90, num_patches=4)
    cost = Cost(per_sample_s=1.0, per_token_s=0.1, per_patch_s=1.0, per_micro_batch_s=5.0)
    from maestro_flow.planner.cost import charged

    assert charged(cost, [short, long]) == (2, 100, 4, 0)
    padded = dataclasses.replace(cost, padded=True)
    assert charged(padded, [short, long]) == (2, 180, 8, 0)
    model = CostModel(costs={"plain": cost, "padded": padded})
    assert model.batch_s("plain", [short, long]) == pytest.approx(5 + 2 + 10 + 4)
    assert model.batch_s("padded", [short, long]) == pytest.approx(5 + 2 + 18 + 8)
    assert model.batch_s("padded", [short]) == model.batch_s("plain", [short])  # one sample: no padding
    assert model.batch_s("padded", []) == 0.0
    # A sample's own cost (what the planner orders by) stays its own length's.
    assert model.sample_s("padded", short) == model.sample_s("plain", short) == pytest.approx(2.0)


def test_padded_timings_fit_the_padded_coefficients():
    """Timings of a padding stage, reported as the executor reports them (charged counts),
    recover the true coefficients; the same timings read as sums would not."""
    from maestro_flow.planner.cost import charged
    from maestro_flow.samples import SampleMeta

    rnd = random.Random(1)
    true = Cost(per_sample_s=2e-3, per_token_s=5e-5, per_micro_batch_s=1e-3, padded=True)
    out = []
    for _ in range(300):
        mb = [SampleMeta(id=i, num_tokens=rnd.randint(20, 400)) for i in range(rnd.randint(1, 8))]
        n, tokens, _, _ = charged(true, mb)
        seconds = CostModel(costs={"lm": true}).batch_s("lm", mb)
        out.append(Timing(kind="forward", samples=n, tokens=tokens, patches=0, frames=0, seconds=seconds))
    fitter = CostFitter(CostModel(costs={"lm": Cost(per_sample_s=1.0, per_token_s=1.0, padded=True)}),
                        prior_weight=0.01)
    fitter.add("lm", out)
    fitted = fitter.model().costs["lm"]
    assert fitted.padded
    assert fitted.per_token_s == pytest.approx(5e-5, rel=0.02)
    assert fitted.per_sample_s == pytest.approx(2e-3, rel=0.05)


def test_padded_must_be_a_boolean():
    from maestro_flow.errors import PipelineError

    with pytest.raises(PipelineError, match="cost.padded must be true or false"):
        Cost(padded="yes").validate("sections.lm")
    # That it survives a cost file: tests/unit/test_costfile.py


def test_maestro_profile_detects_padding_from_mixed_micro_batches():
    """fit_section fits the timings both ways and keeps the clearly better model: timings of a
    stage that pads are detected as padded whatever the Cost declared, and those of one that
    does not as not padded; the rows are recounted as the chosen model charges them."""
    from maestro_flow.runtime.profile_fit import fit_section
    from maestro_flow.samples import SampleMeta

    rnd = random.Random(3)
    mbs = []
    for m in (1, 2, 4, 8):
        for _ in range(4):
            mbs.append([rnd.choice((20, 40, 300)) for _ in range(m)])
    for truth in (True, False):
        model = CostModel(costs={"s": Cost(per_sample_s=1e-3, per_token_s=1e-4, per_micro_batch_s=2e-3, padded=truth)})
        rows = [{"samples": len(mb), "tokens": sum(mb), "patches": 0, "frames": 0, "sizes": [[t, 0, 0] for t in mb],
                 "forward_s": model.batch_s("s", [SampleMeta(id=i, num_tokens=t) for i, t in enumerate(mb)]),
                 "backward_s": 0.0, "peak_mb": 1.0} for mb in mbs]
        fitted = fit_section(Cost(per_sample_s=1e-3, per_token_s=1e-4, padded=not truth), rows, False, 1.0, {"name": "adamw"})
        assert fitted["cost"]["padded"] is truth and fitted["padding"]["declared"] is (not truth)
        assert fitted["cost"]["per_token_s"] == pytest.approx(1e-4, rel=0.05)
        mixed = next(r for r in rows if len(set(t for t, _, _ in r["sizes"])) > 1)
        assert mixed["tokens"] == (len(mixed["sizes"]) * max(t for t, _, _ in mixed["sizes"]) if truth
                                   else sum(t for t, _, _ in mixed["sizes"]))


def test_one_micro_batch_size_fits_no_fixed_cost_as_profile_says():
    """Found in QA: with `--sizes 1` profile said the fixed cost per micro-batch "is fitted as 0",
    and the file held 0.000785 s (the two collinear terms split between prior and data)."""
    from maestro_flow.runtime.profile_fit import fit_section

    rows = [{"samples": 4, "tokens": 4 * t, "patches": 0, "frames": 0, "forward_s": 2e-3 + 4 * 1e-3 + 4 * t * 1e-5,
             "backward_s": 0.0, "peak_mb": 1.0} for t in (20, 40, 80, 160)]
    fitted = fit_section(Cost(per_sample_s=1e-3, per_token_s=1e-5, per_micro_batch_s=5e-4), rows, False, 1.0,
                         {"name": "adamw"})
    assert fitted["cost"]["per_micro_batch_s"] == 0.0 and fitted["micro_batch_overhead_s"] == 0.0
    assert fitted["cost"]["per_sample_s"] == pytest.approx(1e-3 + 2e-3 / 4, rel=0.05)  # the fixed cost in it
    two = [{**r, "samples": 8, "forward_s": 2e-3 + 8 * 1e-3 + 8 * t * 1e-5, "tokens": 8 * t} for r, t in
           zip(rows, (20, 40, 80, 160), strict=True)]
    both = fit_section(Cost(per_sample_s=1e-3, per_token_s=1e-5), rows + two, False, 1.0, {"name": "adamw"})
    assert both["cost"]["per_micro_batch_s"] == pytest.approx(2e-3, rel=0.1)  # two sizes: told apart


def test_micro_batches_without_a_backward_do_not_bias_the_backward_factor():
    """An encoder whose consumer sends gradients for half of its micro-batches (the others hold
    samples the consumer does not activate on): before, the factor was the ratio of the two
    windows' sums, 1.0 here until the forward window filled (64 steps)."""
    prior = CostModel(costs={"enc": Cost(per_sample_s=1e-3, backward_factor=1.0)})
    fitter = CostFitter(prior)
    for step in range(1, 80):
        fitter.add("enc", [["forward", 4, 0, 0, 0, 0.010]] * 4 + [["backward", 4, 0, 0, 0, 0.020]] * 2)
        if step in (1, 10, 63, 79):
            assert fitter.model().costs["enc"].backward_factor == pytest.approx(2.0, rel=1e-9), step


def test_the_backward_factor_compares_each_window_with_its_own_modelled_forward():
    """Backwards only for the long micro-batches (each backward twice its forward): the factor is
    2, not the ratio of per-micro-batch or per-sample means over windows of different lengths."""
    prior = CostModel(costs={"enc": Cost(per_sample_s=1.0, per_token_s=1.0, backward_factor=1.0)})
    fitter = CostFitter(prior, prior_weight=0.01)
    forward = [Timing(kind="forward", samples=4, tokens=t, patches=0, frames=0, seconds=4e-3 + 1e-5 * t)
               for t in (100, 1000) * 20]
    fitter.add("enc", forward + [dataclasses.replace(t, kind="backward", seconds=2 * t.seconds)
                                 for t in forward if t.tokens == 1000])
    assert fitter.model().costs["enc"].backward_factor == pytest.approx(2.0, rel=0.01)
