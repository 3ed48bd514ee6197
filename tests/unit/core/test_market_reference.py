"""The market bench's reference: optimal stopping on the true law, never a future draw."""

from __future__ import annotations

import numpy as np
import pytest
from bench.market.laws import family
from bench.market.reference import LookAhead, Present, _lsmc
from bench.market.trace import Trace


def test_the_present_refuses_any_check_the_replay_has_not_shown() -> None:
    present = Present(Trace(family("cycle+noise", 1), 1, 1))
    present.advance(100)
    assert present.state(100).check == 100
    assert present.state(3).check == 3  # the past is readable
    with pytest.raises(LookAhead):
        present.state(101)
    present.advance(50)  # the clock never goes back
    assert present.now == 100


def test_lsmc_matches_the_exact_value_of_stopping_on_fresh_draws() -> None:
    # A fresh uniform price each check, a penalty of 1 after the last: the optimal
    # value is v[n] = 1, v[k] = E[min(U, v[k + 1])] = v - v^2 / 2 (backward induction).
    checks, paths = 12, 20000
    rng = np.random.default_rng(1)
    x = rng.uniform(0, 1, size=(paths, checks))
    y = np.ones_like(x)
    value, coef = _lsmc(x, y, np.array([checks - 1, 3]), 1.0, keep=2)
    exact = []
    for n in (checks, 4):
        v = 1.0
        for _ in range(n):
            v = v - v * v / 2
        exact.append(v)
    assert value == pytest.approx(exact, abs=0.01)
    # The continuation after the first check is a constant: what the last 11 draws are worth.
    v = 1.0
    for _ in range(checks - 1):
        v = v - v * v / 2
    assert coef[0, 0] @ np.array([1, 0.5, 1, 0.25, 1, 0.5]) == pytest.approx(v, abs=0.01)
