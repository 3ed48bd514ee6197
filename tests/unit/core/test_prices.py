"""Prices, the price book's freshness bound, and parsing a feed."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from batchyard.core.prices import (
    FeedError,
    Price,
    PriceBook,
    PricePoint,
    discount_percent,
    parse_feed,
)

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
FIVE_MIN = timedelta(minutes=5)


def p(i: str, o: str) -> Price:
    return Price(Decimal(i), Decimal(o))


def test_discount_percent_per_rate() -> None:
    assert discount_percent(p("1.00", "4.00"), p("0.10", "2.00")) == (Decimal(90), Decimal(50))
    # A zero direct rate has no discount to give.
    assert discount_percent(p("0", "4"), p("0", "1"))[0] == 0
    assert discount_percent(p("0", "4"), p("0.1", "1"))[0] == Decimal("-Infinity")


@pytest.mark.parametrize("bad", ["-0.01", "NaN", "Infinity"])
def test_price_refuses_negative_and_non_finite(bad: str) -> None:
    with pytest.raises(ValueError):
        p(bad, "1")


def test_price_refuses_floats() -> None:
    with pytest.raises(TypeError):
        Price(0.1, Decimal(1))  # type: ignore[arg-type]


def test_book_fresh_until_max_age_then_none() -> None:
    book = PriceBook([PricePoint("r", p("1", "2"), T0)])
    assert book.fresh("r", T0 + FIVE_MIN, FIVE_MIN) == p("1", "2")
    assert book.fresh("r", T0 + FIVE_MIN + timedelta(seconds=1), FIVE_MIN) is None
    assert book.fresh("missing", T0, FIVE_MIN) is None
    # The stale point is still visible for display, never for spending.
    latest = book.latest("r")
    assert latest is not None and latest.observed_at == T0


def test_book_ignores_older_points_and_far_future_ones() -> None:
    book = PriceBook()
    book.update([PricePoint("r", p("1", "2"), T0)])
    book.update([PricePoint("r", p("9", "9"), T0 - timedelta(minutes=1))])
    assert book.fresh("r", T0, FIVE_MIN) == p("1", "2")
    book.update([PricePoint("f", p("1", "1"), T0 + timedelta(hours=1))])
    assert book.fresh("f", T0, FIVE_MIN) is None  # a claimed future is not fresh


def test_parse_feed_decimal_exact_and_default_time() -> None:
    doc = {
        "prices": [
            {"route": "a", "input_per_mtok": "0.10", "output_per_mtok": 0.4},
            {
                "route": "b",
                "input_per_mtok": 1,
                "output_per_mtok": "2",
                "observed_at": "2026-03-02T11:59:00Z",
            },
        ]
    }
    points = parse_feed(json.dumps(doc), T0)
    assert points[0].price == p("0.10", "0.4")  # 0.4 read as a Decimal, not a float
    assert points[0].observed_at == T0
    assert points[1].observed_at == T0 - timedelta(minutes=1)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"prices": {}}',
        '{"prices": [{"route": "a", "input_per_mtok": "-1", "output_per_mtok": "1"}]}',
        '{"prices": [{"route": "a", "input_per_mtok": "1"}]}',
        '{"prices": [{"route": "", "input_per_mtok": "1", "output_per_mtok": "1"}]}',
        '{"prices": [{"route": "a", "input_per_mtok": true, "output_per_mtok": "1"}]}',
        '{"prices": [{"route": "a", "input_per_mtok": NaN, "output_per_mtok": "1"}]}',
        '{"prices": [{"route": "a", "input_per_mtok": "1", "output_per_mtok": "1",'
        ' "observed_at": "2026-03-02T11:59:00"}]}',
    ],
)
def test_parse_feed_rejects_whole_feed(text: str) -> None:
    with pytest.raises(FeedError):
        parse_feed(text, T0)


def test_cached_input_is_charged_at_its_own_price_and_never_above_the_uncached() -> None:
    price = Price(Decimal("1.00"), Decimal("4.00"), Decimal("0.25"))
    # A quote (nothing known of the cache) is the uncached price: the most it can cost.
    assert price.cost(1000, 100) == Decimal("0.0014")
    # 800 of the 1000 prompt tokens came from the cache.
    assert price.cost(1000, 100, 800) == Decimal("0.0008")
    assert price.cost(1000, 100, 800) <= price.cost(1000, 100)
    # More cached tokens than input tokens cannot make a call cheaper than all-cached.
    assert price.cost(10, 0, 50) == price.cost(10, 0, 10)
    # A route without a cached price charges cached tokens as other input.
    assert Price(Decimal(1), Decimal(4)).cost(1000, 100, 800) == Decimal("0.0014")
    assert Price(Decimal(1), Decimal(4)).for_route(Decimal("0.25")) == price
    # A route's cached price above the model's input price is capped at it.
    assert Price(Decimal(1), Decimal(4)).for_route(Decimal(9)).cached_input_per_mtok == 1
    with pytest.raises(ValueError, match="cached_input_per_mtok"):
        Price(Decimal(1), Decimal(4), Decimal(2))
