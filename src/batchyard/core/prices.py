"""Route prices as the market sees them, and the feed that keeps them current.

Deferred batches spend only against *fresh* prices: "a historical or observed
floor cannot authorize a spend". So the book keeps when each price was seen,
and ``PriceBook.fresh`` answers ``None`` for a price past its freshness bound.
A feed that turns bad (unreadable, malformed, a negative price) changes
nothing: the last good points stay in the book, age, and stop authorising
anything once they are stale. That fails closed without a second mechanism.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from batchyard.core.clock import Clock

__all__ = [
    "CLOCK_SKEW",
    "MAX_FEED_BYTES",
    "FeedError",
    "Price",
    "PriceBook",
    "PriceFeed",
    "PricePoint",
    "discount_percent",
    "parse_feed",
]

log = logging.getLogger(__name__)

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

    def __post_init__(self) -> None:
        for name in ("input_per_mtok", "output_per_mtok"):
            value = getattr(self, name)
            if not isinstance(value, Decimal):
                raise TypeError(f"{name} must be a Decimal, not {type(value).__name__}")
            if not value.is_finite() or value < 0:
                raise ValueError(f"{name} must be a finite, non-negative amount")


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


class PriceFeed:
    """Polls an operator-given JSON file or HTTP(S) URL into a ``PriceBook``.

    ``source`` starting with ``http://`` or ``https://`` is fetched with
    httpx; anything else is a file path. ``refresh`` never raises for a bad
    feed: it logs a structured warning and leaves the book alone, because the
    answer to "the feed broke" is "stop spending once prices age", not "crash
    the worker".
    """

    def __init__(
        self,
        source: str | Path,
        book: PriceBook,
        clock: Clock,
        *,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.source = str(source)
        self.book = book
        self.clock = clock
        self._client = client
        self._timeout_s = timeout_s
        self._is_http = self.source.startswith(("http://", "https://"))
        self.last_error: str | None = None
        self.last_success: datetime | None = None

    async def refresh(self) -> bool:
        """Fetch once; True when the book was updated, False when the feed was bad."""
        fetched_at = self.clock.now()
        try:
            data = await (self._fetch_http() if self._is_http else self._read_file())
            points = parse_feed(data, fetched_at)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.last_error = _describe(exc)
            log.warning(
                "price feed rejected; keeping previous prices until they go stale",
                extra={
                    "event": "price_feed_rejected",
                    "source": _safe_source(self.source),
                    "reason": self.last_error,
                },
            )
            return False
        self.book.update(points)
        self.last_error = None
        self.last_success = fetched_at
        log.debug(
            "price feed applied",
            extra={
                "event": "price_feed_applied",
                "source": _safe_source(self.source),
                "routes": len(points),
            },
        )
        return True

    async def run(self, clock: Clock | None = None, interval_s: float = 15.0) -> None:
        """Refresh every ``interval_s`` of ``clock`` time until cancelled."""
        wait_on = clock or self.clock
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # refresh already guards; this is belt and braces
                log.exception("price feed refresh failed", extra={"event": "price_feed_error"})
            await wait_on.sleep(interval_s)

    async def _read_file(self) -> bytes:
        path = Path(self.source)
        data = await asyncio.to_thread(_read_bounded, path)
        return data

    async def _fetch_http(self) -> bytes:
        if self._client is not None:
            return await self._get(self._client)
        async with httpx.AsyncClient(timeout=self._timeout_s) as client:
            return await self._get(client)

    async def _get(self, client: httpx.AsyncClient) -> bytes:
        async with client.stream("GET", self.source, timeout=self._timeout_s) as response:
            if response.status_code != 200:
                raise FeedError(f"HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body.extend(chunk)
                if len(body) > MAX_FEED_BYTES:
                    raise FeedError("feed larger than MAX_FEED_BYTES")
            return bytes(body)


def _read_bounded(path: Path) -> bytes:
    with path.open("rb") as fh:
        data = fh.read(MAX_FEED_BYTES + 1)
    if len(data) > MAX_FEED_BYTES:
        raise FeedError("feed larger than MAX_FEED_BYTES")
    return data


def _describe(exc: Exception) -> str:
    if isinstance(exc, FeedError):
        return str(exc)
    # Transport errors can echo the URL (and any token in its query); the
    # class name says enough to act on.
    return type(exc).__name__


def _safe_source(source: str) -> str:
    """The source without credentials or a query string, fit for a log line."""
    if not source.startswith(("http://", "https://")):
        return source
    parts = urlsplit(source)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"
