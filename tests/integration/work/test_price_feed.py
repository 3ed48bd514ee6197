"""The price feed: a real file and a real HTTP server on loopback, bad feeds changing nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from batchyard.core.clock import ManualClock
from batchyard.core.prices import Price, PriceBook
from batchyard.work.price_feed import PriceFeed
from tests.support.waits import HANG_S, until

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
FIVE_MIN = timedelta(minutes=5)


def p(i: str, o: str) -> Price:
    return Price(Decimal(i), Decimal(o))


def _feed_doc(input_price: str, observed: str | None = None) -> str:
    entry: dict[str, str] = {"route": "r", "input_per_mtok": input_price, "output_per_mtok": "1"}
    if observed is not None:
        entry["observed_at"] = observed
    return json.dumps({"prices": [entry]})


async def test_file_feed_malformed_keeps_old_points_which_go_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(T0)
    path = tmp_path / "prices.json"
    path.write_text(_feed_doc("0.5"))
    book = PriceBook()
    feed = PriceFeed(path, book, clock)
    assert await feed.refresh() is True
    assert book.fresh("r", clock.now(), FIVE_MIN) == p("0.5", "1")

    clock.advance(60)
    path.write_text('{"prices": [{"route": "r", "input_per_mtok": "-0.1", "output_per_mtok": "1"}]')
    with caplog.at_level(logging.WARNING, logger="batchyard.price_feed"):
        assert await feed.refresh() is False
    record = next(r for r in caplog.records if getattr(r, "event", "") == "price_feed_rejected")
    assert record.source == str(path)  # type: ignore[attr-defined]
    # The old point stays until its freshness bound, then authorises nothing.
    assert book.fresh("r", clock.now(), FIVE_MIN) == p("0.5", "1")
    clock.advance(5 * 60)
    assert book.fresh("r", clock.now(), FIVE_MIN) is None

    path.unlink()
    assert await feed.refresh() is False  # unreadable: same answer, no exception


async def test_run_loop_survives_bad_feeds_and_refreshes(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    path = tmp_path / "prices.json"
    path.write_text("garbage")
    book = PriceBook()
    feed = PriceFeed(path, book, clock)
    task = asyncio.create_task(feed.run(clock, interval_s=15))
    # The file is read in a worker thread: yield to the loop until it is done
    # (bounded), while the feed's own time only moves with the manual clock.
    await until(lambda: feed.last_error is not None, "the feed records its error")
    assert book.latest("r") is None and task.done() is False
    path.write_text(_feed_doc("0.25"))
    clock.advance(15)
    await until(lambda: book.latest("r") is not None, "the book has a price")
    assert book.fresh("r", clock.now(), FIVE_MIN) == p("0.25", "1")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class _FeedHandler(BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self) -> None:
        self.send_response(type(self).status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(type(self).body)))
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def feed_server() -> Iterator[tuple[str, type[_FeedHandler]]]:
    handler = type("Handler", (_FeedHandler,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/prices?token=secret", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(HANG_S)


async def test_http_feed_on_loopback(
    feed_server: tuple[str, type[_FeedHandler]], caplog: pytest.LogCaptureFixture
) -> None:
    url, handler = feed_server
    clock = ManualClock(T0)
    book = PriceBook()
    feed = PriceFeed(url, book, clock)
    handler.body = _feed_doc("0.125", "2026-03-02T11:58:00.000Z").encode()
    assert await feed.refresh() is True
    assert book.fresh("r", clock.now(), FIVE_MIN) == p("0.125", "1")
    assert book.fresh("r", clock.now() + timedelta(minutes=4), FIVE_MIN) is None

    handler.status = 503
    with caplog.at_level(logging.WARNING, logger="batchyard.price_feed"):
        assert await feed.refresh() is False
    record = next(r for r in caplog.records if getattr(r, "event", "") == "price_feed_rejected")
    assert record.reason == "HTTP 503"  # type: ignore[attr-defined]
    assert "secret" not in record.source  # type: ignore[attr-defined]
    assert book.latest("r") is not None  # the old point is kept


async def test_http_feed_unreachable_is_a_bad_feed() -> None:
    clock = ManualClock(T0)
    feed = PriceFeed("http://127.0.0.1:1/prices", PriceBook(), clock, timeout_s=2)
    assert await feed.refresh() is False
    assert feed.last_error is not None
