"""A worker process SIGKILLed mid-run: every row is answered once and charged once.

The run executes on a real ``batchyard worker`` process whose route calls a
fake upstream over loopback. The upstream answers five rows, then holds the
next calls open; once two calls are in flight the worker is killed with
SIGKILL, so no ``finally`` block or cancellation handler runs. A second
worker process (or, for a run canceled after the crash, the test's own
worker) takes the run over when the dead one's lease lapses. Rows
whose calls reached the upstream but were never answered become
``uncertain`` and are never re-sent (the upstream counts every call per
row); every other row is answered once, and the ledger balances with one
reservation settled once.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from batchyard.app import run_worker
from batchyard.service import Service
from batchyard.store import activity, ledger
from batchyard.store.runs import runs
from batchyard.store.tables import ledger_entries
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.processes import Workers, deployment
from tests.support.runs import Api
from tests.support.services import ServiceFactory

ROWS = [{"text": f"row {i}"} for i in range(30)]
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
ANSWERED_FIRST = 5  # the upstream answers these rows, then holds every call open
CONCURRENCY = 2  # so the killed worker has exactly two calls in flight
# Real seconds: the worker processes read the system clock. Short, so the
# takeover comes quickly; heartbeats every 0.1 s keep a live worker's lease.
LEASE_S = 1.5


# Each worker process costs a start-up of a second or more, so the run that is
# canceled after the crash is taken over by the test's own worker (its clock
# moved past the lease); the others by a second worker process.
@pytest.mark.parametrize(
    ("database_url", "cancel_after_crash"),
    [
        ("sqlite", False),
        pytest.param("postgres", False, marks=pytest.mark.postgres),
        ("sqlite", True),
    ],
    indirect=["database_url"],
)
async def test_a_killed_worker_leaves_uncertain_rows_and_no_double_charge(
    tmp_path: Path,
    database_url: str,
    workers: Workers,
    make_service: ServiceFactory,
    cancel_after_crash: bool,
) -> None:
    with FakeUpstream() as up:
        up.hold(after=ANSWERED_FIRST)
        async with deployment(
            make_service,
            tmp_path,
            database_url,
            upstream=up,
            runs={"lease_s": LEASE_S, "heartbeat_s": 0.1, "poll_s": 0.05, "flush_s": 0.05},
            route={"concurrency": CONCURRENCY},
        ) as dep:
            svc, http = dep.service, dep.http
            # Started first, so its start-up overlaps the test's own set-up.
            first = workers.start(config=dep.config, database_url=database_url, name="worker-a")
            acct = make_account(svc, credit="5")
            api = await Api(http, acct.headers).start()
            ds = await api.upload(ROWS)
            run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
            run_id = run["id"]

            async def status_is(*statuses: str) -> bool:
                return (await api.get(run_id))["status"] in statuses

            await workers.until(lambda: status_is("awaiting_confirmation"), "the run is quoted")
            assert (await api.post(run_id, "confirm")).status_code == 200

            async def stuck() -> bool:
                cur = await api.get(run_id)
                return (
                    (cur["progress"] or {}).get("rowsDone") == ANSWERED_FIRST
                    and up.held == CONCURRENCY
                    and len(up.arrived) == ANSWERED_FIRST + CONCURRENCY
                )

            await workers.until(stuck, "five rows are answered and two calls are in flight")
            assert first.kill() == -9  # SIGKILL with two calls in flight
            await workers.until(
                lambda: up.abandoned == CONCURRENCY, "the upstream sees both callers hang up"
            )
            sent_by_first = up.arrived
            in_flight = set(sent_by_first) - set(up.answered)
            assert len(in_flight) == CONCURRENCY
            up.release()

            # One instant before the dead worker's lease lapses, another worker
            # takes nothing over and sends nothing.
            lease_end = svc.db.read_sync(
                lambda c: c.execute(
                    select(runs.c.lease_expires_at).where(runs.c.id == run_id)
                ).scalar_one()
            )
            dep.clock.set(lease_end - timedelta(milliseconds=1))
            await run_worker(svc, owner="too-early").run_until_idle()
            held = await api.get(run_id)
            assert held["status"] == "running" and held["progress"]["rowsUncertain"] == 0
            assert up.arrived == sent_by_first
            if cancel_after_crash:
                assert (await api.post(run_id, "cancel")).json()["status"] == "stopping"
                # The test's own worker takes over, a moment after the lease lapsed.
                dep.clock.set(lease_end + timedelta(seconds=1))
                await run_worker(svc, owner="survivor").run_until_idle()
                second = None
            else:
                # A second worker process takes the run over once the lease lapses.
                second = workers.start(
                    config=dep.config, database_url=database_url, name="worker-b"
                )
                await workers.running(second)
            await workers.until(
                lambda: status_is("completed", "canceled"), "the survivor ends the run"
            )
            if second is not None:
                assert second.terminate() == 0  # the survivor stops cleanly on SIGTERM
            final = await api.get(run_id)
            failures = await http.get(f"{api.runs}/{run_id}/failures", headers=acct.headers)
            rows = await api.rows(ds["id"])
            sent = Counter(up.arrived)
            entries = _ledger_entries(svc, acct.org_id)
            acts = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))

    assert max(sent.values()) == 1, f"a row was sent twice: {sent.most_common(3)}"
    failed = failures.json()["data"]
    assert [f["state"] for f in failed] == ["uncertain", "uncertain"]
    assert failed[0]["error"]["code"] == "uncertain"
    uncertain_ids = {f["rowId"] for f in failed}
    assert {ROWS[i - 1]["text"] for i in uncertain_ids} == in_flight
    res = final["results"]
    assert res["rowsUncertain"] == 2
    sent_by_second = len(sent) - len(sent_by_first)
    if cancel_after_crash:
        assert final["status"] == "canceled"
        assert sent_by_second == 0 and res["rowsSucceeded"] == 5 and res["rowsCanceled"] == 23
    else:
        assert final["status"] == "completed"
        assert res["rowsSucceeded"] == 28 and sent_by_second == 23
    answers = {r["id"]: r["data"].get("answer") for r in rows}
    answered = {i for i, a in answers.items() if a is not None}
    assert answered.isdisjoint(uncertain_ids) and len(answered) == res["rowsSucceeded"]
    # Every answer is the upstream's own, for its own row.
    assert all(answers[i] == f"echo: {ROWS[i - 1]['text']}" for i in answered)

    # One reservation, settled once, for the answered rows only.
    assert [k for k, _ in entries] == ["reserve", "settle", "release"]
    kinds = Counter(a["kind"] for a in acts if a["ref"] == run_id)
    assert kinds == {"uncertain": 1, "charge": 1}
    assert bal.held == 0 and bal.settled == dict(entries)["settle"]


def _ledger_entries(svc: Service, org_id: str) -> list[Any]:
    return svc.db.read_sync(
        lambda c: c.execute(
            select(ledger_entries.c.kind, ledger_entries.c.amount)
            .where(ledger_entries.c.org_id == org_id, ledger_entries.c.kind != "topup")
            .order_by(ledger_entries.c.id)
        ).all()
    )
