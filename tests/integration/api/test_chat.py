"""POST /v1/chat/completions over real HTTP: billed from a reservation, limited by the tier."""

from __future__ import annotations

import pytest

from batchyard.engines.scripted import ScriptedEngine
from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.server import asgi_client

BODY = {
    "model": "kettei-core",
    "messages": [{"role": "user", "content": "Say hi"}],
    "max_tokens": 8,
}


@pytest.fixture
def engine(service):
    eng = ScriptedEngine("hello there", clock=service.clock)
    service.engines.set("embedded", eng)
    return eng


async def test_completion_is_charged_from_a_settled_reservation(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post("/v1/chat/completions", json=BODY, headers=acct.headers)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == "hello there"
        assert body["usage"]["completion_tokens"] == 2
        charge = body["charge"]
        assert float(charge) > 0
        acct_view = (await http.get("/v1/account", headers=acct.headers)).json()
    bal = service.db.transact_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0
    assert acct_view["credit"]["held"] == "0"


async def test_replay_with_same_key_is_not_charged_twice(service, engine):
    acct = make_account(service, credit="1")
    h = {**acct.headers, "Idempotency-Key": "k-1"}
    async with asgi_client(service) as http:
        a = await http.post("/v1/chat/completions", json=BODY, headers=h)
        b = await http.post("/v1/chat/completions", json=BODY, headers=h)
        c = await http.post("/v1/chat/completions", json={**BODY, "max_tokens": 9}, headers=h)
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json()
    assert b.headers["Idempotent-Replayed"] == "true"
    assert c.status_code == 409 and c.json()["error"]["code"] == "idempotency_conflict"
    assert len(engine.calls) == 1


async def test_over_the_tier_limit_is_429_with_retry_after_and_nothing_charged(make_service):
    # No server-side queue, so the first request past the burst is refused at once.
    service = make_service(limits_queue_s=0)
    engine = ScriptedEngine("hello there", clock=service.clock)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    burst = service.tier(0).max_in_flight
    async with asgi_client(service) as http:
        codes = [
            (await http.post("/v1/chat/completions", json=BODY, headers=acct.headers))
            for _ in range(burst + 1)
        ]
    assert [r.status_code for r in codes] == [200] * burst + [429]
    limited = codes[-1]
    assert limited.json()["error"] == {
        **limited.json()["error"],
        "code": "rate_limited",
        "retryable": True,
        "limit": "requests",
    }
    # Tier 0 admits one request every 2 s once the burst is spent: the exact wait
    # in milliseconds, and whole seconds rounded up, never early.
    assert limited.headers["retry-after-ms"] == "2000"
    assert limited.headers["Retry-After"] == "2"
    assert limited.headers["x-should-retry"] == "true"
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(engine.calls) == burst


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({}, BODY, 401, "missing_api_key"),
        ({"Authorization": "Bearer by_nope"}, BODY, 401, "invalid_api_key"),
        (None, {**BODY, "model": "nope"}, 404, "model_not_found"),
        (None, {**BODY, "model": "kettei-fat"}, 400, "model_unavailable"),
        (None, {**BODY, "max_tokens": -1}, 400, "invalid_request"),
        (None, {**BODY, "max_tokens": 10_000_000}, 400, "max_tokens_out_of_range"),
        (None, {**BODY, "stream": 1}, 400, "invalid_type"),
        (None, {**BODY, "max_tokens": "8"}, 400, "invalid_type"),
        (None, {**BODY, "temprature": 0.5}, 400, "unknown_field"),
        (
            None,
            {**BODY, "audio": {"voice": "alloy", "format": "mp3"}},
            400,
            "capability_unsupported",
        ),
    ],
)
async def test_bad_input_gets_its_own_4xx_and_changes_nothing(
    service, engine, headers, body, status, code
):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post(
            "/v1/chat/completions", json=body, headers=acct.headers if headers is None else headers
        )
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert engine.calls == []
    bal = service.db.transact_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.settled == 0 and bal.held == 0
