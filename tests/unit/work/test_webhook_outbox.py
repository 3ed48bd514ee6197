"""The webhook outbox as leased work: claimed once, retried with backoff, recovered as retries.

In memory (the unit tier's store), on a clock the test moves; the HTTP side is
``tests/integration/webhooks``. What is checked here is the queue's rules:
one row per subscribed endpoint, a claim that no second worker can take, a
failed attempt due again only after its backoff, a delivery given up after
``max_attempts``, each attempt in the activity log, and a claim whose worker
died mid-POST due again with the same id (never ``uncertain``).
"""

from __future__ import annotations

import json
import random
from datetime import timedelta

from sqlalchemy import select

from batchyard.core.sections import WebhookSettings
from batchyard.core.telemetry import MemoryRecorder
from batchyard.errors import UpstreamError
from batchyard.store import accounts, activity
from batchyard.store import webhook_deliveries as outbox
from batchyard.store import webhook_endpoints as endpoints
from batchyard.work.runner import Answered, Failed
from batchyard.work.webhook_sender import DeliveryQueue, WebhookSender

SECRET = "whsec_" + "A" * 43 + "="


def _setup(db, clock, events=("batch.completed",)):
    now = clock.now()

    def tx(c):
        org = accounts.ensure_org(c, "acme", now)
        e = endpoints.create_endpoint(
            c, org.id, "https://hooks.example/x", events, None, SECRET, now
        )
        return org.id, e.id

    return db.transact_sync(tx)


def _event(db, clock, org_id, event="batch.completed"):
    now = clock.now()
    return db.transact_sync(
        lambda c: outbox.enqueue(c, org_id, event, {"id": "bat.1", "status": "completed"}, now)
    )


def _row(db, msg_id):
    t = outbox.webhook_deliveries
    return db.read_sync(lambda c: c.execute(select(t).where(t.c.id == msg_id)).one())


def _sender(db, clock, **knobs):
    settings = WebhookSettings(**knobs)
    return WebhookSender(
        db=db, clock=clock, metrics=MemoryRecorder(), settings=settings, rand=random.Random(1)
    )


def _claim(db, clock, owner, want=10):
    now = clock.now()
    until = now + timedelta(seconds=60)
    return db.transact_sync(lambda c: DeliveryQueue(owner).claim(c, want, now, until))


def test_an_event_is_one_row_per_subscribed_endpoint_with_ids_and_counts_only(db, clock):
    org_id, endpoint_id = _setup(db, clock)
    (msg_id,) = _event(db, clock, org_id)
    assert _event(db, clock, org_id, "batch.failed") == []  # not subscribed
    row = _row(db, msg_id)
    assert row.status == "pending" and row.endpoint_id == endpoint_id and row.attempts == 0
    body = json.loads(row.payload)
    assert body["type"] == "batch.completed" and body["object"] == "event"
    assert body["data"] == {"id": "bat.1", "status": "completed"}


def test_a_claim_is_one_workers_and_carries_the_opened_secret(db, clock):
    org_id, _ = _setup(db, clock)
    (msg_id,) = _event(db, clock, org_id)
    (claim,) = _claim(db, clock, "w1")
    assert claim.key == msg_id and claim.unit.secret == SECRET
    assert claim.unit.url == "https://hooks.example/x"
    assert _claim(db, clock, "w2") == []


def test_a_failed_attempt_is_due_again_after_its_backoff_and_recorded(db, clock):
    org_id, endpoint_id = _setup(db, clock)
    (msg_id,) = _event(db, clock, org_id)
    sender = _sender(db, clock, base_delay_s=10.0, jitter=0.0)
    queue = DeliveryQueue("w1")
    (claim,) = _claim(db, clock, "w1")
    result = sender.render(claim.unit, Answered(503))
    assert result.outcome == "retrying" and result.error == "the receiver answered 503"
    assert result.retry_at == clock.now() + timedelta(seconds=10)
    now = clock.now()
    held = {claim.key: claim.lease}
    assert db.transact_sync(lambda c: queue.record(c, held, [result], now)) == 1
    row = _row(db, msg_id)
    assert (row.status, row.attempts, row.last_status_code) == ("pending", 1, 503)
    assert row.lease_owner is None
    assert _claim(db, clock, "w2") == []  # not due yet
    clock.advance(10)
    (again,) = _claim(db, clock, "w2")
    assert again.key == msg_id and again.unit.attempts == 1
    log = db.read_sync(lambda c: activity.list_activity(c, org_id))
    assert [(a["kind"], a["ref"]) for a in log] == [("webhook_delivery", msg_id)]
    detail = log[0]["detail"]
    assert detail["endpoint_id"] == endpoint_id and detail["outcome"] == "retrying"
    assert detail["attempt"] == 1 and detail["status_code"] == 503


