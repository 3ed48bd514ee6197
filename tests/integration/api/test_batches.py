"""POST/GET /v1/batches over real HTTP: submission rules, idempotency, limits, visibility."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from batchyard.core.accounts import Scope
from batchyard.core.clock import isoformat
from batchyard.core.money import charge_ticks, format_money
from batchyard.engines.scripted import ScriptedEngine
from batchyard.store.deferred_batch_tables import batch_items
from tests.support.accounts import add_key, make_account
from tests.support.cached_routes import CACHED_PER_MTOK, cached_catalog, settled
from tests.support.deferred_batches import (
    all_items,
    batch_body,
    chat,
    feed_route,
    fixed_route,
    set_price,
    submit,
    worker,
)
from tests.support.server import asgi_client


@pytest.fixture
def svc(market):
    return market(feed_route("spot"), fixed_route("bigroute", "0.05", "0.2", model="big"))


async def test_first_batch_on_the_default_catalog_completes_without_a_feed(service):
    """Newcomer path: kettei-core on the embedded route (95 % off, hard caps)."""
    engine = ScriptedEngine("release summary", clock=service.clock)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    body = {
        "min_discount": 90,
        "completion_window": "24h",
        "requests": [
            {
                "custom_id": "release-summary",
                "body": {
                    "model": "kettei-core",
                    "messages": [
                        {"role": "user", "content": "Summarize this public release note."}
                    ],
                    "max_tokens": 64,
                    "privacy": {"mode": "redact"},
                },
            }
        ],
    }
    async with asgi_client(service, worker=False) as http:
        r = await submit(http, acct.headers, body)
        assert r.status_code == 201, r.text
        created = r.json()
        report = await worker(service).run_pass()
        assert report.succeeded == 1
        got = (await http.get(f"/v1/batches/{created['id']}", headers=acct.headers)).json()
        res = await http.get(created["results_url"], headers=acct.headers)
    assert created["id"].startswith("bat.")
    assert created["status"] == "in_progress"
    assert created["deadline"] == isoformat(service.clock.now() + timedelta(hours=24))
    assert created["min_discount"] == 90 and created["completion_window"] == "24h"
    assert created["requests"] == [{"custom_id": "release-summary", "status": "waiting"}]
    assert created["request_counts"]["waiting"] == 1 and created["request_counts"]["total"] == 1
    assert created["results_url"] == f"/v1/batches/{created['id']}/results"
    assert got["status"] == "completed"
    assert got["request_counts"]["succeeded"] == 1
    assert res.headers["content-type"].startswith("application/x-ndjson")
    (line,) = [httpx.Response(200, content=x).json() for x in res.content.splitlines()]
    assert line["custom_id"] == "release-summary" and line["status"] == "succeeded"
    assert line["result"]["status_code"] == 200
    completion = line["result"]["body"]
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"] == "release summary"
    assert completion["route"] == "embedded"
    assert line["reservation_id"].startswith("res.")
    # Charged at the route's offered price, not the direct one.
    words_in = len(["Summarize", "this", "public", "release", "note."])
    expected = (words_in * 0.005 + 2 * 0.02) / 1e6
    assert float(completion["charge"]) == pytest.approx(expected, abs=1e-10)


async def test_same_key_same_body_is_the_same_batch_other_body_is_409(svc):
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        a = await submit(http, acct.headers, batch_body(2), key="same-key-1")
        b = await submit(http, acct.headers, batch_body(2), key="same-key-1")
        c = await submit(http, acct.headers, batch_body(3), key="same-key-1")
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] == b.json()["id"]
    assert c.status_code == 409 and c.json()["error"]["code"] == "idempotency_conflict"
    assert len(all_items(svc)) == 2


def _many(n: int) -> dict:
    return batch_body(n)


def _with(**req) -> dict:
    body = batch_body(1)
    body["requests"][0].update(req)
    return body


def _body_with(**extra) -> dict:
    return _with(body=chat(**extra))


BAD = [
    (_many(51), 400, "too_many_requests"),
    (_many(0), 400, "no_requests"),
    (
        {"min_discount": 90, "requests": [{"custom_id": "a", "body": chat()}] * 2},
        400,
        "duplicate_custom_id",
    ),
    (_body_with(max_tokens=4097), 400, "max_tokens_out_of_range"),
    (batch_body(1, completion_window="2h"), 400, "invalid_completion_window"),
    (batch_body(1, min_discount=101), 400, "min_discount_out_of_range"),
    (batch_body(1, min_discount=-1), 400, "min_discount_out_of_range"),
    ({"requests": [{"custom_id": "a", "body": chat()}]}, 400, "min_discount_required"),
    (_with(min_discount=80), 400, "min_discount_below_batch"),
    (_with(custom_id="has space"), 400, "invalid_custom_id"),
    (_with(custom_id="x" * 65), 400, "invalid_custom_id"),
    (_body_with(stream=True), 400, "streaming_unsupported"),
    (_body_with(tools=[{"type": "function"}]), 400, "tools_unsupported"),
    (
        _with(
            body={
                "model": "kettei-core",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}],
                    }
                ],
            }
        ),
        400,
        "unsupported_input",
    ),
    (_body_with(model="nope"), 404, "unknown_model"),
    # A model nobody serves is 404 whatever else the batch holds, as at every door.
    (
        {"min_discount": 90, "requests": [{"custom_id": "a", "body": chat(model="nope")}] * 2},
        404,
        "unknown_model",
    ),
    (_body_with(privacy={"mode": "maybe"}), 400, "invalid_privacy_mode"),
    (_body_with(n=2), 400, "unsupported_parameter"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD, ids=[c for _, _, c in BAD])
async def test_bad_submissions_are_refused_and_queue_nothing(svc, body, status, code):
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        r = await submit(http, acct.headers, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert all_items(svc) == []


async def test_one_bad_request_among_many_queues_nothing(svc):
    acct = make_account(svc)
    body = batch_body(10)
    body["requests"][9]["body"]["max_tokens"] = 5000
    async with asgi_client(svc, worker=False) as http:
        r = await submit(http, acct.headers, body)
    assert r.status_code == 400 and "requests[9]" in r.json()["error"]["param"]
    assert all_items(svc) == []


async def test_output_tokens_cap_at_4096_and_default_to_1024(svc):
    acct = make_account(svc)
    big = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}
    ok = {
        "min_discount": 90,
        "requests": [
            {"custom_id": "max", "body": {**big, "max_tokens": 4096}},
            {"custom_id": "default", "body": big},
        ],
    }
    over = {
        "min_discount": 90,
        "requests": [{"custom_id": "o", "body": {**big, "max_tokens": 4097}}],
    }
    async with asgi_client(svc, worker=False) as http:
        r = await submit(http, acct.headers, ok)
        bad = await submit(http, acct.headers, over)
    assert r.status_code == 201, r.text
    assert [i.max_tokens for i in all_items(svc)] == [4096, 1024]
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "max_tokens_out_of_range"


async def test_body_over_1_mb_is_413(svc):
    acct = make_account(svc)
    body = batch_body(1)
    body["requests"][0]["body"]["messages"][0]["content"] = "x" * 1_000_001
    async with asgi_client(svc, worker=False) as http:
        r = await submit(http, acct.headers, body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert all_items(svc) == []


@pytest.mark.parametrize(
    ("key", "code"), [(None, "idempotency_key_required"), ("7-chars", "invalid_idempotency_key")]
)
async def test_idempotency_key_is_required_and_8_to_128_chars(svc, key, code):
    acct = make_account(svc)
    headers = dict(acct.headers)
    if key is not None:
        headers["Idempotency-Key"] = key
    async with asgi_client(svc, worker=False) as http:
        r = await http.post("/v1/batches", json=batch_body(1), headers=headers)
        ok = await submit(http, acct.headers, batch_body(1), key="8-chars!")
    assert r.status_code == 400 and r.json()["error"]["code"] == code
    assert ok.status_code == 201
    assert len(all_items(svc)) == 1


async def test_eleventh_submission_in_a_minute_is_429_with_retry_after(svc, clock):
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        codes = [(await submit(http, acct.headers, batch_body(1))).status_code for _ in range(10)]
        eleventh = await submit(http, acct.headers, batch_body(1))
        clock.advance(60)
        later = await submit(http, acct.headers, batch_body(1))
    assert codes == [201] * 10
    assert eleventh.status_code == 429
    assert eleventh.json()["error"]["code"] == "rate_limited"
    assert int(eleventh.headers["Retry-After"]) >= 1
    assert later.status_code == 201
    assert len(all_items(svc)) == 11


async def test_the_201st_pending_item_is_refused(svc):
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        full = [(await submit(http, acct.headers, batch_body(50))).status_code for _ in range(4)]
        over = await submit(http, acct.headers, batch_body(1))
        other = make_account(svc, "other-org")
        elsewhere = await submit(http, other.headers, batch_body(1))
    assert full == [201] * 4
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "pending_limit_exceeded"
    # Retryable, so it says when: items free up on the market's passes (issue 22).
    assert over.headers["x-should-retry"] == "true"
    assert over.headers["Retry-After"] == str(int(svc.settings.market_interval_s))
    assert over.json()["error"]["retry_after"] == svc.settings.market_interval_s
    assert elsewhere.status_code == 201  # the limit is per organisation
    assert len(all_items(svc)) == 201


async def test_batches_are_visible_only_to_their_owner(svc):
    acct = make_account(svc)
    reader = add_key(svc, "acme", Scope.READ)
    other = make_account(svc, "other-org")
    async with asgi_client(svc, worker=False) as http:
        bid = (await submit(http, acct.headers, batch_body(1))).json()["id"]
        mine = await http.get(f"/v1/batches/{bid}", headers=reader.headers)
        theirs = [
            await http.get(f"/v1/batches/{bid}", headers=other.headers),
            await http.get(f"/v1/batches/{bid}/results", headers=other.headers),
            await http.post(f"/v1/batches/{bid}/cancel", headers=other.headers),
        ]
        listed = (await http.get("/v1/batches", headers=other.headers)).json()
    assert mine.status_code == 200
    assert [r.status_code for r in theirs] == [404, 404, 404]
    assert listed["data"] == []


async def test_list_is_newest_first_with_a_cursor(svc, clock):
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        ids = []
        for _ in range(3):
            ids.append((await submit(http, acct.headers, batch_body(1))).json()["id"])
            clock.advance(1)
        page1 = (await http.get("/v1/batches?limit=2", headers=acct.headers)).json()
        page2 = (
            await http.get(
                f"/v1/batches?limit=2&after={page1['next_cursor']}", headers=acct.headers
            )
        ).json()
    assert [b["id"] for b in page1["data"]] == ids[::-1][:2]
    assert [b["id"] for b in page2["data"]] == ids[:1]
    assert page2["next_cursor"] is None
    assert page1["data"][0]["request_counts"]["waiting"] == 1


async def test_cancel_stops_waiting_items(svc):
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        bid = (await submit(http, acct.headers, batch_body(3))).json()["id"]
        r = await http.post(f"/v1/batches/{bid}/cancel", headers=acct.headers)
        again = await http.post(f"/v1/batches/{bid}/cancel", headers=acct.headers)
        res = await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)
    assert r.status_code == 200
    assert r.json()["status"] == "canceled"
    assert r.json()["request_counts"]["canceled"] == 3
    assert again.status_code == 200
    lines = [httpx.Response(200, content=x).json() for x in res.content.splitlines()]
    assert [ln["status"] for ln in lines] == ["canceled"] * 3
    assert [ln["result"] for ln in lines] == [None] * 3


async def test_results_are_purged_24_hours_after_completion(svc, clock):
    svc.engines.set("spot", ScriptedEngine("answer", clock=clock))
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        bid = (await submit(http, acct.headers, batch_body(1))).json()["id"]
        set_price(svc, "spot", "0.001", "0.004")
        await worker(svc).run_pass()
        ok = await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)
        clock.advance(24 * 3600 - 1)
        await worker(svc).run_pass()
        still = await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)
        clock.advance(2)
        await worker(svc).run_pass()
        gone = await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)
        meta = await http.get(f"/v1/batches/{bid}", headers=acct.headers)
    assert ok.status_code == still.status_code == 200
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "results_expired"
    assert meta.status_code == 200
    assert meta.json()["request_counts"]["succeeded"] == 1 and meta.json()["results_purged"]
    blobs = svc.db.transact_sync(
        lambda c: c.execute(
            select(func.count()).where(
                (batch_items.c.body.is_not(None)) | (batch_items.c.result.is_not(None))
            )
        ).scalar_one()
    )
    assert blobs == 0


@pytest.mark.postgres
async def test_postgres_without_a_key_answers_503_and_runs_nothing(make_service, monkeypatch):
    monkeypatch.delenv("BATCHYARD_BATCH_ENCRYPTION_KEY", raising=False)
    svc = make_service(postgres=True, batch_encryption_key=None)
    acct = make_account(svc)
    assert not worker(svc).available
    async with asgi_client(svc) as http:
        r = await submit(http, acct.headers, batch_body(1))
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "batches_unavailable"
    assert "BATCHYARD_BATCH_ENCRYPTION_KEY" in err["message"]
    assert (await worker(svc).run_pass()).dispatched == 0
    assert all_items(svc) == []


async def test_sqlite_default_creates_a_private_key_file_beside_the_database(make_service):
    import os
    import stat

    svc = make_service()
    key_path = svc.settings.sqlite_path.parent / "batch.key"
    assert svc.batch_key.created and svc.batch_key.path == str(key_path)
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    again = make_service()
    assert not again.batch_key.created


async def _answered_on_the_model(service, n: int) -> list[dict[str, Any]]:
    """``n`` requests of 4 tokens each, answered by one worker pass: their result lines."""
    acct = make_account(service, credit="1")
    body = batch_body(n)
    for r in body["requests"]:
        r["body"]["max_tokens"] = 4
    async with asgi_client(service, worker=False) as http:
        bid = (await submit(http, acct.headers, body)).json()["id"]
        report = await worker(service).run_pass()
        res = await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)
    assert report.succeeded == n, report
    return [httpx.Response(200, content=x).json() for x in res.content.splitlines()]


@pytest.mark.model
async def test_a_batch_on_the_real_embedded_model_end_to_end(service):
    lines = await _answered_on_the_model(service, 2)
    for line in lines:
        usage = line["result"]["body"]["usage"]
        assert 1 <= usage["completion_tokens"] <= 4 and usage["prompt_tokens"] > 5
        assert float(line["result"]["body"]["charge"]) > 0


@pytest.mark.model
async def test_a_batchs_cached_prompt_tokens_are_charged_at_the_routes_cached_price(make_service):
    service = make_service(catalog=cached_catalog())
    lines = await _answered_on_the_model(service, 3)
    # The embedded route's market price (what a deferred item pays), cached tokens for less.
    [offer] = worker(service).prices.offers("kettei-core", service.clock.now())
    assert offer.price is not None and offer.price.input_per_mtok > CACHED_PER_MTOK
    cached = []
    for line in lines:
        answer = line["result"]["body"]
        usage = answer["usage"]
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        assert answer["charge"] == format_money(
            charge_ticks(settled(service.catalog, "kettei-core", usage, offer.price))
        )
    # The three requests ask the same prompt: the engine reads it once.
    assert max(cached) > 0
