"""The operator's price feed: a JSON file or HTTP(S) URL polled into the ``PriceBook``.

The feed is I/O at the edge of the deferred-batch worker; what a feed *means* (which
points are valid, when a price is fresh) is ``core.prices``. A feed that turns
bad (unreadable, malformed, a negative price) changes nothing: the last good
points stay in the book and stop authorising anything once they are stale.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from batchyard.core.clock import Clock
from batchyard.core.prices import MAX_FEED_BYTES, FeedError, PriceBook, parse_feed

__all__ = ["PriceFeed"]

log = logging.getLogger("batchyard.price_feed")


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