def test_a_delivery_is_given_up_after_max_attempts(db, clock):
    org_id, _ = _setup(db, clock)
    (msg_id,) = _event(db, clock, org_id)
    sender = _sender(db, clock, max_attempts=2, base_delay_s=1.0, jitter=0.0)
    queue = DeliveryQueue("w1")
    for attempt in (1, 2):
        (claim,) = _claim(db, clock, "w1")
        failed = Failed(UpstreamError("refused", code="webhook_unreachable"))
        result = sender.render(claim.unit, failed)
        now = clock.now()
        db.transact_sync(lambda c, r=result, k=claim: queue.record(c, {k.key: k.lease}, [r], now))
        clock.advance(1)
        assert result.attempt == attempt
    row = _row(db, msg_id)
    assert (row.status, row.attempts) == ("failed", 2)
    assert row.last_error == "webhook_unreachable: refused"
    assert _claim(db, clock, "w1") == []


def test_a_2xx_is_delivered_once(db, clock):
    org_id, _ = _setup(db, clock)
    (msg_id,) = _event(db, clock, org_id)
    sender = _sender(db, clock)
    (claim,) = _claim(db, clock, "w1")
    result = sender.render(claim.unit, Answered(204))
    now = clock.now()
    db.transact_sync(
        lambda c: DeliveryQueue("w1").record(c, {claim.key: claim.lease}, [result], now)
    )
    row = _row(db, msg_id)
    assert (row.status, row.delivered_at) == ("delivered", clock.now())
    clock.advance(3600)
    assert _claim(db, clock, "w2") == []


async def test_a_claim_whose_worker_died_mid_post_is_retried_with_the_same_id(db, clock):
    org_id, _ = _setup(db, clock)
    (msg_id,) = _event(db, clock, org_id)
    (claim,) = _claim(db, clock, "dead")
    now = clock.now()
    held = {claim.key: claim.lease}
    assert db.transact_sync(lambda c: DeliveryQueue("dead").mark_sent(c, held, now)) == {msg_id}
    sender = _sender(db, clock)
    assert await sender.recover() == 0  # its lease runs
    clock.advance(61)
    assert await sender.recover() == 1
    row = _row(db, msg_id)
    assert (row.status, row.lease_owner, row.sent_at) == ("pending", None, None)
    assert sender.metrics.counts[("uncertain", "webhooks")] == 0
    assert sender.metrics.counts[("leases_recovered", "webhooks")] == 1
    (again,) = _claim(db, clock, "w2")
    assert again.key == msg_id
    log = db.read_sync(lambda c: activity.list_activity(c, org_id))
    assert [a["detail"]["outcome"] for a in log] == ["interrupted"]
    # A stale holder's late result changes nothing.
    late = sender.render(claim.unit, Answered(200))
    now = clock.now()
    assert db.transact_sync(lambda c: DeliveryQueue("dead").record(c, held, [late], now)) == 0


def test_a_deleted_endpoint_gets_nothing_more(db, clock):
    org_id, endpoint_id = _setup(db, clock)
    (msg_id,) = _event(db, clock, org_id)
    now = clock.now()

    def delete(c):
        endpoints.delete_endpoint(c, org_id, endpoint_id, now)
        return outbox.give_up_endpoint(c, endpoint_id, now)

    assert db.transact_sync(delete) == 1
    assert _row(db, msg_id).status == "failed"
    assert _event(db, clock, org_id) == []
    assert _claim(db, clock, "w1") == []


def test_a_lapsed_claim_is_taken_back_by_recovery_not_claimed_over(db, clock):
    """Claiming a lapsed claim directly would erase its sent mark and its cut-off record."""
    org_id, _ = _setup(db, clock)
    (msg_id,) = _event(db, clock, org_id)
    (claim,) = _claim(db, clock, "dead")
    now = clock.now()
    held = {claim.key: claim.lease}
    db.transact_sync(lambda c: DeliveryQueue("dead").mark_sent(c, held, now))
    clock.advance(61)
    assert _claim(db, clock, "w2") == []  # lapsed, but not free until recovered
    now = clock.now()
    assert db.transact_sync(lambda c: outbox.let_go(c, None, now)) == (1, 1)
    (again,) = _claim(db, clock, "w2")
    assert again.key == msg_id
    log = db.read_sync(lambda c: activity.list_activity(c, org_id))
    assert [a["detail"]["outcome"] for a in log] == ["interrupted"]
