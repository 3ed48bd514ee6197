"""Money as ``Decimal`` on the wire and as integer ticks in the store.

A tick is 10⁻¹⁰ US dollars. Integers sum exactly in SQL on both SQLite and
PostgreSQL (SQLite's NUMERIC is a float underneath), so the ledger can derive a
balance with ``SUM`` and never drift. Quotes round up (a quote is a ceiling);
charges round half-even (a charge is a measurement).
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal, InvalidOperation

__all__ = [
    "TICK",
    "TICKS_PER_DOLLAR",
    "charge_ticks",
    "format_money",
    "from_ticks",
    "parse_money",
    "quote_ticks",
    "to_ticks",
    "token_cost",
]

TICKS_PER_DOLLAR = 10**10
TICK = Decimal(1) / TICKS_PER_DOLLAR
_MILLION = Decimal(1_000_000)


def parse_money(text: str | int | Decimal) -> Decimal:
    """A non-negative decimal amount from user input; ValueError otherwise."""
    try:
        value = Decimal(str(text).strip())
    except InvalidOperation as exc:
        raise ValueError(f"not a decimal amount: {text!r}") from exc
    if not value.is_finite() or value < 0:
        raise ValueError(f"amount must be a finite, non-negative decimal: {text!r}")
    return value


def to_ticks(amount: Decimal, rounding: str = ROUND_HALF_EVEN) -> int:
    return int((amount * TICKS_PER_DOLLAR).to_integral_value(rounding=rounding))


def from_ticks(ticks: int) -> Decimal:
    return (Decimal(ticks) / TICKS_PER_DOLLAR).normalize()


def format_money(amount: Decimal | int) -> str:
    """A decimal string matching ``^(0|[1-9][0-9]*)(\\.[0-9]+)?$`` (no exponent)."""
    value = from_ticks(amount) if isinstance(amount, int) else amount
    text = format(value.normalize(), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def token_cost(
    input_tokens: int,
    output_tokens: int,
    input_per_mtok: Decimal,
    output_per_mtok: Decimal,
) -> Decimal:
    """Exact cost of a call: tokens × price per million tokens."""
    return (input_tokens * input_per_mtok + output_tokens * output_per_mtok) / _MILLION


def quote_ticks(cost: Decimal) -> int:
    """A quote never under-states: round up to the next tick."""
    return to_ticks(cost, ROUND_CEILING)


def charge_ticks(cost: Decimal) -> int:
    return to_ticks(cost, ROUND_HALF_EVEN)
