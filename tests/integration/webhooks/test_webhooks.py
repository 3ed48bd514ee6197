"""Webhooks end to end: endpoints over HTTP, batches that end, a real receiver on loopback.

Every delivery is verified by the reference ``standardwebhooks`` library in
the receiver (``tests.support.webhook_receiver``). The clock is the manual
one, set to the real time (the library refuses a timestamp five minutes off
the wall clock) and moved to make retries due; the workers are driven by the
test (``worker=False``, ``run_until_idle``), so nothing sleeps.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import func, select

from batchyard.app import webhook_sender
from batchyard.core.accounts import Scope
from batchyard.core.clock import SystemClock
from batchyard.core.sealing import generate_key, key_text
from batchyard.core.sections import WebhookSettings
from batchyard.store import webhook_deliveries, webhook_endpoints
from tests.support.accounts import add_key, make_account
from tests.support.file_batches import chat_line, create, jsonl, upload, worker
from tests.support.server import asgi_client, live_server
from tests.support.waits import HANG_S
from tests.support.webhook_receiver import Receiver
from tests.support.workspace import answer_with

HOOKS = "/v1/webhook-endpoints"
LOOPBACK = {"allowed_networks": ["127.0.0.0/8"], "base_delay_s": 1.0, "jitter": 0.0}


def _service(make_service, settings, clock=None, **overrides: Any):
    """A service whose webhooks may reach loopback; ``clock``: set it to the real time first."""
    if clock is not None:
        clock.set(SystemClock().now())
    return make_service(webhooks=WebhookSettings(**LOOPBACK), **overrides)


async def _register(http, acct, rx: Receiver, *events: str) -> dict[str, Any]:
    r = await http.post(HOOKS, headers=acct.headers, json={"url": rx.url, "events": list(events)})
    assert r.status_code == 201, r.text
    endpoint = r.json()
    rx.secret = endpoint["secret"]
    return endpoint


def _deliveries(service) -> list[Any]:
    t = webhook_deliveries.webhook_deliveries
    return service.db.read_sync(lambda c: list(c.execute(select(t).order_by(t.c.id))))


async def test_a_file_batch_run_with_the_openai_sdk_sends_batch_completed(
    make_service, settings, clock
):
    service = _service(make_service, settings, clock)
    answer_with(service, "hello")
    acct = make_account(service, credit="1")
    async with Receiver() as rx, live_server(service, worker=False) as base:
        async with httpx.AsyncClient(base_url=base, timeout=HANG_S) as http:
            endpoint = await _register(http, acct, rx, "batch.completed", "batch.failed")
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=acct.key, max_retries=0)
        f = await client.files.create(
            file=("r.jsonl", jsonl([chat_line("a"), chat_line("b")])), purpose="batch"
        )
        batch = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await worker(service).run_until_idle()
        assert (await client.batches.retrieve(batch.id)).status == "completed"
        await webhook_sender(service).run_until_idle()
        await client.close()

    assert rx.refused == []
    ((msg_id, event),) = rx.events.items()
    assert event["type"] == "batch.completed" and event["object"] == "event"
    assert event["data"] == {
        "id": batch.id,
        "object": "batch",
        "status": "completed",
        "request_counts": {"total": 2, "completed": 2, "failed": 0},
    }
    (row,) = _deliveries(service)
    assert (row.id, row.status, row.attempts, row.endpoint_id) == (
        msg_id,
        "delivered",
        1,
        endpoint["id"],
    )


async def test_cancel_sends_batch_cancelled_and_a_message_batch_sends_its_end(
    make_service, settings, clock
):
    service = _service(make_service, settings, clock)
    answer_with(service, "hello")
    acct = make_account(service, credit="1")
    async with Receiver() as rx, asgi_client(service, worker=False) as http:
        await _register(http, acct, rx, "batch.cancelled", "message_batch.ended")
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        r = await http.post(f"/v1/batches/{batch['id']}/cancel", headers=acct.headers)
        assert r.json()["status"] == "cancelling"
        mb = await http.post(
            "/v1/messages/batches",
            headers={"x-api-key": acct.key, "anthropic-version": "2023-06-01"},
            json={
                "requests": [
                    {
                        "custom_id": "m1",
                        "params": {
                            "model": "kettei-core",
                            "max_tokens": 8,
                            "messages": [{"role": "user", "content": "Hi."}],
                        },
                    }
                ]
            },
        )
        assert mb.status_code == 200, mb.text
        await worker(service).run_until_idle()
        await webhook_sender(service).run_until_idle()

    assert rx.refused == []
    by_type = {e["type"]: e["data"] for e in rx.events.values()}
    assert set(by_type) == {"batch.cancelled", "message_batch.ended"}
    assert by_type["batch.cancelled"]["id"] == batch["id"]
    assert by_type["batch.cancelled"]["status"] == "cancelled"
    ended = by_type["message_batch.ended"]
    assert ended["id"] == mb.json()["id"] and ended["processing_status"] == "ended"
    assert ended["request_counts"]["succeeded"] == 1


PG = pytest.param("postgresql", marks=pytest.mark.postgres)


@pytest.mark.parametrize("backend", ["sqlite", PG])
async def test_a_receiver_down_for_a_while_gets_the_event_once_back_across_a_restart(
    make_service, settings, clock, backend
):
    key = key_text(generate_key())  # the endpoint's secret is sealed with it, on both stores
    pg = backend == "postgresql"
    service = _service(make_service, settings, clock, postgres=pg, batch_encryption_key=key)
    answer_with(service, "hello")
    acct = make_account(service, credit="1")
    rx = Receiver()  # not listening yet
    async with asgi_client(service, worker=False) as http:
        await _register(http, acct, rx, "batch.completed")
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        await worker(service).run_until_idle()

    sender = webhook_sender(service)
    await sender.run_until_idle()  # connection refused
    (row,) = _deliveries(service)
    assert (row.status, row.attempts) == ("pending", 1)
    assert row.last_error.startswith("webhook_unreachable")
    await sender.run_until_idle()  # not due yet: nothing is sent
    assert _deliveries(service)[0].attempts == 1

    await rx.start()
    try:
        rx.status = 503  # up, but failing
        clock.advance(1)
        await sender.run_until_idle()
        assert rx.seen == [(row.id, 503)]
        assert _deliveries(service)[0].attempts == 2

        # The service restarts (a new process on the same database): the outbox is still there.
        url = service.settings.database_url
        restarted = _service(make_service, settings, database_url=url, batch_encryption_key=key)
        rx.status = 204
        clock.advance(3)
        again = webhook_sender(restarted)
        await again.run_until_idle()
        assert rx.events == {}  # 4 s after the second attempt: not due yet
        clock.advance(1)
        await again.run_until_idle()
        await again.run_until_idle()
    finally:
        await rx.stop()

    assert rx.refused == []
    assert list(rx.events) == [row.id]  # once, with the id the outbox gave it
    assert rx.events[row.id]["data"]["id"] == batch["id"]
    assert rx.seen == [(row.id, 503), (row.id, 204)]
    (done,) = _deliveries(restarted)
    assert (done.status, done.attempts) == ("delivered", 3)
    async with asgi_client(restarted, worker=False) as http:
        log = (await http.get("/v1/activity", headers=acct.headers)).json()["data"]
    attempts = [a["detail"] for a in log if a["kind"] == "webhook_delivery"]
    assert [(a["attempt"], a["outcome"]) for a in attempts] == [
        (1, "retrying"),
        (2, "retrying"),
        (3, "delivered"),
    ]
    assert attempts[1]["status_code"] == 503 and attempts[2]["status_code"] == 204


async def test_hostile_endpoints_are_refused_with_codes_and_nothing_written(
    make_service, settings, clock
):
    service = _service(make_service, settings, clock)
    acct = make_account(service)
    bad = [
        ({"url": "ftp://example.com/x", "events": ["batch.completed"]}, "invalid_webhook_url"),
        # A host no IDNA encoding can name (was a 500 from getaddrinfo; found by schemathesis).
        ({"url": "https://\U00105d59S<x", "events": ["batch.failed"]}, "invalid_webhook_url"),
        # A literal IPv6 address is no host the document allows: a name that resolves to one is.
        ({"url": "http://[::ffff:10.0.0.1]/x", "events": ["batch.failed"]}, "invalid_webhook_url"),
        ({"url": "http://user@example.com/x", "events": ["batch.failed"]}, "invalid_webhook_url"),
        ({"url": "http://example.com:70000/x", "events": ["batch.failed"]}, "invalid_webhook_url"),
        ({"url": "http://example.com/x#f", "events": ["batch.failed"]}, "invalid_webhook_url"),
        # The operator's networks, not the body, forbid these: 403.
        ({"url": "http://10.0.0.1/x", "events": ["batch.completed"]}, "webhook_target_not_allowed"),
        (
            {"url": "http://169.254.169.254/latest/meta-data", "events": ["batch.completed"]},
            "webhook_target_not_allowed",
        ),
        ({"url": "http://0/x", "events": ["batch.failed"]}, "webhook_target_not_allowed"),
        ({"url": "http://127.0.0.1:9/x"}, "invalid_request"),
        ({"url": "http://127.0.0.1:9/x", "events": []}, "invalid_request"),
        ({"url": "http://127.0.0.1:9/x", "events": ["batch.done"]}, "unknown_webhook_event"),
        ({"url": "http://127.0.0.1:9/x", "events": "batch.completed"}, "invalid_type"),
        ({"url": "http://127.0.0.1:9/x", "events": ["batch.failed"], "x": 1}, "unknown_field"),
    ]
    async with asgi_client(service, worker=False) as http:
        for body, code in bad:
            r = await http.post(HOOKS, headers=acct.headers, json=body)
            assert r.status_code == (403 if code == "webhook_target_not_allowed" else 400), r.text
            assert r.json()["error"]["code"] == code, (body, r.json())
    # Without the operator's allowed network, loopback is refused too.
    closed = make_service()
    async with asgi_client(closed, worker=False) as http:
        r = await http.post(
            HOOKS,
            headers=acct.headers,
            json={"url": "http://localhost:9/x", "events": ["batch.failed"]},
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "webhook_target_not_allowed"
    count = service.db.read_sync(
        lambda c: c.execute(select(func.count()).select_from(webhook_endpoints.webhook_endpoints))
    ).scalar()
    assert count == 0


async def test_endpoints_are_listed_shown_rotated_and_deleted_by_scope(
    make_service, settings, clock
):
    service = _service(make_service, settings, clock)
    answer_with(service, "hello")
    acct = make_account(service, credit="1")
    reader = add_key(service, "acme", Scope.READ)
    async with Receiver() as rx, asgi_client(service, worker=False) as http:
        made = await _register(http, acct, rx, "batch.completed")
        assert made["secret"].startswith("whsec_") and made["id"].startswith("we.")
        listed = (await http.get(HOOKS, headers=reader.headers)).json()
        assert [e["id"] for e in listed["data"]] == [made["id"]]
        assert all("secret" not in e for e in listed["data"])
        shown = (await http.get(f"{HOOKS}/{made['id']}", headers=reader.headers)).json()
        assert shown["url"] == rx.url and "secret" not in shown
        r = await http.post(HOOKS, headers=reader.headers, json={"url": rx.url, "events": []})
        assert r.json()["error"]["code"] == "insufficient_scope"

        rotated = (
            await http.post(f"{HOOKS}/{made['id']}/rotate-secret", headers=acct.headers)
        ).json()
        assert rotated["secret"] != made["secret"]
        rx.secret = rotated["secret"]  # deliveries from now on are signed with the new one
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]))).json()
        await create(http, acct.headers, f["id"])
        await worker(service).run_until_idle()
        await webhook_sender(service).run_until_idle()
        assert rx.refused == [] and len(rx.events) == 1

        gone = await http.delete(f"{HOOKS}/{made['id']}", headers=acct.headers)
        assert gone.json() == {
            "id": made["id"],
            "object": "webhook_endpoint.deleted",
            "deleted": True,
        }
        assert (await http.get(f"{HOOKS}/{made['id']}", headers=acct.headers)).status_code == 404
        assert (await http.delete(f"{HOOKS}/{made['id']}", headers=acct.headers)).status_code == 404
        assert (await http.get(f"{HOOKS}/we.nope", headers=acct.headers)).status_code == 404


async def test_a_name_that_does_not_resolve_yet_is_taken_and_the_twenty_first_is_a_conflict(
    make_service, settings, clock
):
    """DNS decides nothing at registration but the addresses it does give (each delivery
    resolves again); the twenty-first endpoint meets the organisation's state: 409."""
    service = _service(make_service, settings, clock)
    acct = make_account(service)
    async with asgi_client(service, worker=False) as http:
        for n in range(20):
            url = f"https://hooks-{n}.example.invalid/in"  # .invalid never resolves
            r = await http.post(
                HOOKS, headers=acct.headers, json={"url": url, "events": ["batch.failed"]}
            )
            assert r.status_code == 201, r.text
        more = {"url": "https://one-more.example.invalid/in", "events": ["batch.failed"]}
        r = await http.post(HOOKS, headers=acct.headers, json=more)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "too_many_webhook_endpoints"
    count = service.db.read_sync(
        lambda c: c.execute(select(func.count()).select_from(webhook_endpoints.webhook_endpoints))
    ).scalar()
    assert count == 20
