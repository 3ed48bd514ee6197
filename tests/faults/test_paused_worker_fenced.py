"""A worker paused past its lease (SIGSTOP, SIGCONT) writes nothing for the run another now owns.

Two real ``batchyard worker`` processes on PostgreSQL, a route to a fake
upstream over loopback that answers a few rows and then holds the next calls
open. Worker A claims the run and has two calls in flight when it is frozen
with SIGSTOP (a long GC pause, a frozen VM). Its lease lapses; the upstream
answers A's two calls into A's socket buffers while A is stopped; worker B
starts, claims the run (its fencing token is one more than A's), makes A's
sent rows ``uncertain``, answers the rest and settles the run. Then A is
woken with SIGCONT: it reads its two answers and tries to record them with
its old token. The fence turns every write away: the run, its rows, the
ledger and the activity are exactly as B left them, A says it lost the
lease, each row was sent once and the run was charged once.

Worker processes read the real clock, so the lease in the config is short
(1.5 s); every wait is a bounded poll on a condition, never a sleep.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from batchyard.service import Service
from batchyard.store import activity, ledger
from batchyard.store.runs import run_items, runs
from batchyard.store.tables import ledger_entries
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.processes import Workers, deployment
from tests.support.runs import Api
from tests.support.services import ServiceFactory

pytestmark = pytest.mark.postgres

ROWS = [{"text": f"row {i}"} for i in range(20)]
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
ANSWERED_FIRST = 4
CONCURRENCY = 2
LEASE_S = 1.5


def _snapshot(svc: Service, run_id: str, org_id: str) -> dict[str, Any]:
    """Everything a lease holder of the run could write: the run, its rows, money, activity."""

    def read(c: Any) -> dict[str, Any]:
        run = c.execute(select(runs).where(runs.c.id == run_id)).one()._mapping
        items = c.execute(
            select(run_items).where(run_items.c.run_id == run_id).order_by(run_items.c.row_id)
        ).all()
        entries = c.execute(
            select(ledger_entries.c.kind, ledger_entries.c.amount)
            .where(ledger_entries.c.org_id == org_id, ledger_entries.c.kind != "topup")
            .order_by(ledger_entries.c.id)
        ).all()
        return {
            "run": dict(run),
            "items": [tuple(r) for r in items],
            "entries": [tuple(e) for e in entries],
            "activity": activity.list_activity(c, org_id),
            "balance": ledger.balance(c, org_id),
        }

    return svc.db.read_sync(read)


async def test_a_worker_paused_past_its_lease_writes_nothing_for_the_run_another_took(
    tmp_path: Path, pg_url: str, workers: Workers, make_service: ServiceFactory
) -> None:
    with FakeUpstream() as up:
        up.hold(after=ANSWERED_FIRST)
        async with deployment(
            make_service,
            tmp_path,
            pg_url,
            upstream=up,
            runs={"lease_s": LEASE_S, "heartbeat_s": 0.1, "poll_s": 0.05, "flush_s": 0.05},
            route={"concurrency": CONCURRENCY},
        ) as dep:
            svc, http = dep.service, dep.http
            a = workers.start(config=dep.config, database_url=pg_url, name="worker-a")
            acct = make_account(svc, credit="5")
            api = await Api(http, acct.headers).start()
            run_id, dataset_id = await api.confirmed(ROWS, RUN)

            async def in_flight() -> bool:
                cur = await api.get(run_id)
                return (cur["progress"] or {}).get(
                    "rowsDone"
                ) == ANSWERED_FIRST and up.held == CONCURRENCY

            await workers.until(in_flight, "A answered four rows and has two calls in flight")
            token_a = svc.db.read_sync(
                lambda c: c.execute(
                    select(runs.c.lease_token).where(runs.c.id == run_id)
                ).scalar_one()
            )
            a.pause()
            # A's two calls are answered into its socket buffers while it is frozen.
            up.release()
            await workers.until(
                lambda: len(up.answered) == ANSWERED_FIRST + CONCURRENCY,
                "the upstream answers A's two calls",
            )
            sent_by_a = list(up.arrived)
            b = workers.start(config=dep.config, database_url=pg_url, name="worker-b")
            ended = "B takes the run over and ends it"
            await workers.until(lambda: api.status_in(run_id, "completed"), ended)
            before = _snapshot(svc, run_id, acct.org_id)
            assert before["run"]["lease_token"] > token_a
            assert before["run"]["lease_owner"] is None  # B ended the run and let go

            a.resume()
            await workers.until(
                lambda: "run lease lost" in a.output(), "A wakes, reads its answers, is fenced"
            )
            after = _snapshot(svc, run_id, acct.org_id)
            assert a.alive and b.alive
            assert a.terminate() == 0 and b.terminate() == 0
            final = await api.get(run_id)
            rows = await api.rows(dataset_id)

    # A's resumed writes changed nothing at all: run, rows, ledger, activity.
    assert after == before
    sent = Counter(up.arrived)
    assert max(sent.values()) == 1, f"a row was sent twice: {sent.most_common(3)}"
    assert len(sent) == len(ROWS)
    in_flight_a = set(sent_by_a[ANSWERED_FIRST:])
    res = final["results"]
    assert (res["rowsSucceeded"], res["rowsUncertain"]) == (len(ROWS) - CONCURRENCY, CONCURRENCY)
    answers = {r["data"]["text"]: r["data"].get("answer") for r in rows}
    # A's two answered-but-fenced rows have no output; every other row has its own.
    assert {t for t, ans in answers.items() if ans is None} == in_flight_a
    assert all(ans == f"echo: {t}" for t, ans in answers.items() if ans is not None)
    # Charged once: one reservation, settled once, one charge in the activity.
    assert [k for k, _ in after["entries"]] == ["reserve", "settle", "release"]
    kinds = Counter(x["kind"] for x in after["activity"] if x["ref"] == run_id)
    assert kinds == {"uncertain": 1, "charge": 1}
    assert after["balance"].held == 0
    assert after["balance"].settled == dict(after["entries"])["settle"]
