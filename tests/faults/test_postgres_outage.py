"""PostgreSQL stopped and started during a run: 503 while it is down, then the run finishes whole.

A real ``batchyard serve`` (API only) and a real ``batchyard worker`` share a
PostgreSQL cluster of the test's own (the shared one on 5432 is never
touched). The run's route calls a fake upstream that answers a few rows and
then holds the next calls open. With two calls in flight the database is
stopped (a fast shutdown: every connection is cut). While it is down the API
answers 503 ``storage_unavailable`` with ``retryable: true`` (not a 500, no
traceback in its log); the held calls are answered, so the worker has results
to record and nowhere to record them. Then the database starts again: the
worker reconnects by itself (``pool_pre_ping`` and its short retries), records
what it holds, answers the rest and settles. Nothing is half-written: each
row was sent once and answered once, the run was charged once, and the
ledger audit (run by ``make_service`` at the end) is clean.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
from sqlalchemy import select

from batchyard.store import activity, ledger
from batchyard.store.tables import ledger_entries
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.private_servers import PrivatePostgres
from tests.support.processes import Workers, deployment
from tests.support.runs import Api
from tests.support.server import free_port
from tests.support.services import ServiceFactory
from tests.support.waits import HANG_S

ROWS = [{"text": f"row {i}"} for i in range(16)]
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
ANSWERED_FIRST = 4
CONCURRENCY = 2
# A lease longer than the outage: the worker keeps its run across it.
RUNS = {"lease_s": 30, "heartbeat_s": 0.1, "poll_s": 0.05, "flush_s": 0.05}


async def test_postgres_restarted_mid_run_answers_503_then_the_run_finishes_whole(
    tmp_path: Path,
    private_pg: PrivatePostgres,
    private_pg_url: str,
    workers: Workers,
    make_service: ServiceFactory,
) -> None:
    url = private_pg_url
    with FakeUpstream() as up:
        up.hold(after=ANSWERED_FIRST)
        async with deployment(
            make_service,
            tmp_path,
            url,
            upstream=up,
            runs=RUNS,
            route={"concurrency": CONCURRENCY},
        ) as dep:
            svc = dep.service  # migrates the private database; audits its ledger at the end
            acct = make_account(svc, credit="5")
            port = free_port()
            server = workers.start(
                config=dep.config,
                database_url=url,
                name="serve",
                command="serve",
                args=("--port", str(port), "--no-worker"),
            )
            worker = workers.start(config=dep.config, database_url=url, name="worker")
            base = f"http://127.0.0.1:{port}"

            async def ready() -> bool:
                try:
                    async with httpx.AsyncClient(base_url=base) as c:
                        return (await c.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await workers.until(ready, "serve answers")
            async with httpx.AsyncClient(base_url=base, timeout=HANG_S) as http:
                api = await Api(http, acct.headers).start()
                run_id, dataset_id = await api.confirmed(ROWS, RUN)

                async def in_flight() -> bool:
                    cur = await api.get(run_id)
                    return (cur["progress"] or {}).get(
                        "rowsDone"
                    ) == ANSWERED_FIRST and up.held == CONCURRENCY

                await workers.until(in_flight, "four rows answered, two calls in flight")

                private_pg.stop()
                down = await http.get(f"{api.runs}/{run_id}", headers=acct.headers)
                not_ready = await http.get("/readyz")
                alive = await http.get("/healthz")
                created = await api.create({**RUN, "datasetId": dataset_id}, key="while-down")
                up.release()  # the worker now holds answers it cannot record yet
                await workers.until(
                    lambda: len(up.answered) == ANSWERED_FIRST + CONCURRENCY,
                    "the held calls are answered",
                )
                private_pg.start()

                await workers.until(
                    lambda: api.status_in(run_id, "completed"),
                    "the worker reconnects and ends the run",
                )
                final = await api.get(run_id)
                rows = await api.rows(dataset_id)
                # The request refused while the store was down runs once when sent again.
                again = await api.create({**RUN, "datasetId": dataset_id}, key="while-down")
            assert worker.terminate() == 0 and server.terminate() in (0, -15)

    for answer in (down, created):
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["retryable"]) == ("storage_unavailable", True)
    assert again.status_code == 201, again.text
    assert (not_ready.status_code, alive.status_code) == (503, 200)
    for proc in (server, worker):  # an outage is reported, not crashed through
        assert "Traceback" not in proc.output() and "unhandled error" not in proc.output()
    assert "store unavailable" in worker.output()

    sent = Counter(up.arrived)
    assert len(sent) == len(ROWS) and max(sent.values()) == 1
    res = final["results"]
    assert (res["rowsSucceeded"], res["rowsUncertain"], res["rowsFailed"]) == (len(ROWS), 0, 0)
    answers = {r["data"]["text"]: r["data"].get("answer") for r in rows}
    assert answers == {t: f"echo: {t}" for t in answers} and len(answers) == len(ROWS)

    def money(c: object) -> tuple[list[str], list[str], ledger.Balance]:
        kinds = [
            k
            for (k,) in c.execute(  # type: ignore[attr-defined]
                select(ledger_entries.c.kind)
                .where(ledger_entries.c.org_id == acct.org_id, ledger_entries.c.kind != "topup")
                .order_by(ledger_entries.c.id)
            )
        ]
        acts = [
            a["kind"]
            for a in activity.list_activity(c, acct.org_id)  # type: ignore[arg-type]
            if a["ref"] == run_id
        ]
        return kinds, acts, ledger.balance(c, acct.org_id)  # type: ignore[arg-type]

    kinds, acts, bal = svc.db.read_sync(money)
    # The run: one reservation settled once (the second run, created after, is only quoted).
    assert kinds == ["reserve", "settle", "release"]
    assert acts == ["charge"]
    assert bal.held == 0
