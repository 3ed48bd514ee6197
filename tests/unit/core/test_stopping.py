"""Backward induction over scenarios: values, risk and the column layout."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from batchyard.core.stopping import COLUMNS, HORIZONS, Columns, solve

COVER = int(COLUMNS.ends[-1])


def test_the_layout_covers_a_day_and_a_bit_in_aligned_columns() -> None:
    assert COVER >= 24 * 240
    assert (COLUMNS.offsets % COLUMNS.widths == 0).all()
    assert (COLUMNS.offsets[1:] == COLUMNS.ends[:-1]).all()
    assert HORIZONS[0] >= 1 and HORIZONS[-1] == COVER
    with pytest.raises(ValueError):
        Columns.layout(((3, 1), (2, 4)))  # a 4-wide column cannot start at check 3


def test_a_flat_market_is_worth_its_price_and_an_empty_one_the_penalty() -> None:
    flat = np.full((32, len(COLUMNS.widths)), 70.0)
    plans = solve(flat, [50.0, 80.0], COVER, penalty=300.0)
    got = plans.lookup(50.0, 1000, 1000)
    assert got is not None and got[0] == pytest.approx(30.0)
    assert got[1] > 10  # chances at every column
    never = plans.lookup(80.0, 1000, 1000)
    assert never == (pytest.approx(300.0), 0)
    assert plans.lookup(65.0, 1000, 1000) is None  # not solved for


def test_longer_windows_are_worth_more_on_a_market_of_fresh_draws() -> None:
    rng = np.random.default_rng(3)
    draws = rng.uniform(20, 80, size=(128, len(COLUMNS.widths)))
    plans = solve(draws, [20.0], COVER)
    values = [plans.lookup(20.0, int(n), int(n)) for n in HORIZONS]
    costs = [v[0] for v in values if v is not None]
    # Longer is never dearer, up to the regression's noise near the floor of 20.
    assert all(b <= a + 0.5 for a, b in itertools.pairwise(costs))
    assert costs[-1] < costs[len(costs) // 2] < costs[0]
    # One check left: the plan takes the next check at whatever it offers.
    assert costs[0] < 80 and costs[-1] < 25


def test_the_one_column_case_matches_the_exact_expectation() -> None:
    # Two single checks: stop at the first if it beats the mean of the second.
    cols = Columns.layout(((2, 1),))
    first = np.array([10.0, 30.0, 50.0, 70.0])
    second = np.array([40.0, 40.0, 40.0, 40.0])
    plans = solve(
        np.stack([first, second], axis=1),
        [0.0],
        2,
        columns=cols,
        horizons=np.array([2]),
        regress=False,
    )
    # Costs are 100 - discount: second costs 60; first costs 90, 70, 50, 30.
    expected = np.mean([60, 60, 50, 30])
    assert plans.value[0, 0] == pytest.approx(expected)


def test_risk_counts_chances_in_the_worst_scenarios() -> None:
    chances = np.full((20, len(COLUMNS.widths)), -np.inf)
    chances[:, :10] = 60.0
    chances[0, 5:] = -np.inf  # one scenario has only five chances
    plans = solve(chances, [50.0], COVER, risk=0.0)
    assert plans.lookup(50.0, COVER, COVER) == (pytest.approx(plans.value[0, -1]), 5)
    lenient = solve(chances, [50.0], COVER, risk=0.1)
    assert lenient.lookup(50.0, COVER, COVER)[1] == 10  # type: ignore[index]


def test_a_stop_in_a_wide_column_is_charged_between_its_deepest_price_and_the_threshold() -> None:
    # Now 40 % off; then a two-check column whose deepest price is 90 % off, then the end.
    cols = Columns.layout(((2, 1), (1, 2)))
    discounts = np.tile(np.array([40.0, -np.inf, 90.0]), (8, 1))

    def value(charge: float) -> float:
        plans = solve(
            discounts, [30.0], 4, columns=cols, horizons=np.array([4]), regress=False,
            charge=charge, penalty=300.0,
        )  # fmt: skip
        return float(plans.value[0, 0])

    # Charged its deepest price (10), the column is worth waiting for ...
    assert value(0.0) == pytest.approx(10.0)
    # ... charged half way to the threshold there (the penalty, 300), it is not.
    assert value(0.5) == pytest.approx(60.0)
    with pytest.raises(ValueError):
        value(1.5)
