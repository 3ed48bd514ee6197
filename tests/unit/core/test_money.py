"""Money: Decimal on the wire, integer ticks in the store, quotes round up."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchyard.core.money import (
    TICK,
    TICKS_PER_DOLLAR,
    charge_ticks,
    format_money,
    from_ticks,
    parse_money,
    quote_ticks,
    to_ticks,
    token_cost,
)

SEED_MONEY = re.compile(r"^(0|[1-9][0-9]*)(\.[0-9]+)?$")


def test_a_tick_is_ten_to_the_minus_ten_dollars():
    assert TICKS_PER_DOLLAR == 10**10
    assert Decimal(1) / TICKS_PER_DOLLAR == TICK
    assert to_ticks(Decimal("1")) == 10**10
    assert from_ticks(1) == Decimal("1E-10")


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", Decimal(0)), ("10", Decimal(10)), (" 2.50 ", Decimal("2.5")), (3, Decimal(3))],
)
def test_parse_money_accepts_non_negative_decimals(text, value):
    assert parse_money(text) == value


@pytest.mark.parametrize("text", ["-1", "abc", "NaN", "Infinity", "", "1,5"])
def test_parse_money_refuses_anything_else(text):
    with pytest.raises(ValueError):
        parse_money(text)


@pytest.mark.parametrize(
    ("amount", "text"),
    [
        (Decimal("0"), "0"),
        (Decimal("0.000"), "0"),
        (Decimal("10.50"), "10.5"),
        (Decimal("1E+3"), "1000"),
        (Decimal("1E-10"), "0.0000000001"),
        (12_345_000_000, "1.2345"),
        (0, "0"),
    ],
)
def test_format_money_matches_the_seed_pattern_with_no_exponent(amount, text):
    assert format_money(amount) == text
    assert SEED_MONEY.match(format_money(amount))


@given(st.integers(min_value=0, max_value=10**18))
def test_ticks_round_trip_exactly_and_format_to_the_seed_pattern(ticks):
    assert to_ticks(from_ticks(ticks)) == ticks
    text = format_money(ticks)
    assert SEED_MONEY.match(text), text
    assert to_ticks(Decimal(text)) == ticks


def test_token_cost_is_tokens_times_price_per_million():
    cost = token_cost(1_000, 500, Decimal("0.10"), Decimal("0.40"))
    assert cost == Decimal("0.0003")
    assert isinstance(cost, Decimal)


def test_a_quote_rounds_up_and_a_charge_rounds_half_even():
    third_of_a_tick = TICK / 3
    assert quote_ticks(third_of_a_tick) == 1
    assert charge_ticks(third_of_a_tick) == 0
    assert quote_ticks(Decimal("0.5") * TICK) == 1
    assert charge_ticks(Decimal("0.5") * TICK) == 0
    assert charge_ticks(Decimal("1.5") * TICK) == 2
    assert quote_ticks(Decimal(2) * TICK) == 2


@given(
    st.integers(min_value=0, max_value=200_000),
    st.integers(min_value=0, max_value=50_000),
    st.decimals(min_value=0, max_value=100, places=4),
    st.decimals(min_value=0, max_value=100, places=4),
)
def test_a_quote_never_understates_the_charge(inp, out, pin, pout):
    cost = token_cost(inp, out, pin, pout)
    assert quote_ticks(cost) >= charge_ticks(cost)
    assert quote_ticks(cost) - charge_ticks(cost) <= 1
    assert from_ticks(quote_ticks(cost)) >= cost
