"""The route's request limit: declared, learned from headers, learned from 429s; the send window."""

from __future__ import annotations

import pytest

from batchyard.core.clock import ManualClock
from batchyard.core.limits import RateLimitSignal
from batchyard.core.route_pace import (
    BACKOFF_FACTOR,
    MAX_MARGIN,
    PACE_MARGIN,
    RECOVERY_FACTOR,
    RoutePace,
)


def test_a_declared_limit_paces_under_it_and_allows_its_per_second_share() -> None:
    pace = RoutePace(3000)
    assert pace.source == "declared" and not pace.cold
    assert pace.pace_rpm == pytest.approx(3000 * (1 - PACE_MARGIN))
    assert pace.per_window == 50


def test_the_send_window_holds_the_next_send_until_the_oldest_is_a_second_old() -> None:
    clock = ManualClock()
    pace = RoutePace(180)  # 3 a second
    for _ in range(3):
        assert pace.send_delay(clock.time()) == 0.0
        pace.sent(clock.time())
        clock.advance(0.1)
    # Three went out at 0.0, 0.1 and 0.2; the fourth waits for the first to be 1 s old.
    assert pace.send_delay(clock.time()) == pytest.approx(0.7)
    clock.advance(0.7)
    assert pace.send_delay(clock.time()) == 0.0


def test_an_undeclared_route_is_cold_until_it_answers_and_learns_the_limit_header() -> None:
    clock = ManualClock()
    pace = RoutePace()
    assert pace.cold and pace.rpm is None and pace.per_window is None

    pace.answered_with(RateLimitSignal(remaining_requests=49, limit_requests=3000), clock.time())
    assert not pace.cold
    assert (pace.source, pace.rpm, pace.per_window) == ("headers", 3000.0, 50)


def test_an_answer_without_headers_ends_the_cold_start_and_sets_no_limit() -> None:
    pace = RoutePace()
    pace.answered_with(None, ManualClock().time())
    assert not pace.cold and pace.rpm is None and pace.source == "unknown"


def test_a_refusal_that_names_the_limit_is_learned_as_it_is() -> None:
    pace = RoutePace()
    pace.refused(RateLimitSignal(remaining_requests=0, limit_requests=600), ManualClock().time())
    assert (pace.source, pace.rpm) == ("headers", 600.0)


def test_one_refused_call_says_when_to_come_back_not_how_fast() -> None:
    clock = ManualClock()
    pace = RoutePace()
    pace.sent(clock.time())
    pace.refused(None, clock.time())
    assert pace.rpm is None and not pace.cold


def test_refusals_without_headers_back_off_from_the_rate_sent_and_recover_slowly() -> None:
    clock = ManualClock()
    pace = RoutePace()
    for _ in range(10):  # ten sends within the last second: 600 a minute
        pace.sent(clock.time())
        clock.advance(0.05)
    pace.refused(None, clock.time())
    assert pace.source == "backoff"
    assert pace.rpm == pytest.approx(600 * BACKOFF_FACTOR)

    # A second refusal cuts again, from the learned rate (not the burst sent before).
    pace.refused(None, clock.time())
    assert pace.rpm == pytest.approx(600 * BACKOFF_FACTOR**2)

    # Answers within a second of the refusal change nothing; each clean second adds a step.
    learned = pace.rpm
    pace.answered_with(None, clock.time() + 0.5)
    assert pace.rpm == learned
    clock.advance(1.0)
    pace.answered_with(None, clock.time())
    assert pace.rpm == pytest.approx(learned * RECOVERY_FACTOR)
    pace.answered_with(None, clock.time() + 0.2)  # not a full window since the last step
    assert pace.rpm == pytest.approx(learned * RECOVERY_FACTOR)
    clock.advance(1.0)
    pace.answered_with(None, clock.time())
    assert pace.rpm == pytest.approx(learned * RECOVERY_FACTOR**2)


def test_a_declared_limit_is_never_overwritten_but_a_refusal_widens_its_margin() -> None:
    clock = ManualClock()
    pace = RoutePace(3000)
    pace.answered_with(RateLimitSignal(limit_requests=10_000), clock.time())
    assert pace.rpm == 3000
    pace.refused(RateLimitSignal(limit_requests=10_000), clock.time())
    assert pace.rpm == 3000
    assert pace.margin == pytest.approx(2 * PACE_MARGIN)
    for _ in range(100):
        pace.refused(None, clock.time())
    assert pace.margin == MAX_MARGIN
