"""Prices per million tokens, and the book of route prices the market spends against.

One ``Price`` serves every door: the catalog's direct prices, a route's fixed
or observed price, and what a call is charged (``Price.cost``).

Deferred batches spend only against *fresh* prices: "a historical or observed
floor cannot authorize a spend". So the book keeps when each price was seen,
and ``PriceBook.fresh`` answers ``None`` for a price past its freshness bound.
A feed (``work.price_feed``) that turns bad changes nothing: the last good
points stay in the book, age, and stop authorising anything once they are
stale. That fails closed without a second mechanism.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from batchyard.core.money import token_cost

__all__ = [
    "CLOCK_SKEW",
    "MAX_FEED_BYTES",
    "FeedError",
    "Price",
    "PriceBook",
    "PricePoint",
    "discount_percent",
    "parse_feed",
]

_HUNDRED = Decimal(100)

#: How far in the future an observation may claim to be and still count: a
#: feed host's clock a few seconds ahead is normal, one hours ahead would keep
#: a price "fresh" long after it was seen.
CLOCK_SKEW = timedelta(seconds=5)

#: A price feed is a short list of routes; anything larger is not one.
MAX_FEED_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Price:
    """US dollars per million tokens, for input and for output.

    Negative or non-finite prices are refused at construction, so no code
    downstream has to ask whether a price is a number it can compare.
    """

    input_per_mtok: Decimal
    output_per_mtok: Decimal
    #: What an input token read from the engine's prompt cache costs; ``None``: the input price.
    #: Never above the input price, so a quote at the input price bounds every charge.
    cached_input_per_mtok: Decimal | None = None

    def __post_init__(self) -> None:
        for name in ("input_per_mtok", "output_per_mtok", "cached_input_per_mtok"):
            value = getattr(self, name)
            if value is None and name == "cached_input_per_mtok":
                continue
            if not isinstance(value, Decimal):
                raise TypeError(f"{name} must be a Decimal, not {type(value).__name__}")
            if not value.is_finite() or value < 0:
                raise ValueError(f"{name} must be a finite, non-negative amount")
        cached = self.cached_input_per_mtok
        if cached is not None and cached > self.input_per_mtok:
            raise ValueError("cached_input_per_mtok must not exceed input_per_mtok")

    def cost(self, input_tokens: int, output_tokens: int, cached_input_tokens: int = 0) -> Decimal:
        """What ``input_tokens`` in (``cached_input_tokens`` of them from the prompt cache)
        and ``output_tokens`` out cost at this price, in dollars.

        Quotes and holds leave ``cached_input_tokens`` at 0: the uncached price
        is the most a call can cost, whatever the cache turns out to hold.
        """
        full = token_cost(input_tokens, output_tokens, self.input_per_mtok, self.output_per_mtok)
        cached = min(max(0, cached_input_tokens), input_tokens)
        if not cached or self.cached_input_per_mtok is None:
            return full
        return full - token_cost(
            cached, 0, self.input_per_mtok - self.cached_input_per_mtok, Decimal(0)
        )

    def for_route(self, cached_input_per_mtok: Decimal | None) -> Price:
        """This price with a route's cached-input price (capped at the input price)."""
        if cached_input_per_mtok is None:
            return self
        cached = min(cached_input_per_mtok, self.input_per_mtok)
        return Price(self.input_per_mtok, self.output_per_mtok, cached)


@dataclass(frozen=True, slots=True)
class PricePoint:
    """One observation of a route's price, and when it was observed (aware UTC)."""

    route: str
    price: Price
    observed_at: datetime

    def __post_init__(self) -> None:
        if self.observed_at.tzinfo is None:
            raise ValueError("observed_at must be an aware datetime")
        if not self.route:
            raise ValueError("route must be a non-empty string")


