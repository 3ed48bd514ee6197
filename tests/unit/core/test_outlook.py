"""Per-route histories and the scenarios read from them."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from batchyard.core.outlook import HistoryScenarios, depth, discount, first_crossing, fit_route
from batchyard.core.route_history import SLOT, RouteHistory, slot_index
from batchyard.core.stopping import COLUMNS

T0 = datetime(2026, 3, 2, tzinfo=UTC)
DAY = 5760  # slots


def test_a_history_keeps_the_deeper_of_two_looks_and_tells_unseen_from_unpayable() -> None:
    history = RouteHistory(keep=100)
    history.put(10, 40.0)
    history.put(10, 35.0)  # a second pass in the same slot saw less: the deeper stays
    history.put(12, None)  # looked, nothing payable
    window = history.window(9, 14)
    assert window[1] == 40.0 and math.isinf(window[3]) and window[3] < 0
    assert np.isnan(window[[0, 2, 4]]).all()  # nobody looked
    assert history.saved() == [(10, 40.0), (12, None)]
    assert history.saved(since=11) == [(12, None)]
    again = RouteHistory(keep=100)
    again.restore(history.saved())
    assert again.saved() == history.saved()


def test_a_history_forgets_what_is_older_than_it_keeps() -> None:
    history = RouteHistory(keep=100)
    for slot in range(1000):
        history.put(slot, float(slot % 7))
    assert history.first is not None and history.last == 999
    assert 100 <= history.span() <= 100 + 100 // 8 + 1
    history.put(5, 1.0)  # far too old: ignored
    assert history.first > 5
    # A slot older than the first, still within reach of the last, is kept (a restore).
    young = RouteHistory(keep=100)
    young.put(50, 1.0)
    young.put(40, 3.0)
    assert young.first == 40 and young.saved() == [(40, 3.0), (50, 1.0)]


def test_depth_and_discount_are_inverse_and_keep_unpayable() -> None:
    points = np.array([-20.0, 0.0, 50.0, 95.0, -math.inf])
    back = discount(depth(points))
    assert back[:4] == pytest.approx(points[:4])
    assert math.isinf(back[4]) and back[4] < 0


def _series(days: int, cycle: float, noise: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    slots = np.arange(days * DAY)
    log_price = math.log(0.5) + cycle * np.cos(2 * math.pi * slots / DAY)
    log_price = log_price + rng.normal(0, noise, len(slots))
    return np.asarray(100 * (1 - np.exp(log_price)))


def test_a_daily_cycle_is_found_when_there_is_one_and_only_then() -> None:
    cyclic = fit_route(depth(_series(3, 0.4, 0.05)), 0)
    flat = fit_route(depth(_series(3, 0.0, 0.05)), 0)
    peak_to_trough = np.ptp(cyclic.profile)
    assert peak_to_trough == pytest.approx(0.8, rel=0.1)  # 2 x 0.4 in log price
    assert not flat.profile.any()
    # Noise fresh at every check leaves no memory; a slow wander does.
    assert flat.memory(np.array([8.0]))[0] < 0.2
    rng = np.random.default_rng(1)
    wander = np.zeros(2 * DAY)
    for k in range(1, len(wander)):
        wander[k] = 0.995 * wander[k - 1] + rng.normal(0, 0.02)
    slow = fit_route(wander, 0)
    assert slow.memory(np.array([8.0]))[0] > 0.8


def _watched(days: float, cycle: float) -> HistoryScenarios:
    source = HistoryScenarios()
    first = slot_index(T0)
    values = _series(math.ceil(days), cycle, 0.03)[: int(days * DAY)]
    history = source.history("a")
    history.restore((first + k, float(v)) for k, v in enumerate(values))
    return source


def test_no_opinion_before_a_day_has_been_seen() -> None:
    source = _watched(0.9, 0.4)
    assert source.scenarios(["a"], T0 + 0.9 * DAY * SLOT) is None
    assert source.scenarios(["never-seen"], T0 + DAY * SLOT) is None


def test_scenarios_see_the_cycle_coming() -> None:
    # Two days of a cycle whose price peaks at midnight: at midnight every scenario
    # should find it far cheaper at noon.
    source = _watched(2.0, 0.4)
    now = T0 + timedelta(days=2) - SLOT
    got = source.scenarios(["a"], now)
    assert got is not None
    discounts, cover = got
    assert discounts.shape == (64, len(COLUMNS.widths))
    assert cover >= 12 * 240
    mids = COLUMNS.offsets + COLUMNS.widths // 2
    noon = int(np.argmin(abs(mids - 12 * 240)))
    assert (discounts[:, noon] > discounts[:, 0] + 25).all()
    expected = 100 * (1 - 0.5 * math.exp(0.4))
    assert float(np.median(discounts[:, 0])) == pytest.approx(expected, abs=3)


def test_first_crossing_tells_a_plateau_from_a_ramp() -> None:
    rng = np.random.default_rng(5)
    # Plateaus: a block is one level throughout, so the first check past any
    # threshold is already the deepest.
    flat = np.repeat(rng.normal(0, 1, size=(400, 1)), 16, axis=1)
    assert first_crossing(flat) == pytest.approx(0.0)
    # Ramps that deepen through the block: the first check past the threshold is
    # at the threshold's edge, far from the deepest (the last).
    ramps = rng.normal(0, 1, size=(400, 1)) + np.linspace(0, 3, 16)[None, :]
    got = first_crossing(ramps)
    assert got is not None and got > 0.6
    # Too few blocks cross to tell, or nothing known: no opinion.
    assert first_crossing(flat[:20]) is None
    assert first_crossing(np.full((400, 16), -np.inf)) is None
