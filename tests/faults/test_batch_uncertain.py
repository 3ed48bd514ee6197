"""A worker killed mid-call: the item ends ``uncertain``, its reservation held and visible.

Nothing is retried and nothing is released, because the provider may have
run (and billed) the call; the held reservation shows in GET /v1/activity so
the owner can check before resubmitting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta

import httpx

from batchyard.app import market_worker
from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.batches import (
    BlockingEngine,
    batch_body,
    eventually,
    feed_route,
    item_rows,
    set_price,
    submit,
    worker,
)
from tests.support.server import live_server


async def test_killed_mid_call_becomes_uncertain_with_its_reservation_held(market, clock):
    svc = market(feed_route("spot"))
    engine = BlockingEngine()
    svc.engines.set("spot", engine)
    acct = make_account(svc, credit="1")
    async with live_server(svc, worker=False) as base, httpx.AsyncClient(base_url=base) as http:
        bid = (await submit(http, acct.headers, batch_body(1))).json()["id"]
        set_price(svc, "spot", "0.008", "0.03")

        doomed = market_worker(svc, lease_s=120, book=worker(svc).book)
        task = asyncio.create_task(doomed.run_pass())
        await asyncio.wait_for(engine.entered.wait(), 5)
        (item,) = item_rows(svc, bid)
        assert item.status == "dispatched" and item.reservation_id
        task.cancel()  # the worker dies while the engine call is in flight
        with contextlib.suppress(asyncio.CancelledError):
            await task

        # Another worker, before the lease lapses: the item is not touched.
        survivor = market_worker(svc, book=worker(svc).book)
        await survivor.run_pass()
        assert item_rows(svc, bid)[0].status == "dispatched"

        clock.advance(121)
        report = await survivor.run_pass()
        assert report.uncertain == 1

        (after,) = item_rows(svc, bid)
        res = svc.db.transact_sync(lambda c: ledger.get_reservation(c, item.reservation_id))
        bal = svc.db.transact_sync(lambda c: ledger.balance(c, acct.org_id))
        activity = (await http.get("/v1/activity", headers=acct.headers)).json()["data"]
        batch = (await http.get(f"/v1/batches/{bid}", headers=acct.headers)).json()
        lines = (await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)).content

        # More passes later: still no retry.
        clock.advance(3600)
        await survivor.run_pass()

    assert after.status == "uncertain" and after.reservation_id == item.reservation_id
    assert res.state == "held" and bal.held == res.amount > 0
    assert len(engine.calls) == 1
    kinds = {a["kind"]: a for a in activity}
    assert kinds["dispatch"]["reservation_id"] == item.reservation_id
    assert kinds["uncertain"]["reservation_id"] == item.reservation_id
    assert kinds["uncertain"]["ref"] == item.id
    assert batch["requests"] == [
        {"custom_id": "req-0", "status": "uncertain", "reason": "interrupted"}
    ]
    assert batch["status"] == "completed"
    (line,) = [json.loads(x) for x in lines.splitlines()]
    assert line == {
        "custom_id": "req-0",
        "status": "uncertain",
        "result": None,
        "reservation_id": item.reservation_id,
    }


async def test_a_worker_that_keeps_its_lease_alive_is_not_declared_uncertain(market, clock):
    svc = market(feed_route("spot"))
    engine = BlockingEngine("slow but fine")
    svc.engines.set("spot", engine)
    acct = make_account(svc, credit="1")
    async with live_server(svc, worker=False) as base, httpx.AsyncClient(base_url=base) as http:
        bid = (await submit(http, acct.headers, batch_body(1))).json()["id"]
    set_price(svc, "spot", "0.008", "0.03")
    slow = market_worker(svc, lease_s=120, book=worker(svc).book)
    task = asyncio.create_task(slow.run_pass())
    await asyncio.wait_for(engine.entered.wait(), 5)
    other = market_worker(svc, book=worker(svc).book)
    for _ in range(6):  # 6 minutes of a long call, heartbeats every 40 s
        clock.advance(40)
        await eventually(  # the heartbeat pushed the lease out again
            lambda: item_rows(svc, bid)[0].lease_until > clock.now() + timedelta(seconds=80)
        )
        await other.run_pass()
        assert item_rows(svc, bid)[0].status == "dispatched"
    engine.release.set()
    await asyncio.wait_for(task, 5)
    assert item_rows(svc, bid)[0].status == "succeeded"
