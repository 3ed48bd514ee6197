"""The calibration maths: dividing out a prior, blending the two estimates, and a listing's pull."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchyard.core import calibration as cal

probabilities = st.lists(st.floats(0.001, 1.0), min_size=2, max_size=6).map(
    lambda xs: [x / sum(xs) for x in xs]
)


def test_dividing_out_the_prior_itself_leaves_nothing_to_choose() -> None:
    prior = [0.7, 0.2, 0.1]
    assert cal.calibrate(prior, prior) == pytest.approx([1 / 3] * 3)


def test_a_uniform_prior_changes_nothing() -> None:
    raw = [0.5, 0.3, 0.2]
    assert cal.calibrate(raw, [1 / 3] * 3) == pytest.approx(raw)


def test_a_biased_answer_is_turned_by_the_prior() -> None:
    # The model says positive for everything, a little less for this text.
    prior = [0.90, 0.06, 0.04]
    raw = [0.80, 0.15, 0.05]
    calibrated = cal.calibrate(raw, prior)
    assert max(range(3), key=calibrated.__getitem__) == 1
    # q ∝ p / prior, exactly.
    weights = [r / p for r, p in zip(raw, prior, strict=True)]
    assert calibrated == pytest.approx([w / sum(weights) for w in weights])


@given(probabilities, st.floats(0.01, 100.0))
def test_calibrated_probabilities_are_a_distribution_whatever_the_prior_scale(
    raw: list[float], scale: float
) -> None:
    prior = [1.0 / (i + 1) for i in range(len(raw))]
    out = cal.calibrate(raw, prior)
    assert math.isclose(sum(out), 1.0, rel_tol=1e-9)
    assert all(0.0 <= p <= 1.0 for p in out)
    assert out == pytest.approx(cal.calibrate(raw, [p * scale for p in prior]))


def test_a_zero_prior_is_floored_not_divided_by() -> None:
    out = cal.calibrate([0.5, 0.5], [1.0, 0.0])
    assert math.isclose(sum(out), 1.0) and out[1] > out[0]


def test_the_first_text_of_a_set_is_calibrated_by_the_content_free_prior_alone() -> None:
    assert cal.blend_prior([0.6, 0.4], [0.0, 0.0], 0) == pytest.approx([0.6, 0.4])


def test_the_batch_mean_takes_over_as_texts_arrive() -> None:
    content_free = [0.5, 0.5]
    # 1,000 texts whose mean is [0.9, 0.1]
    sums = [900.0, 100.0]
    blended = cal.blend_prior(content_free, sums, 1000, pseudo_texts=10)
    expected = [(10 * 0.5 + 900) / 1010, (10 * 0.5 + 100) / 1010]
    assert blended == pytest.approx(expected)
    few = cal.blend_prior(content_free, [0.9, 0.1], 1, pseudo_texts=10)
    assert few[0] == pytest.approx((5 + 0.9) / 11)


def test_a_first_position_pull_is_part_of_the_prior_and_divided_out_with_it() -> None:
    """The model doubles the weight of whichever outcome is listed first. A set lists its
    outcomes one way, so its prior (what it answers to texts that say nothing) carries the
    same pull, and dividing by it returns the model's view without it, in either listing."""
    truth = [0.3, 0.5, 0.2]

    def scored(first: int, posterior: list[float]) -> list[float]:
        w = [p * (2.0 if i == first else 1.0) for i, p in enumerate(posterior)]
        return [x / sum(w) for x in w]

    for first in (0, 2):
        prior = scored(first, [1 / 3] * 3)
        assert cal.calibrate(scored(first, truth), prior) == pytest.approx(truth)


def test_mean_probabilities_of_content_free_answers() -> None:
    out = cal.mean_probabilities([[0.9, 0.1], [0.7, 0.3]])
    assert out == pytest.approx([0.8, 0.2])
    with pytest.raises(ValueError):
        cal.mean_probabilities([])


def test_a_set_fingerprint_changes_with_any_wording_order_or_model() -> None:
    base = [("sentiment", "How?", [("positive", "pleased"), ("negative", "")])]
    fp = cal.set_fingerprint("kettei-core", base)
    assert fp == cal.set_fingerprint("kettei-core", [tuple(base[0])])  # stable
    assert len(fp) == 64
    others = [
        cal.set_fingerprint("kettei-fat", base),
        cal.set_fingerprint("kettei-core", [("sentiment", "How so?", base[0][2])]),
        cal.set_fingerprint("kettei-core", [("sentiment", "How?", list(reversed(base[0][2])))]),
        cal.set_fingerprint(
            "kettei-core", [("sentiment", "How?", [("positive", ""), ("negative", "")])]
        ),
    ]
    assert len({fp, *others}) == 5


def test_batch_calibration_recovers_a_biased_models_accuracy() -> None:
    """A synthetic model: a fair posterior times a strong label prior, then renormalised."""
    rng = random.Random(3)
    bias = [8.0, 1.0, 0.5]
    raw_hits = cal_hits = 0
    sums = [0.0, 0.0, 0.0]
    content_free = [b / sum(bias) for b in bias]
    for n in range(600):
        label = rng.randrange(3)
        posterior = [0.2, 0.2, 0.2]
        posterior[label] = 0.6
        noisy = [p * math.exp(rng.gauss(0, 0.3)) for p in posterior]
        w = [p * b for p, b in zip(noisy, bias, strict=True)]
        raw = [x / sum(w) for x in w]
        prior = cal.blend_prior(content_free, sums, n)
        calibrated = cal.calibrate(raw, prior)
        raw_hits += max(range(3), key=raw.__getitem__) == label
        cal_hits += max(range(3), key=calibrated.__getitem__) == label
        sums = [s + r for s, r in zip(sums, raw, strict=True)]
    assert raw_hits / 600 < 0.45
    assert cal_hits / 600 > 0.8


def test_the_content_free_prior_counts_as_a_few_texts_by_default() -> None:
    """A few texts' worth (tuned): the batch mean soon outweighs it."""
    content_free = [0.8, 0.2]
    blended = cal.blend_prior(content_free, [0.1, 0.9], 1)
    c = cal.BATCH_PSEUDO_TEXTS
    assert blended == pytest.approx([(c * 0.8 + 0.1) / (c + 1), (c * 0.2 + 0.9) / (c + 1)])
    assert 1.0 <= c <= 10.0
