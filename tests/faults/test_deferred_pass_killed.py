"""A worker SIGKILLed during a deferred pass: only the call that started is uncertain.

A real ``batchyard worker`` process claims a whole pass of deferred items, but
its route takes one call at a time, so one item's call reaches the upstream
(which holds it open) while the rest wait their turn behind it. The worker is
killed with SIGKILL. When their leases lapse, another worker finds: the item
whose call was sent becomes ``uncertain``, never sent again and charged
nothing (its hold released, explained in the activity log: the one rule for an
uncertain item on every door, docs/explanation/ledger.md); every item that
never reached the upstream goes back to waiting with its hold released, and is
then dispatched and answered once. ``batchyard audit`` is clean at once: no
hold is left for an operator to resolve by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

from batchyard.app import deferred_batch_worker
from batchyard.store import activity, holds, ledger
from tests.support.accounts import make_account
from tests.support.deferred_batches import chat, item_rows, submit
from tests.support.fake_upstream import FakeUpstream
from tests.support.processes import Workers, deployment
from tests.support.services import ServiceFactory
from tests.support.waits import HANG_S

TEXTS = [f"Summarize public release note number {i}." for i in range(6)]
BATCHYARD = str(Path(sys.executable).with_name("batchyard"))


def batchyard(config: Path, database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHYARD_")}
    env.update(BATCHYARD_CONFIG=str(config), BATCHYARD_DATABASE_URL=database_url)
    return subprocess.run(
        [BATCHYARD, *args], env=env, capture_output=True, text=True, timeout=HANG_S, check=False
    )


async def test_killed_mid_pass_only_the_started_call_is_uncertain(
    tmp_path: Path, database_url: str, workers: Workers, make_service: ServiceFactory
) -> None:
    body = {
        "min_discount": 90,
        "requests": [{"custom_id": f"req-{i}", "body": chat(t)} for i, t in enumerate(TEXTS)],
    }
    with FakeUpstream() as up:
        up.hold(after=0)  # every call that arrives stays in flight
        async with deployment(
            make_service, tmp_path, database_url, upstream=up, route={"concurrency": 1}
        ) as dep:
            svc, http = dep.service, dep.http
            doomed = workers.start(config=dep.config, database_url=database_url)
            acct = make_account(svc, credit="1")
            submitted = await submit(http, acct.headers, body)
            assert submitted.status_code == 201, submitted.text
            bid = submitted.json()["id"]

            def stuck() -> bool:
                items = item_rows(svc, bid)
                return (
                    up.held == 1
                    and len(up.arrived) == 1
                    and all(i.status == "dispatched" for i in items)
                )

            await workers.until(stuck, "the pass claimed every item and one call is in flight")
            before = {i.custom_id: i for i in item_rows(svc, bid)}
            held_before = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id)).held
            assert held_before > 0 and all(i.reservation_id for i in before.values())
            (started,) = [cid for cid, i in before.items() if i.sent_at is not None]
            assert up.arrived == [TEXTS[int(started.removeprefix("req-"))]]

            assert doomed.kill() == -9
            await workers.until(lambda: up.abandoned == 1, "the upstream sees the caller go")
            up.release()  # from now on the upstream answers at once

            # Before the leases lapse another worker changes nothing.
            survivor = deferred_batch_worker(svc)
            leases = [i.lease_expires_at for i in before.values()]
            dep.clock.set(min(leases) - timedelta(milliseconds=1))
            early = await survivor.run_pass()
            assert (early.uncertain, early.returned, early.dispatched) == (0, 0, 0)

            # After: the started call is uncertain, the others wait again and then run.
            dep.clock.set(max(leases) + timedelta(seconds=1))
            report = await survivor.run_pass()
            assert (report.uncertain, report.returned) == (1, len(TEXTS) - 1)
            assert report.succeeded == len(TEXTS) - 1

            after = {i.custom_id: i for i in item_rows(svc, bid)}
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
            acts = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))
            lines = (await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)).content
            batch = (await http.get(f"/v1/batches/{bid}", headers=acct.headers)).json()
            stranded = svc.db.read_sync(lambda c: holds.stranded(c, dep.clock.now()))

            # The operator's view: nothing stranded, the ledger sound, no hand work.
            audit = batchyard(dep.config, database_url, "audit")
            res_id = before[started].reservation_id
            assert audit.returncode == 0, audit.stderr
            assert "no stranded holds" in " ".join(audit.stderr.split())
            final = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))

    sent = Counter(up.arrived)
    assert sorted(sent) == sorted(TEXTS) and max(sent.values()) == 1, sent
    assert after[started].status == "uncertain"
    assert after[started].reservation_id == res_id
    for cid, item in after.items():
        if cid != started:
            assert item.status == "succeeded", (cid, item.status)
            assert item.reservation_id != before[cid].reservation_id  # a new hold, after waiting
    # Every first hold was released: the unsent ones to wait again, the uncertain one for good.
    held = svc.db.read_sync(lambda c: ledger.get_reservation(c, res_id))
    assert (held.state, held.charged) == ("released", 0)
    assert bal.held == 0
    released_first = {
        a["reservation_id"]
        for a in acts
        if a["kind"] == "release" and (a["detail"] or {}).get("reason") == "not_sent"
    }
    assert released_first == {i.reservation_id for c, i in before.items() if c != started}
    released_uncertain = [
        a["reservation_id"]
        for a in acts
        if a["kind"] == "release" and (a["detail"] or {}).get("reason") == "uncertain"
    ]
    assert released_uncertain == [res_id]
    uncertain = [a for a in acts if a["kind"] == "uncertain"]
    assert [a["reservation_id"] for a in uncertain] == [res_id]
    assert "not charged" in uncertain[0]["detail"]["action"]
    assert stranded == []
    assert final.held == 0
    statuses = {r["custom_id"]: r["status"] for r in batch["requests"]}
    assert statuses[started] == "uncertain"
    results = {r["custom_id"]: r for r in map(json.loads, lines.splitlines())}
    assert results[started]["result"] is None
    assert all(
        results[c]["result"]["body"]["choices"][0]["message"]["content"]
        == f"echo: {TEXTS[int(c.removeprefix('req-'))]}"
        for c in results
        if c != started
    )
