"""Holds that cannot resolve by themselves: found, shown in the owner's activity once, resolved.

A chat call whose request died between its hold and its settlement (a crash,
a full disk that outlasted the retries) leaves a hold that nothing will ever
settle. After ``SYNC_HOLD_LIMIT`` it is *stranded*: the hold sweeper writes
one ``hold_unresolved`` entry with what the owner can do, the key of the dead
request says ``idempotency_interrupted`` and points there, and an operator
releases it (``holds.resolve``, behind ``batchyard holds release``) with a
record of who and why. A hold that a worker will resolve by itself (a lapsed
lease) is left to the worker.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest

from batchyard.core.idempotency import fingerprint
from batchyard.core.money import to_ticks
from batchyard.errors import InvalidState
from batchyard.store import billing, holds, ledger
from batchyard.store import idempotency as idem_store
from batchyard.work.holds import HoldSweeper
from tests.support.accounts import make_account
from tests.support.server import asgi_client

CHAT = {"model": "kettei-core", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def test_a_dead_requests_hold_is_shown_once_and_released_by_an_operator(service, clock):
    acct = make_account(service, credit="1")
    # A chat request that claimed its key and held its credit, then died.
    now = clock.now()
    fp = fingerprint("POST", "/v1/chat/completions", CHAT)
    service.db.transact_sync(
        lambda c: idem_store.begin(c, acct.org_id, "lost", fp, now, timedelta(hours=24))
    )
    res = await service.dispatcher.reserve(
        acct.org_id, to_ticks(Decimal("0.01")), purpose="chat", ref="chatcmpl.lost"
    )
    sweeper = HoldSweeper(db=service.db, clock=clock)
    assert await sweeper.sweep() == 0  # young: its request may still be running
    assert service.db.read_sync(lambda c: holds.stranded(c, clock.now())) == []

    clock.advance(holds.SYNC_HOLD_LIMIT.total_seconds() + 1)
    [found] = service.db.read_sync(lambda c: holds.stranded(c, clock.now()))
    assert (found.reservation_id, found.purpose, found.worker_resolves) == (res.id, "chat", False)
    assert "batchyard holds release" in found.remedy
    assert await sweeper.sweep() == 1
    assert await sweeper.sweep() == 0  # once

    async with asgi_client(service, worker=False) as http:
        acts = (await http.get("/v1/activity", headers=acct.headers)).json()["data"]
        retry = await http.post(
            "/v1/chat/completions", json=CHAT, headers={**acct.headers, "Idempotency-Key": "lost"}
        )
        account = (await http.get("/v1/account", headers=acct.headers)).json()

    [flag] = [a for a in acts if a["kind"] == "hold_unresolved"]
    assert flag["reservation_id"] == res.id and flag["ref"] == "chatcmpl.lost"
    assert flag["amount"] == "0.01" and "operator" in flag["detail"]["action"]
    err = retry.json()["error"]
    assert (retry.status_code, err["code"]) == (409, "idempotency_interrupted")
    assert "hold_unresolved" in err["message"] and err["started_at"].endswith("Z")
    assert account["credit"]["held"] == "0.01"

    released = service.db.transact_sync(
        lambda c: holds.resolve(
            c, res.id, clock.now(), charge=None, reason="the call never ran", operator="ops"
        )
    )
    assert released.state == "released"
    with pytest.raises(InvalidState):
        service.db.transact_sync(
            lambda c: holds.resolve(c, res.id, clock.now(), charge=0, reason="x", operator="ops")
        )
    assert service.db.read_sync(lambda c: holds.stranded(c, clock.now())) == []
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert (bal.held, bal.settled) == (0, 0)


async def test_an_operator_settles_a_hold_to_what_the_provider_charged_at_most(make_service, clock):
    service = make_service()
    acct = make_account(service, credit="1")
    res = await service.dispatcher.reserve(acct.org_id, to_ticks(Decimal("0.02")), purpose="decide")
    clock.advance(holds.SYNC_HOLD_LIMIT.total_seconds() + 1)
    settled = service.db.transact_sync(
        lambda c: holds.resolve(
            c, res.id, clock.now(), charge=to_ticks(Decimal("0.5")), reason="billed", operator="ops"
        )
    )
    assert settled.charged == to_ticks(Decimal("0.02"))  # never more than was held
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert (bal.held, bal.settled) == (0, to_ticks(Decimal("0.02")))
    # Not silently: the audit lists the charge the hold could not cover.
    (found,) = service.db.read_sync(billing.audit_charges)
    assert res.id in found and "above its hold" in found
    make_service.expect_over_hold(service, 1)
