"""Prompt tokens read from the cache: held at the input price, settled at the cached one."""

from __future__ import annotations

from decimal import Decimal

import pytest

from batchyard.core.money import charge_ticks, quote_ticks, to_ticks
from batchyard.core.telemetry import MemoryRecorder
from batchyard.engines.protocol import Choice, Completion, CompletionRequest, Usage
from batchyard.store.database import Database
from tests.support.clocks import SleepWatchingClock
from tests.support.run_store import add_org, balance
from tests.unit.work.conftest import MODEL, PRICE, make_dispatcher, route

PROMPT = [{"role": "user", "content": "one two three four"}]


class CachingEngine:
    """Answers every call with 4 prompt tokens, 3 of them from its cache, and 2 out."""

    name = "caching"

    async def complete(self, request: CompletionRequest) -> Completion:
        return Completion(request.model, [Choice("a b")], Usage(4, 2, cached_input_tokens=3))

    async def aclose(self) -> None:
        return None


@pytest.mark.parametrize("cached_price", [None, Decimal("250")])
async def test_cached_tokens_settle_at_the_routes_cached_price(
    db: Database, clock: SleepWatchingClock, cached_price: Decimal | None
) -> None:
    org = add_org(db, clock.now(), credit="10")
    d = make_dispatcher(db, clock, CachingEngine())
    d.metrics = recorder = MemoryRecorder()
    hold = quote_ticks(PRICE.cost(4, 16))  # the uncached price bounds the hold
    result = await d.execute(
        org_id=org,
        model=MODEL,
        route=route(cached_input_per_mtok=cached_price),
        request=CompletionRequest(model="up-m", messages=PROMPT, max_tokens=16),
        input_tokens=4,
        max_cost=hold,
        price=PRICE,
        purpose="chat",
        ref="chat.1",
    )
    # $1000/M in, $2000/M out; the 3 cached tokens at $250/M where the route says so.
    expected = Decimal("0.008") if cached_price is None else Decimal("0.00575")
    assert result.charge == charge_ticks(expected) <= hold
    assert result.completion.usage.cached_input_tokens == 3
    assert balance(db, org).available == to_ticks(Decimal("10")) - result.charge
    assert recorder.counts["prompt_tokens_cached", "r"] == 3
