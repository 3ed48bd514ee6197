"""Chat completions through a route of engine ``openai_http`` to a fake upstream over real HTTP.

The gateway and the fake upstream both run on loopback; the dispatcher's
pacing runs on the ManualClock, so an upstream's Retry-After is checked by
reading the route's penalty and moving the clock, not by sleeping.
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from batchyard.core.money import charge_ticks, format_money, token_cost
from batchyard.core.prices import Price
from batchyard.store import ledger
from batchyard.store.tables import ledger_entries
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.remote_routes import remote_catalog
from tests.support.server import asgi_client
from tests.support.waits import settles, until

IN_PRICE, OUT_PRICE = Decimal("1.5"), Decimal("6")
BODY = {
    "model": "remote-model",
    "messages": [{"role": "user", "content": "tell me four words"}],
    "max_tokens": 16,
}
CHAT = "/v1/chat/completions"


@pytest.fixture
def upstream():
    with FakeUpstream(mode="echo") as up:
        yield up


def priced_service(make_service, up, **route):
    """A service whose ``remote-model`` costs IN_PRICE / OUT_PRICE, routed to ``up``."""
    catalog = remote_catalog(
        up.base_url, input_per_mtok=IN_PRICE, output_per_mtok=OUT_PRICE, **route
    )
    return make_service(catalog=catalog)


@pytest.fixture
def svc(make_service, upstream):
    return priced_service(
        make_service, upstream, upstream_model="fake-upstream-model", timeout_s=0.5
    )


@pytest.fixture
async def http(svc):
    async with asgi_client(svc) as client:
        yield client


def entries(svc, org_id):
    def q(c):
        rows = c.execute(
            select(ledger_entries.c.kind, func.count())
            .where(ledger_entries.c.org_id == org_id)
            .group_by(ledger_entries.c.kind)
        ).all()
        return {kind: n for kind, n in rows}

    return svc.db.read_sync(q)


def expected_charge(body):
    usage = body["usage"]
    cost = token_cost(usage["prompt_tokens"], usage["completion_tokens"], IN_PRICE, OUT_PRICE)
    return format_money(charge_ticks(cost))


async def test_a_completion_is_forwarded_and_billed(svc, http, upstream):
    acct = make_account(svc)
    r = await http.post(CHAT, json=BODY, headers=acct.headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "remote-model"
    assert body["choices"][0]["message"]["content"] == "echo: tell me four words"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert body["charge"] == expected_charge(body)
    assert upstream.last_request["model"] == "fake-upstream-model"
    assert upstream.last_request["max_tokens"] == 16
    assert entries(svc, acct.org_id) == {"topup": 1, "reserve": 1, "settle": 1, "release": 1}
    bal = svc.db.transact_sync(lambda c: ledger.balance(c, acct.org_id))
    assert format_money(bal.settled) == body["charge"] and bal.held == 0


async def test_an_upstream_429_is_waited_out_then_retried_and_billed_once(svc, http, upstream):
    acct = make_account(svc)
    upstream.fail_next(1, status=429, retry_after=7)
    call = asyncio.create_task(http.post(CHAT, json=BODY, headers=acct.headers))
    await until(lambda: upstream.statuses[429] == 1)

    # The route is held for the upstream's Retry-After; nothing is sent meanwhile.
    # (Asking with no limits reads the route's penalty and takes nothing.)
    async def held() -> bool:
        return not (await svc.limiter.try_acquire("route:remote", [])).allowed

    await until(held, "the 429 holds the route")
    hold = await svc.limiter.try_acquire("route:remote", [])
    assert hold.retry_after == pytest.approx(7, abs=0.01)
    assert not call.done()
    assert upstream.requests == 1
    svc.clock.advance(6.5)
    await asyncio.sleep(0)
    assert not (await svc.limiter.try_acquire("route:remote", [])).allowed
    assert upstream.requests == 1
    svc.clock.advance(0.5)
    r = await settles(call)
    assert r.status_code == 200, r.text
    assert upstream.requests == 2 and upstream.statuses[200] == 1
    assert r.json()["charge"] == expected_charge(r.json())
    assert entries(svc, acct.org_id) == {"topup": 1, "reserve": 1, "settle": 1, "release": 1}


@pytest.mark.parametrize(
    ("fault", "status", "code", "retryable"),
    [
        ("5xx", 502, "upstream_error", True),
        ("timeout", 504, "upstream_timeout", True),
        ("malformed", 502, "upstream_malformed", True),
        ("missing_usage", 502, "upstream_malformed", True),
    ],
)
async def test_a_failed_upstream_call_is_answered_and_nothing_is_charged(
    svc, http, upstream, fault, status, code, retryable
):
    acct = make_account(svc)
    if fault == "5xx":
        upstream.fail_next(1, status=503)
    elif fault == "timeout":
        upstream.delay_s = 3
    elif fault == "malformed":
        upstream.malformed_next(1)
    else:
        upstream.malformed_next(1, kind="missing_usage")
    r = await http.post(CHAT, json=BODY, headers={**acct.headers, "Idempotency-Key": "f-1"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["retryable"]) == (code, retryable)
    bal = svc.db.transact_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.settled == 0 and bal.held == 0
    assert entries(svc, acct.org_id) == {"topup": 1, "reserve": 1, "release": 1}
    # Retryable, so the key was not spent: the same request succeeds once the upstream does.
    upstream.delay_s = 0
    svc.clock.advance(60)
    again = await http.post(CHAT, json=BODY, headers={**acct.headers, "Idempotency-Key": "f-1"})
    assert again.status_code == 200, again.text
    assert entries(svc, acct.org_id)["settle"] == 1


CACHED_PRICE = Decimal("0.15")
SYSTEM = " ".join(f"rule{k}" for k in range(40))


@pytest.fixture
def caching_upstream():
    with FakeUpstream(mode="echo", prompt_cache=True) as up:
        yield up


@pytest.fixture
def cached_svc(make_service, caching_upstream):
    return priced_service(make_service, caching_upstream, cached_input_per_mtok=str(CACHED_PRICE))


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstreams_cached_prompt_tokens_are_shown_and_charged_at_the_cached_price(
    cached_svc, caching_upstream, stream
):
    """The upstream's ``prompt_tokens_details.cached_tokens`` reaches the usage and the bill."""
    acct = make_account(cached_svc)

    def settled_ticks():
        return cached_svc.db.transact_sync(lambda c: ledger.balance(c, acct.org_id)).settled

    charges, usages = [], []
    async with asgi_client(cached_svc) as http:
        for question in ("what is one", "what is two"):
            body = {
                "model": "remote-model",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 16,
            }
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            before = settled_ticks()
            r = await http.post(CHAT, json=body, headers=acct.headers)
            assert r.status_code == 200, r.text
            charges.append(settled_ticks() - before)
            if stream:
                events = [
                    json.loads(line[6:])
                    for line in r.text.splitlines()
                    if line.startswith("data: {")
                ]
                usages.append(events[-1]["usage"])
            else:
                usages.append(r.json()["usage"])
                assert r.json()["charge"] == format_money(charges[-1])
    first, second = usages
    assert (first["prompt_tokens"], second["prompt_tokens"]) == (43, 43)
    assert first.get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    # The system prompt and "what is" were read from the upstream's cache.
    assert second["prompt_tokens_details"]["cached_tokens"] == 42
    price = Price(IN_PRICE, OUT_PRICE).for_route(CACHED_PRICE)
    for usage, charge in zip(usages, charges, strict=True):
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        cost = price.cost(usage["prompt_tokens"], usage["completion_tokens"], cached)
        assert charge == charge_ticks(cost)
    assert charges[1] < charges[0]
    assert cached_svc.db.transact_sync(lambda c: ledger.balance(c, acct.org_id)).held == 0
