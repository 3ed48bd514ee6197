"""A ``batchyard worker`` SIGKILLed in the middle of a webhook POST: the delivery is sent again.

A model call cut off by a dead worker is never sent twice (``uncertain``); a
webhook delivery is, since receivers dedupe on ``webhook-id``: the contract is
at least once, with a stable id. The receiver (real, on loopback, verifying
with ``standardwebhooks``) holds the first POST open; the worker process
sending it is killed with SIGKILL; a second worker recovers the lapsed claim
and delivers the same ``webhook-id``, which the receiver accepts. The
delivery ends ``delivered`` after one counted attempt, and the activity log
shows the attempt that was cut off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from batchyard.store import activity, webhook_deliveries
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.processes import Workers, deployment
from tests.support.services import ServiceFactory
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.postgres

WEBHOOKS = {
    "allowed_networks": ["127.0.0.0/8"],
    "lease_s": 1.5,
    "poll_s": 0.05,
    "flush_s": 0.05,
    "timeout_s": 60,
}


async def test_a_delivery_cut_off_by_sigkill_is_delivered_again_with_its_id(
    tmp_path: Path, pg_url: str, workers: Workers, make_service: ServiceFactory
) -> None:
    with FakeUpstream() as up:
        async with (
            Receiver() as rx,
            deployment(make_service, tmp_path, pg_url, upstream=up, webhooks=WEBHOOKS) as dep,
        ):
            svc, http = dep.service, dep.http
            acct = make_account(svc)
            r = await http.post(
                "/v1/webhook-endpoints",
                headers=acct.headers,
                json={"url": rx.url, "events": ["batch.completed"]},
            )
            assert r.status_code == 201, r.text
            rx.secret = r.json()["secret"]
            rx.holding = True
            now = dep.clock.now()
            data = {"id": "bat.x", "object": "batch", "status": "completed"}
            (msg_id,) = svc.db.transact_sync(
                lambda c: webhook_deliveries.enqueue(c, acct.org_id, "batch.completed", data, now)
            )

            first = workers.start(config=dep.config, database_url=pg_url, name="worker-1")
            await workers.until(lambda: rx.seen == [(msg_id, 0)], "the POST is held")
            assert first.kill() == -9
            rx.release()
            workers.start(config=dep.config, database_url=pg_url, name="worker-2")
            await workers.until(lambda: msg_id in rx.events, "the delivery arrives again")

            t = webhook_deliveries.webhook_deliveries

            def row():
                return svc.db.read_sync(
                    lambda c: c.execute(select(t).where(t.c.id == msg_id)).one()
                )

            await workers.until(lambda: row().status == "delivered", "the delivery is recorded")
            log = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))

    assert rx.refused == []
    assert [s for s in rx.seen if s[1] != 503] == [(msg_id, 0), (msg_id, 204)]
    assert list(rx.events) == [msg_id] and rx.events[msg_id]["data"] == data
    done = row()
    assert (done.status, done.attempts, done.lease_owner) == ("delivered", 1, None)
    outcomes = [a["detail"]["outcome"] for a in log if a["kind"] == "webhook_delivery"]
    assert outcomes == ["interrupted", "delivered"]
