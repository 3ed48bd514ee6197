"""Analogues: what followed moments like now, read from a market's own past."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from batchyard.core.outlook import BIN, Analogues, MarketHistory, Outlook, _outages, bin_index

T0 = datetime(2026, 3, 2, tzinfo=UTC)
NOTHING = -math.inf


def triangle(days: int, low: float = 20.0, high: float = 80.0, half: int = 180) -> list[float]:
    """A discount that deepens for ``half`` bins (6 h), then eases as long, over and over."""
    period = 2 * half
    out = []
    for i in range(days * 720):
        phase = i % period
        up = phase if phase < half else period - phase
        out.append(low + (high - low) * up / half)
    return out


def test_on_the_deepening_side_waiting_beats_taking_now() -> None:
    bins = triangle(3)
    bins = bins[: 5 * 360 + 91]  # stop half-way up a deepening stretch
    now = bins[-1]
    chance, cost = Outlook(bins).waiting(150, 30.0) or (0.0, 0.0)
    assert chance == 1.0
    assert cost < 100 - now - 10  # the analogues went on deepening


def test_on_the_easing_side_taking_now_is_as_good_as_waiting() -> None:
    bins = triangle(3)
    bins = bins[: 5 * 360 + 191]  # just past the deepest point, easing
    now = bins[-1]
    _, cost = Outlook(bins).waiting(60, 30.0) or (0.0, 0.0)
    assert cost >= 100 - now - 2


def test_chance_counts_futures_that_held_a_qualifying_price() -> None:
    # Qualifying (60) for one bin in 60, else 10: a short wait rarely sees it.
    bins = [60.0 if i % 60 == 0 else 10.0 for i in range(3 * 720)]
    short = Outlook(bins).waiting(5, 50.0)
    long = Outlook(bins).waiting(100, 50.0)
    assert short is not None and long is not None
    assert short[0] < 0.5
    assert long[0] == 1.0


def test_a_missed_future_costs_the_penalty() -> None:
    # Nothing ever qualifies at 90: every plan falls back to nothing.
    bins = [40.0] * 2000
    view = Outlook(bins, Analogues(penalty=500.0)).waiting(30, 90.0)
    assert view == (0.0, 500.0)


def test_analogues_are_kept_apart_and_need_a_history() -> None:
    outlook = Outlook([50.0] * 1000, Analogues(k=10, spacing=20))
    picked = outlook._apart(np.arange(100, 400, dtype=np.int64))
    assert len(picked) == 10
    assert np.diff(np.sort(picked)).min() >= 20
    assert Outlook([50.0] * 50).waiting(10, 30.0) is None  # too short for a shape
    assert Outlook([50.0] * 1000).waiting(0, 30.0) is None


def test_a_moment_unlike_any_in_the_past_has_no_analogues() -> None:
    # A calm market at 30 that suddenly sits at 90: nothing in its past looks
    # like the last hours, so there is nothing to learn from, only to take.
    bins = [30.0] * 2000 + [90.0] * 200
    assert Outlook(bins).waiting(20, 50.0) is None
    assert Outlook(bins, Analogues(unlike=100.0)).waiting(20, 50.0) is not None


def test_a_feed_outage_hides_the_level_but_does_not_end_it() -> None:
    # The same market with and without a gap: the shape now is read through it.
    bins = triangle(3)
    gapped = list(bins)
    gapped[-20:-5] = [NOTHING] * 15
    a = Outlook(bins).waiting(60, 30.0)
    b = Outlook(gapped).waiting(60, 30.0)
    assert a is not None and b is not None
    assert b[1] == pytest.approx(a[1], abs=5)


def test_outages_are_learnt_from_the_whole_history() -> None:
    # One 10-bin outage every 100 bins: rate 1/100, so the chance that a
    # window's end lies in one that began inside it grows to 10 % and stops.
    values = np.array([NOTHING if i % 100 >= 90 else 50.0 for i in range(2000)])
    dark = _outages(values)
    assert dark[0] == pytest.approx(0.01)
    assert dark[4] == pytest.approx(0.05)
    assert dark[50] == pytest.approx(0.10)
    assert not _outages(np.array([50.0] * 100)).any()  # a feed that never went dark


def test_a_feed_that_goes_dark_makes_waiting_dearer() -> None:
    # The same flat market, with and without outages: waiting for more than
    # is on offer now is worth less when the fallback may find nothing.
    flat = [60.0 if i % 10 else 70.0 for i in range(3000)]
    dark = [NOTHING if i % 120 >= 100 else v for i, v in enumerate(flat)]
    dark[-5:] = flat[-5:]
    lit = Outlook(flat).waiting(20, 50.0)
    unlit = Outlook(dark).waiting(20, 50.0)
    assert lit is not None and unlit is not None
    assert unlit[1] > lit[1]


def test_analogue_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        Analogues(k=2)
    with pytest.raises(ValueError):
        Analogues(penalty=-1)


def test_history_bins_passes_and_counts_idle_bins_as_nothing() -> None:
    history = MarketHistory(memory=timedelta(hours=1))
    history.add(T0, 40.0)
    history.add(T0 + timedelta(seconds=15), 45.0)  # same bin: the deepest stays
    history.add(T0 + timedelta(seconds=15), 90.0)  # same pass again: ignored
    history.add(T0 + 3 * BIN, None)
    saved = history.saved()
    first = bin_index(T0)
    assert saved == [(first, 45.0), (first + 1, None), (first + 2, None), (first + 3, None)]
    assert history.span() == 4 * BIN


def test_history_keeps_only_its_memory_and_restores_what_was_saved() -> None:
    history = MarketHistory(memory=timedelta(hours=1))
    for i in range(120):
        history.add(T0 + i * BIN, float(i))
    assert history.span() <= timedelta(hours=1) * 1.2
    other = MarketHistory(memory=timedelta(hours=1))
    other.restore(history.saved())
    assert other.saved() == history.saved()
    assert history.saved(since=bin_index(T0 + 119 * BIN)) == [(bin_index(T0 + 119 * BIN), 119.0)]
    # The outlook is computed once per bin and shared by every item in it.
    here = history.outlook(T0 + 119 * BIN)
    assert history.outlook(T0 + 119 * BIN + timedelta(seconds=30)) is here
    assert history.outlook(T0 + 120 * BIN) is not here
