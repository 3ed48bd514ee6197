"""A worker dies mid-run: every row is answered once and charged once.

Rows whose call was in flight when the worker died are ``uncertain``: they may
have been answered upstream, so the worker that takes over never re-sends
them. The ledger still balances, with one reservation settled once.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from sqlalchemy import select

from batchyard.app import build_service, run_worker
from batchyard.store import activity, ledger
from batchyard.store.tables import ledger_entries
from tests.support.accounts import make_account
from tests.support.runs import Api, GatedEngine, with_runs
from tests.support.server import live_server

ROWS = [{"text": f"row {i}"} for i in range(30)]
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
LEASE = 30


@pytest.fixture
async def svc(settings, clock):
    s = build_service(with_runs(settings, lease_s=LEASE), clock=clock)
    s.db.migrate()
    yield s
    problems = s.db.read_sync(ledger.audit)
    await s.stop()
    assert problems == [], problems


async def _until(predicate, timeout: float = 10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("cancel_after_crash", [False, True])
async def test_a_killed_worker_leaves_uncertain_rows_and_no_double_charge(svc, cancel_after_crash):
    acct = make_account(svc, credit="5")
    dead = GatedEngine(open_first=5)  # answers 5 rows, then hangs mid-call until killed
    svc.engines.set("embedded", dead)
    async with live_server(svc, worker=False) as base, httpx.AsyncClient(base_url=base) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(ROWS)
        run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
        first = run_worker(svc, owner="worker-a")
        await first.run_until_idle()
        await api.wait(run["id"], "awaiting_confirmation")
        await api.post(run["id"], "confirm")

        crashed = asyncio.create_task(first.run_forever())

        async def stuck():
            cur = await api.get(run["id"])
            return (
                cur["status"] == "running"
                and cur["progress"]["rowsDone"] == 5
                and len(dead.prompts) == 7
            )

        await _until(stuck)
        crashed.cancel()  # the worker dies with two calls in flight
        with pytest.raises(asyncio.CancelledError):
            await crashed
        in_flight = dead.prompts[5:]

        live = GatedEngine()
        live.gate.set()
        svc.engines.set("embedded", live)
        second = run_worker(svc, owner="worker-b")
        await second.run_until_idle()
        held = await api.get(run["id"])
        assert held["status"] == "running" and live.prompts == []  # the lease still holds
        if cancel_after_crash:
            assert (await api.post(run["id"], "cancel")).json()["status"] == "stopping"

        svc.clock.advance(LEASE + 1)
        await second.run_until_idle()
        final = await api.get(run["id"])
        failures = (await http.get(f"{api.runs}/{run['id']}/failures", headers=acct.headers)).json()
        rows = await api.rows(ds["id"])

    sent = Counter(dead.prompts + live.prompts)
    assert max(sent.values()) == 1, "a row was sent twice"
    assert [f["state"] for f in failures["data"]] == ["uncertain", "uncertain"]
    assert failures["data"][0]["error"]["code"] == "uncertain"
    uncertain_ids = {f["rowId"] for f in failures["data"]}
    assert {ROWS[i - 1]["text"] for i in uncertain_ids} == set(in_flight)
    res = final["results"]
    assert res["rowsUncertain"] == 2
    if cancel_after_crash:
        assert final["status"] == "canceled"
        assert live.prompts == [] and res["rowsSucceeded"] == 5 and res["rowsCanceled"] == 23
    else:
        assert final["status"] == "completed"
        assert res["rowsSucceeded"] == 28 and len(live.prompts) == 23
    answered = {r["id"] for r in rows if "answer" in r["data"]}
    assert answered.isdisjoint(uncertain_ids) and len(answered) == res["rowsSucceeded"]

    # One reservation, settled once, for the answered rows only.
    entries = svc.db.transact_sync(
        lambda c: c.execute(
            select(ledger_entries.c.kind, ledger_entries.c.amount).where(
                ledger_entries.c.org_id == acct.org_id, ledger_entries.c.kind != "topup"
            )
        ).all()
    )
    assert [k for k, _ in entries] == ["reserve", "settle", "release"]
    acts = svc.db.transact_sync(lambda c: activity.list_activity(c, acct.org_id))
    kinds = Counter(a["kind"] for a in acts if a["ref"] == run["id"])
    assert kinds == {"uncertain": 1, "charge": 1}
    bal = svc.db.transact_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0 and bal.settled == dict(entries)["settle"]
