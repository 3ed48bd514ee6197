"""The core HTTP service over real loopback HTTP, on SQLite and on PostgreSQL.

Health, account, models, body and key validation, revocation, credit, zero data
retention, and the idempotency rules under concurrency and failure. The clock
is a ManualClock: tier limits allow one request per instant with a burst of
one, so tests that send several move it on between requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from batchyard import errors
from batchyard.core.accounts import Scope
from batchyard.engines.scripted import ScriptedEngine
from batchyard.service import Service
from batchyard.store import accounts, ledger
from batchyard.store.tables import activity, idempotency_keys, ledger_entries
from tests.support.accounts import add_key, make_account
from tests.support.server import asgi_client
from tests.support.waits import settles

BODY = {
    "model": "kettei-core",
    "messages": [{"role": "user", "content": "Say hi"}],
    "max_tokens": 8,
}
CHAT = "/v1/chat/completions"


@pytest.fixture(params=["sqlite", "postgresql"])
def svc(request, make_service):
    """A migrated service on SQLite or PostgreSQL, empty at the start; audited afterwards."""
    if request.param == "postgresql":
        return make_service(postgres=True)
    return make_service()


@pytest.fixture
def engine(svc):
    eng = ScriptedEngine("hello there", clock=svc.clock)
    svc.engines.set("embedded", eng)
    return eng


@pytest.fixture
async def http(svc):
    async with asgi_client(svc) as client:
        yield client


def counts(svc: Service, org_id: str) -> dict[str, int]:
    def q(c):
        out = {}
        for kind in ("topup", "reserve", "settle", "release"):
            out[kind] = c.execute(
                select(func.count())
                .select_from(ledger_entries)
                .where(ledger_entries.c.org_id == org_id, ledger_entries.c.kind == kind)
            ).scalar_one()
        out["activity"] = c.execute(
            select(func.count()).select_from(activity).where(activity.c.org_id == org_id)
        ).scalar_one()
        return out

    return svc.db.read_sync(q)


async def test_healthz(http):
    r = await http.get("/healthz")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


async def test_account_needs_full_or_read_scope(svc, http):
    full = make_account(svc, "acme", credit="12.5")
    read = add_key(svc, "acme", Scope.READ)
    inference = add_key(svc, "acme", Scope.INFERENCE)
    for acct in (full, read):
        r = await http.get("/v1/account", headers=acct.headers)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["organization"] == {"id": full.org_id, "name": "acme"}
        assert body["tier"] == 0
        assert body["credit"] == {"balance": "12.5", "held": "0", "available": "12.5"}
        assert body["effective_limits"] == {
            "requests_per_minute": 30,
            "tokens_per_minute": 40_000,
            "estimate_tokens_per_minute": 400_000,
            "concurrency": 5,
        }
        assert body["zero_data_retention"] is False and body["auto_top_up"] is None
    r = await http.get("/v1/account", headers=inference.headers)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "insufficient_scope"
    assert (await http.get("/v1/account")).json()["error"]["code"] == "missing_api_key"


async def test_models_list_the_catalog_with_prices_and_availability(svc, http):
    acct = make_account(svc, scope=Scope.INFERENCE)
    r = await http.get("/v1/models", headers=acct.headers)
    assert r.status_code == 200
    models = {m["id"]: m for m in r.json()["data"]}
    assert set(models) == {"kettei-core", "kettei-chub", "kettei-fat"}
    assert models["kettei-core"]["pricing"] == {"input_per_mtok": "0.1", "output_per_mtok": "0.4"}
    assert models["kettei-fat"]["pricing"] == {"input_per_mtok": "3", "output_per_mtok": "12"}
    assert {m: v["available"] for m, v in models.items()} == {
        "kettei-core": True,
        "kettei-chub": False,
        "kettei-fat": False,
    }
    assert models["kettei-chub"]["modality"] == ["text", "image"]
    one = await http.get("/v1/models/kettei-core", headers=acct.headers)
    assert one.json() == models["kettei-core"]
    missing = await http.get("/v1/models/nope", headers=acct.headers)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")


async def test_malformed_json_is_400_invalid_json(svc, http, engine):
    acct = make_account(svc)
    for content in (b"{not json", b"", b"[1, 2]", b"\xff\xfe"):
        r = await http.post(
            CHAT, content=content, headers={**acct.headers, "content-type": "application/json"}
        )
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["code"] == "invalid_json"
        assert r.json()["error"]["retryable"] is False
    assert engine.calls == []


async def test_an_oversized_body_is_413_with_or_without_a_length(svc, http, engine):
    svc.settings = dataclasses.replace(svc.settings, max_body_bytes=2048)
    acct = make_account(svc)
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 4000}]}
    r = await http.post(CHAT, json=big, headers=acct.headers)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")

    async def chunks():
        for _ in range(8):
            yield b" " * 512

    json_type = {**acct.headers, "Content-Type": "application/json"}
    r = await http.post(CHAT, content=chunks(), headers=json_type)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
    assert engine.calls == []


async def test_a_bad_idempotency_key_is_400(svc, http, engine):
    acct = make_account(svc)
    for key in ("k" * 129, "has space", "caf\u00e9"):
        r = await http.post(
            CHAT, json=BODY, headers={**acct.headers, "Idempotency-Key": key.encode("utf-8")}
        )
        assert r.status_code == 400, (key, r.text)
        assert r.json()["error"]["code"] == "invalid_idempotency_key"
        assert r.json()["error"]["param"] == "Idempotency-Key"
    assert engine.calls == []
    ok = await http.post(CHAT, json=BODY, headers={**acct.headers, "Idempotency-Key": "k" * 128})
    assert ok.status_code == 200, ok.text


async def test_a_revoked_key_is_refused_at_once(svc, http, engine):
    acct = make_account(svc)
    assert (await http.get("/v1/account", headers=acct.headers)).status_code == 200
    now = svc.clock.now()
    svc.db.transact_sync(lambda c: accounts.revoke_key(c, acct.key_id, now))
    for r in (
        await http.get("/v1/account", headers=acct.headers),
        await http.post(CHAT, json=BODY, headers=acct.headers),
    ):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert engine.calls == []


async def test_insufficient_credit_is_402_and_writes_nothing(svc, http, engine):
    acct = make_account(svc, credit="0.0000001")
    before = counts(svc, acct.org_id)
    r = await http.post(CHAT, json={**BODY, "max_tokens": 1000}, headers=acct.headers)
    assert r.status_code == 402, r.text
    err = r.json()["error"]
    assert (err["code"], err["retryable"]) == ("insufficient_credit", True)
    assert Decimal(err["required"]) > Decimal(err["available"]) == Decimal("0.0000001")
    assert counts(svc, acct.org_id) == before
    assert engine.calls == []


async def test_auto_top_up_happens_before_a_402(svc, http, engine):
    acct = make_account(svc, credit="0")
    svc.db.transact_sync(
        lambda c: accounts.set_auto_topup(c, acct.org_id, Decimal("1"), Decimal("5"))
    )
    r = await http.post(CHAT, json=BODY, headers=acct.headers)
    assert r.status_code == 200, r.text
    bal = svc.db.transact_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.topups == 5 * 10**10 and bal.held == 0
    assert bal.settled == int(Decimal(r.json()["charge"]) * 10**10)
    account = (await http.get("/v1/account", headers=acct.headers)).json()
    assert account["auto_top_up"] == {"threshold": "1", "amount": "5"}


async def test_zero_data_retention_reruns_and_recharges(svc, http, engine, clock):
    acct = make_account(svc)
    svc.db.transact_sync(lambda c: accounts.set_zero_data_retention(c, acct.org_id, True))
    h = {**acct.headers, "Idempotency-Key": "same-key"}
    a = await http.post(CHAT, json=BODY, headers=h)
    clock.advance(60)
    b = await http.post(CHAT, json=BODY, headers=h)
    assert a.status_code == b.status_code == 200
    assert "Idempotent-Replayed" not in b.headers
    assert a.json()["id"] != b.json()["id"]
    assert len(engine.calls) == 2
    assert counts(svc, acct.org_id)["settle"] == 2
    kept = svc.db.transact_sync(
        lambda c: c.execute(select(func.count()).select_from(idempotency_keys)).scalar_one()
    )
    assert kept == 0


class SlowEngine(ScriptedEngine):
    """A ScriptedEngine that waits on the manual clock and says when a call has begun."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered = asyncio.Event()

    async def complete(self, request):
        self.entered.set()
        return await super().complete(request)


