"""Revoking a key stops everything it started that was not sent yet.

A run the key confirmed stops (``canceled``, ``error.code`` ``key_revoked``):
the calls in flight land and are charged, nothing more is sent. A run it
created and did not confirm is canceled at once. Another key's run is left
alone. Its deferred batch, every item still waiting, reads ``canceled``.
"""

from __future__ import annotations

import asyncio

from batchyard.app import run_worker
from batchyard.core.accounts import Scope
from batchyard.store import accounts
from tests.support.accounts import add_key, make_account
from tests.support.deferred_batches import batch_body, submit, worker
from tests.support.runs import Api, GatedEngine, fast_runs
from tests.support.server import asgi_client

ROWS = [{"text": f"row {i}"} for i in range(10)]
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}


def revoke(svc, key_id: str) -> None:
    now = svc.clock.now()
    svc.db.transact_sync(lambda c: accounts.revoke_key(c, key_id, now))


async def test_revoking_a_key_stops_its_runs_and_cancels_its_batches(make_service):
    svc = make_service(runs=fast_runs())
    engine = GatedEngine(open_first=2)  # two rows answered, then calls wait in flight
    svc.engines.set("embedded", engine)
    owner = make_account(svc, credit="5")
    starter = add_key(svc, "acme", Scope.FULL)
    async with asgi_client(svc, worker=False) as http:
        mine = await Api(http, starter.headers).start()
        theirs = Api(http, owner.headers)
        theirs.project = mine.project
        ds = await mine.upload(ROWS)
        running = (await mine.create({**RUN, "datasetId": ds["id"]})).json()["id"]
        unconfirmed = (await mine.create({**RUN, "datasetId": ds["id"]})).json()["id"]
        kept = (await theirs.create({**RUN, "datasetId": ds["id"]}, key="theirs")).json()["id"]
        batch = (await submit(http, starter.headers, batch_body(3))).json()["id"]
        await run_worker(svc).run_until_idle()  # every run is quoted
        assert (await mine.post(running, "confirm")).json()["status"] == "queued"

        loop_worker = run_worker(svc, owner="w")
        task = asyncio.create_task(loop_worker.run_forever())
        try:
            while len(engine.prompts) < 4:  # two answered, two in flight
                await asyncio.sleep(0.01)
            revoke(svc, starter.key_id)
            refused = await http.get(f"{mine.runs}/{running}", headers=starter.headers)
            stopped = await theirs.wait(unconfirmed, "canceled")
            engine.gate.set()  # the calls in flight land
            final = await theirs.wait(running, "canceled")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        other = await theirs.get(kept)
        await worker(svc).run_pass()  # the market's housekeeping sees the revoked key
        view = (await http.get(f"/v1/batches/{batch}", headers=owner.headers)).json()

    assert refused.status_code == 401
    assert final["error"]["code"] == "key_revoked"
    assert final["results"]["rowsSucceeded"] == 4  # what was sent landed and is charged
    assert final["results"]["rowsCanceled"] == len(ROWS) - 4
    assert final["results"]["rowsUncertain"] == 0
    assert len(engine.prompts) == 4  # nothing was sent after the revocation
    assert final["charge"] not in (None, "0")
    assert stopped["error"]["code"] == "key_revoked" and stopped["charge"] is None
    assert other["status"] == "awaiting_confirmation"  # another key's run goes on
    assert view["status"] == "canceled"
    assert {r["status"] for r in view["requests"]} == {"canceled"}
    assert {r.get("reason") for r in view["requests"]} == {"key_revoked"}
