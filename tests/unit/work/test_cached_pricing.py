"""Prompt tokens read from the cache: held at the input price, settled at the cached one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal

import pytest

from batchyard.core.money import charge_ticks, quote_ticks, to_ticks
from batchyard.core.telemetry import MemoryRecorder
from batchyard.engines.protocol import Choice, Completion, CompletionRequest, Delta, Usage
from batchyard.store.activity import list_activity
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

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        """Word by word, saying with the first that 3 prompt tokens came from its cache."""
        yield Delta(0, "one ", cached_input_tokens=3)
        yield Delta(0, "two ")
        yield Delta(0, "three")
        yield Completion(request.model, [Choice("one two three")], Usage(4, 3, 3))

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
        requests=[(CompletionRequest(model="up-m", messages=PROMPT, max_tokens=16), 4)],
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
    # The charge's activity record says how many of its input tokens were cached.
    [charge] = [a for a in db.read_sync(lambda c: list_activity(c, org)) if a["kind"] == "charge"]
    assert (charge["detail"]["input_tokens"], charge["detail"]["cached_input_tokens"]) == (4, 3)


async def test_a_list_of_prompts_adds_up_its_cached_tokens_and_settles_them_cached(
    db: Database, clock: SleepWatchingClock
) -> None:
    org = add_org(db, clock.now(), credit="10")
    d = make_dispatcher(db, clock, CachingEngine())
    request = CompletionRequest(model="up-m", messages=PROMPT, max_tokens=16)
    result = await d.execute(
        org_id=org,
        model=MODEL,
        route=route(cached_input_per_mtok=Decimal("250")),
        requests=[(request, 4), (request, 4)],
        max_cost=quote_ticks(PRICE.cost(8, 32)),
        price=PRICE,
        purpose="completion",
        ref="cmpl.1",
    )
    assert result.completion.usage == Usage(8, 4, cached_input_tokens=6)
    # 2 tokens in at $0.001, the 6 cached at $0.00025, 4 out at $0.002.
    assert result.charge == charge_ticks(Decimal("0.0115"))
    assert balance(db, org).available == to_ticks(Decimal("10")) - result.charge


async def test_a_stream_cut_short_settles_its_cached_prompt_tokens_at_the_cached_price(
    db: Database, clock: SleepWatchingClock
) -> None:
    org = add_org(db, clock.now(), credit="10")
    d = make_dispatcher(db, clock, CachingEngine())
    pieces = d.stream(
        org_id=org,
        model=MODEL,
        route=route(cached_input_per_mtok=Decimal("250")),
        request=CompletionRequest(model="up-m", messages=PROMPT, max_tokens=16),
        input_tokens=4,
        max_cost=quote_ticks(PRICE.cost(4, 16)),
        price=PRICE,
        purpose="chat",
        ref="chat.2",
        count_tokens=lambda text: len(text.split()),
    )
    assert (await anext(pieces)).text == "one "
    assert (await anext(pieces)).text == "two "
    await pieces.aclose()  # the client hung up after two words
    # 4 tokens in, 3 of them cached at $250/M; the 2 words out.
    expected = charge_ticks(PRICE.for_route(Decimal("250")).cost(4, 2, 3))
    assert expected < charge_ticks(PRICE.cost(4, 2))
    [charge] = [a for a in db.read_sync(lambda c: list_activity(c, org)) if a["kind"] == "charge"]
    assert charge["amount"] == expected
    assert charge["detail"]["cached_input_tokens"] == 3
    assert balance(db, org).available == to_ticks(Decimal("10")) - expected