async def test_two_concurrent_requests_with_one_key_run_once(svc, http, clock):
    slow = SlowEngine("slow answer", clock=clock, delay_s=5)
    svc.engines.set("embedded", slow)
    acct = make_account(svc)
    h = {**acct.headers, "Idempotency-Key": "together"}
    first = asyncio.create_task(http.post(CHAT, json=BODY, headers=h))
    second = asyncio.create_task(http.post(CHAT, json=BODY, headers=h))
    # The engine waits on the manual clock, so whichever request claimed the key
    # cannot finish before the other one has been answered.
    done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    early = done.pop().result()
    assert early.status_code == 409, early.text
    assert early.json()["error"]["code"] == "idempotency_in_progress"
    assert early.json()["error"]["retryable"] is True
    assert early.headers["Retry-After"] == "1"
    await settles(slow.entered.wait())
    clock.advance(5)
    late = await asyncio.gather(first, second)
    winner = next(r for r in late if r.status_code == 200)
    assert len(slow.calls) == 1
    replay = await http.post(CHAT, json=BODY, headers=h)
    assert replay.json() == winner.json()
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert len(slow.calls) == 1
    assert counts(svc, acct.org_id)["settle"] == 1


async def test_a_retryable_failure_is_not_saved_and_the_same_key_succeeds(svc, http, engine, clock):
    engine.fail_next(errors.UpstreamError("upstream fell over"))
    acct = make_account(svc)
    h = {**acct.headers, "Idempotency-Key": "retry-me"}
    r = await http.post(CHAT, json=BODY, headers=h)
    assert r.status_code == 502
    assert r.json()["error"] == {**r.json()["error"], "code": "upstream_error", "retryable": True}
    c = counts(svc, acct.org_id)
    assert (c["reserve"], c["release"], c["settle"]) == (1, 1, 0)  # held, then released
    clock.advance(60)
    again = await http.post(CHAT, json=BODY, headers=h)
    assert again.status_code == 200, again.text
    assert "Idempotent-Replayed" not in again.headers
    assert len(engine.calls) == 2


