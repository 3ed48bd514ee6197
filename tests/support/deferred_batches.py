"""Shared pieces for the deferred-batch tests: a market catalog, bodies, engines.

Tests get ``market_factory`` through the ``market`` fixture (tests/conftest.py). The
catalog keeps the catalog's kettei-core direct price (0.10 / 0.40 per Mtok) but swaps the
embedded model for routes whose engines the tests script, and counts tokens
with the fallback tokenizer so nothing loads a model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

import httpx

from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.core.clock import ManualClock
from batchyard.core.prices import Price, PricePoint
from batchyard.engines.protocol import Completion, CompletionRequest
from batchyard.engines.scripted import ScriptedEngine
from batchyard.service import Service
from batchyard.store import deferred_batches as bstore
from batchyard.store.deferred_batch_tables import batch_items
from batchyard.work.deferred_batches.deferred_batch_worker import DeferredBatchWorker
from tests.support.services import ServiceFactory
from tests.support.waits import until

CORE = ModelSpec(
    id="kettei-core",
    input_per_mtok=Decimal("0.10"),
    output_per_mtok=Decimal("0.40"),
    context_window=2048,
    max_output_tokens=1024,
)
BIG = ModelSpec(
    id="big",
    input_per_mtok=Decimal("1.00"),
    output_per_mtok=Decimal("4.00"),
    context_window=16384,
    max_output_tokens=8192,
)


def feed_route(
    rid: str, *, model: str = "kettei-core", caps: bool = True, fallbacks: Iterable[str] = ()
) -> RouteSpec:
    return RouteSpec(
        id=rid,
        model=model,
        engine="openai_http",
        upstream_model=f"{rid}-upstream",
        base_url="http://127.0.0.1:9",
        price_source="feed",
        hard_price_caps=caps,
        fallbacks=tuple(fallbacks),
    )


def fixed_route(
    rid: str,
    inp: str,
    out: str,
    *,
    model: str = "kettei-core",
    caps: bool = True,
    fallbacks: Iterable[str] = (),
) -> RouteSpec:
    return RouteSpec(
        id=rid,
        model=model,
        engine="openai_http",
        upstream_model=f"{rid}-upstream",
        base_url="http://127.0.0.1:9",
        input_per_mtok=Decimal(inp),
        output_per_mtok=Decimal(out),
        hard_price_caps=caps,
        fallbacks=tuple(fallbacks),
    )


def catalog(*routes: RouteSpec) -> Catalog:
    return Catalog([CORE, BIG], routes)


def chat(text: str = "Summarize this public release note.", **extra: Any) -> dict[str, Any]:
    return {
        "model": "kettei-core",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16,
        **extra,
    }


def batch_body(n: int = 1, min_discount: Any = 90, **extra: Any) -> dict[str, Any]:
    return {
        "min_discount": min_discount,
        "requests": [{"custom_id": f"req-{i}", "body": chat()} for i in range(n)],
        **extra,
    }


_keys = iter(range(10**9))


def idem() -> str:
    return f"submit-{next(_keys):08d}"


async def submit(
    http: httpx.AsyncClient, headers: dict[str, str], body: Any, key: str | None = None
) -> httpx.Response:
    return await http.post(
        "/v1/batches", json=body, headers={**headers, "Idempotency-Key": key or idem()}
    )


def item_rows(service: Service, batch_id: str) -> list[bstore.ItemRow]:
    return service.db.read_sync(lambda c: bstore.items_of(c, batch_id))


def all_items(service: Service) -> list[Any]:
    return service.db.read_sync(lambda c: c.execute(batch_items.select()).all())


def set_price(service: Service, route: str, inp: str, out: str) -> None:
    service.deferred_batches.book.update(
        [PricePoint(route, Price(Decimal(inp), Decimal(out)), service.clock.now())]
    )


def worker(service: Service) -> DeferredBatchWorker:
    return service.deferred_batches


class BlockingEngine:
    """Answers only when released; ``entered`` is set once a call is inside."""

    name = "blocking"

    def __init__(self, answer: str = "done") -> None:
        self.answer = answer
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.calls: list[CompletionRequest] = []
        self._inner = ScriptedEngine(answer)

    async def complete(self, request: CompletionRequest) -> Completion:
        self.calls.append(request)
        self.entered.set()
        await self.release.wait()
        return await self._inner.complete(request)

    async def aclose(self) -> None:
        return None


async def eventually(cond: Callable[[], bool], timeout: float | None = None) -> None:
    """Wait (real time, for other tasks to run) until ``cond`` holds.

    Without ``timeout``, bounded only against a hang (``tests.support.waits``): what
    the test waits for takes a moment on a quiet machine and many beside other work.
    ``timeout`` bounds one look (see ``eventually_ticking``), raising
    ``AssertionError`` when it passes.
    """
    if timeout is None:
        await until(cond, interval=0.01)
        return
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def eventually_ticking(
    clock: ManualClock, cond: Callable[[], bool], *, step: float = 15.0, ticks: int = 40
) -> None:
    """Move ``clock`` on by ``step`` until ``cond`` holds, as time flows for a running loop.

    A background loop whose pass was still running when the test moved the clock goes to
    sleep from the new time, and a clock that stands still would never wake it; a deployed
    loop's clock never stands still. ``ticks`` steps at most, each waiting a moment of
    real time for the loop to run.
    """
    for _ in range(ticks):
        try:
            await eventually(cond, timeout=0.5)
            return
        except AssertionError:
            clock.advance(step)
    await eventually(cond)


def market_factory(make_service: ServiceFactory) -> Callable[..., Service]:
    """``make(*routes, **settings_overrides)`` -> a service whose catalog is ``routes``.

    Made through the test's ``make_service``, so each is audited and stopped after.
    """

    def make(*routes: RouteSpec, **overrides: Any) -> Service:
        return make_service(catalog=catalog(*routes), **overrides)

    return make