def discount_percent(direct: Price, offered: Price) -> tuple[Decimal, Decimal]:
    """Per-rate discount of ``offered`` against ``direct``: ``100 * (1 - offered/direct)``.

    A direct rate of zero has no discount to give: an offered zero counts as
    a 0 % discount and anything dearer as ``-Infinity``, so neither can meet a
    positive minimum.
    """
    return (
        _rate_discount(direct.input_per_mtok, offered.input_per_mtok),
        _rate_discount(direct.output_per_mtok, offered.output_per_mtok),
    )


def _rate_discount(direct: Decimal, offered: Decimal) -> Decimal:
    if direct == 0:
        return Decimal(0) if offered == 0 else Decimal("-Infinity")
    return _HUNDRED * (1 - offered / direct)


class PriceBook:
    """The latest observed price per route.

    An older observation never replaces a newer one, so feeds that arrive out
    of order (two workers, a slow HTTP answer) cannot roll a price back.
    """

    def __init__(self, points: Iterable[PricePoint] = ()) -> None:
        self._latest: dict[str, PricePoint] = {}
        self.update(points)

    def update(self, points: Iterable[PricePoint]) -> None:
        for point in points:
            current = self._latest.get(point.route)
            if current is None or point.observed_at >= current.observed_at:
                self._latest[point.route] = point

    def latest(self, route: str) -> PricePoint | None:
        """The last observation, fresh or not: for display, never for spending."""
        return self._latest.get(route)

    def routes(self) -> list[str]:
        return sorted(self._latest)

    def fresh(self, route: str, now: datetime, max_age: timedelta) -> Price | None:
        """The route's price if it was observed within ``max_age`` of ``now``, else None."""
        point = self._latest.get(route)
        if point is None:
            return None
        age = now - point.observed_at
        if age > max_age or age < -CLOCK_SKEW:
            return None
        return point.price


class FeedError(ValueError):
    """A price feed that cannot be trusted as a whole."""


def parse_feed(data: bytes | str, fetched_at: datetime) -> list[PricePoint]:
    """Parse ``{"prices": [...]}``; one bad entry rejects the whole feed.

    A feed with one corrupt row is a feed whose other rows are suspect too,
    and keeping the previous points (which then go stale) is the safe side.
    Numbers are read as ``Decimal`` straight from the JSON text, so a price
    sent as ``0.1`` is exactly ten cents, not the float next to it.
    """
    try:
        doc = json.loads(data, parse_float=Decimal, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise FeedError(f"not JSON: {type(exc).__name__}") from exc
    if not isinstance(doc, Mapping) or not isinstance(doc.get("prices"), list):
        raise FeedError('expected an object with a "prices" list')
    points: list[PricePoint] = []
    for index, entry in enumerate(doc["prices"]):
        try:
            points.append(_parse_entry(entry, fetched_at))
        except (TypeError, ValueError, InvalidOperation) as exc:
            raise FeedError(f"prices[{index}]: {exc}") from exc
    return points


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a price")


def _parse_entry(entry: Any, fetched_at: datetime) -> PricePoint:
    if not isinstance(entry, Mapping):
        raise TypeError("entry must be an object")
    route = entry.get("route")
    if not isinstance(route, str) or not route.strip():
        raise ValueError("route must be a non-empty string")
    price = Price(_amount(entry.get("input_per_mtok")), _amount(entry.get("output_per_mtok")))
    observed = entry.get("observed_at")
    if observed is None:
        observed_at = fetched_at
    elif isinstance(observed, str):
        parsed = datetime.fromisoformat(observed.strip().replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            raise ValueError("observed_at needs a time zone")
        observed_at = parsed.astimezone(UTC)
    else:
        raise TypeError("observed_at must be an ISO 8601 string")
    return PricePoint(route=route, price=price, observed_at=observed_at)


def _amount(value: Any) -> Decimal:
    # bool is an int in Python; "true" as a price is a broken feed.
    if isinstance(value, bool) or not isinstance(value, str | int | Decimal):
        raise TypeError("price must be a decimal string or a number")
    amount = Decimal(value.strip()) if isinstance(value, str) else Decimal(value)
    if not amount.is_finite() or amount < 0:
        raise ValueError("price must be a finite, non-negative amount")
    return amount