async def test_a_non_retryable_failure_is_saved_and_replayed(svc, http, engine, clock):
    engine.fail_next(
        errors.UpstreamError("no such model", code="upstream_rejected", retryable=False)
    )
    acct = make_account(svc)
    h = {**acct.headers, "Idempotency-Key": "fails-for-good"}
    r = await http.post(CHAT, json=BODY, headers=h)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_rejected"
    clock.advance(60)
    again = await http.post(CHAT, json=BODY, headers=h)
    assert (again.status_code, again.json()) == (502, r.json())
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(engine.calls) == 1
    assert counts(svc, acct.org_id)["settle"] == 0


async def test_a_saved_response_expires_after_24_hours(svc, http, engine, clock):
    acct = make_account(svc)
    h = {**acct.headers, "Idempotency-Key": "day-old"}
    assert (await http.post(CHAT, json=BODY, headers=h)).status_code == 200
    clock.advance(24 * 3600)
    r = await http.post(CHAT, json=BODY, headers=h)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "idempotency_response_expired")
    assert len(engine.calls) == 1


async def test_an_expired_key_never_runs_again_after_housekeeping_years_later(
    svc, http, engine, clock
):
    """Issue 22: housekeeping drops the saved answer's text after 24 hours and keeps the key's
    tombstone for good, so "never runs the text again" holds years on."""
    acct = make_account(svc)
    h = {**acct.headers, "Idempotency-Key": "forever-expired"}
    assert (await http.post(CHAT, json=BODY, headers=h)).status_code == 200
    clock.advance(24 * 3600)
    await svc.deferred_batches.housekeep()
    saved = svc.db.read_sync(lambda c: c.execute(select(idempotency_keys)).one())
    assert (saved.state, saved.response) == ("expired", None)  # the answer's text is gone
    for _ in range(4):
        clock.advance(365 * 24 * 3600)
        await svc.deferred_batches.housekeep()
    r = await http.post(CHAT, json=BODY, headers=h)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "idempotency_response_expired")
    assert len(engine.calls) == 1


async def test_activity_shows_the_charge_with_its_reservation(svc, http, engine):
    acct = make_account(svc)
    r = (await http.post(CHAT, json=BODY, headers=acct.headers)).json()
    acts = (await http.get("/v1/activity", headers=acct.headers)).json()["data"]
    charge = [a for a in acts if a["kind"] == "charge"]
    assert len(charge) == 1
    assert charge[0]["reservation_id"] == r["reservation_id"]
    assert charge[0]["amount"] == r["charge"]
    assert charge[0]["ref"] == r["id"]
