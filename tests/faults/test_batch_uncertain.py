"""A worker killed mid-call: the item ends ``uncertain``, never retried, charged nothing.

Nothing is retried, because the provider may have run the call; and, as for an
uncertain file-batch line or run row (one rule on every door, see
docs/explanation/ledger.md), nothing is charged for an answer nobody received:
the hold is released, and GET /v1/activity shows the uncertain item with the
amount so the owner can check before resubmitting. ``batchyard audit`` is clean.

The deferred pass runs on a real ``batchyard worker`` process, killed with
SIGKILL while its calls are held open by a fake upstream on loopback: no
``finally`` block or cancellation handler of the worker runs. The test's own
deferred-batch worker then takes over, its clock moved to each side of the dead
worker's leases.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from batchyard.app import deferred_batch_worker
from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.deferred_batches import (
    BlockingEngine,
    batch_body,
    chat,
    eventually,
    feed_route,
    item_rows,
    set_price,
    submit,
    worker,
)
from tests.support.fake_upstream import FakeUpstream
from tests.support.processes import Workers, deployment
from tests.support.server import asgi_client
from tests.support.services import ServiceFactory
from tests.support.waits import HANG_S, settles

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))
TEXTS = [f"Summarize public release note number {i}." for i in range(4)]
ANSWERED_FIRST = 1  # the upstream answers one call, then holds the others open


async def test_killed_mid_call_becomes_uncertain_and_releases_its_hold(
    tmp_path: Path, database_url: str, workers: Workers, make_service: ServiceFactory
) -> None:
    body = {
        "min_discount": 90,
        "requests": [{"custom_id": f"req-{i}", "body": chat(t)} for i, t in enumerate(TEXTS)],
    }
    with FakeUpstream() as up:
        up.hold(after=ANSWERED_FIRST)
        async with deployment(make_service, tmp_path, database_url, upstream=up) as dep:
            svc, http = dep.service, dep.http
            acct = make_account(svc, credit="1")
            submitted = await submit(http, acct.headers, body)
            assert submitted.status_code == 201, submitted.text
            bid = submitted.json()["id"]

            # The worker's first pass dispatches all four items at once.
            doomed = workers.start(config=dep.config, database_url=database_url)

            def stuck() -> bool:
                states = [i.status for i in item_rows(svc, bid)]
                return (
                    len(up.arrived) == len(TEXTS)
                    and up.held == len(TEXTS) - ANSWERED_FIRST
                    and states.count("succeeded") == ANSWERED_FIRST
                )

            await workers.until(stuck, "one item is answered and three calls are in flight")
            before = {i.custom_id: i for i in item_rows(svc, bid)}
            assert doomed.kill() == -9  # the worker dies while three calls are in flight
            await workers.until(
                lambda: up.abandoned == len(TEXTS) - ANSWERED_FIRST,
                "the upstream sees the callers hang up",
            )
            # Judged by what the upstream really received: these calls started
            # and were never answered, so their outcome is unknown.
            in_flight = {f"req-{TEXTS.index(t)}" for t in set(up.arrived) - set(up.answered)}
            assert len(in_flight) == len(TEXTS) - ANSWERED_FIRST
            up.release()
            for cid in in_flight:
                assert before[cid].status == "dispatched" and before[cid].reservation_id
            leases = [before[cid].lease_expires_at for cid in in_flight]

            # Another worker, before the leases lapse: the items are not touched.
            survivor = deferred_batch_worker(svc)
            dep.clock.set(min(leases) - timedelta(milliseconds=1))
            assert (await survivor.run_pass()).uncertain == 0
            after = {i.custom_id: i for i in item_rows(svc, bid)}
            assert {after[cid].status for cid in in_flight} == {"dispatched"}

            dep.clock.set(max(leases) + timedelta(seconds=1))
            report = await survivor.run_pass()
            assert report.uncertain == len(in_flight)

            after = {i.custom_id: i for i in item_rows(svc, bid)}
            held = {
                cid: svc.db.read_sync(
                    lambda c, cid=cid: ledger.get_reservation(c, before[cid].reservation_id)
                )
                for cid in in_flight
            }
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
            activity = (await http.get("/v1/activity", headers=acct.headers)).json()["data"]
            batch = (await http.get(f"/v1/batches/{bid}", headers=acct.headers)).json()
            lines = (await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)).content

            # More passes later: still no retry.
            sent = up.arrived
            dep.clock.advance(3600)
            await survivor.run_pass()
            assert up.arrived == sent
            audit = subprocess.run(
                [BATCHYARD, "audit", "--config", str(dep.config), "--database", database_url],
                capture_output=True,
                text=True,
                timeout=HANG_S,
                env={"PATH": "/usr/bin:/bin", "BATCHYARD_HOME": str(tmp_path / "audit-home")},
                check=False,
            )

    assert sorted(sent) == sorted(TEXTS), "an item was sent twice"
    (answered,) = set(before) - in_flight
    assert after[answered].status == "succeeded"
    for cid in in_flight:
        assert after[cid].status == "uncertain"
        assert after[cid].reservation_id == before[cid].reservation_id
        assert (held[cid].state, held[cid].charged) == ("released", 0) and held[cid].amount > 0
    assert bal.held == 0
    # The operator's audit agrees: no stranded hold after the SIGKILL (it once found three).
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "no stranded holds" in " ".join(audit.stderr.split())

    for cid in in_flight:
        rid = before[cid].reservation_id
        mine = {a["kind"]: a for a in activity if a["reservation_id"] == rid}
        assert set(mine) == {"dispatch", "uncertain", "release"}
        assert mine["uncertain"]["ref"] == before[cid].id
        assert mine["release"]["detail"]["reason"] == "uncertain"
    assert batch["status"] == "completed"
    statuses = {r["custom_id"]: r for r in batch["requests"]}
    assert statuses[answered]["status"] == "succeeded"
    for cid in in_flight:
        assert statuses[cid] == {"custom_id": cid, "status": "uncertain", "reason": "interrupted"}
    results = {r["custom_id"]: r for r in map(json.loads, lines.splitlines())}
    assert results[answered]["status"] == "succeeded"
    answer = results[answered]["result"]["body"]["choices"][0]["message"]["content"]
    assert answer == f"echo: {TEXTS[int(answered.removeprefix('req-'))]}"
    for cid in in_flight:
        assert results[cid] == {
            "custom_id": cid,
            "status": "uncertain",
            "result": None,
            "reservation_id": before[cid].reservation_id,
        }


async def test_a_worker_that_keeps_its_lease_alive_is_not_declared_uncertain(market, clock):
    svc = market(feed_route("spot"))
    engine = BlockingEngine("slow but fine")
    svc.engines.set("spot", engine)
    acct = make_account(svc, credit="1")
    async with asgi_client(svc, worker=False) as http:
        bid = (await submit(http, acct.headers, batch_body(1))).json()["id"]
    set_price(svc, "spot", "0.008", "0.03")
    slow = deferred_batch_worker(svc, lease_s=120, book=worker(svc).book)
    task = asyncio.create_task(slow.run_pass())
    await settles(engine.entered.wait(), "the slow call is in the engine")
    other = deferred_batch_worker(svc, book=worker(svc).book)
    for _ in range(6):  # 6 minutes of a long call, heartbeats every 40 s
        clock.advance(40)
        await eventually(  # the heartbeat pushed the lease out again
            lambda: item_rows(svc, bid)[0].lease_expires_at > clock.now() + timedelta(seconds=80)
        )
        await other.run_pass()
        assert item_rows(svc, bid)[0].status == "dispatched"
    engine.release.set()
    await settles(task, "the slow pass ends")
    assert item_rows(svc, bid)[0].status == "succeeded"
