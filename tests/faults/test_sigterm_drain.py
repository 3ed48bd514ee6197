"""SIGTERM drains: calls in flight land, nothing else is sent, and nothing ends ``uncertain``.

Each kind of leased work drains through the one runner (``work.runner``):
deferred batches, batch inference runs and file batches, below.

Real ``batchyard worker`` and ``batchyard serve`` processes get SIGTERM while
a fake upstream holds their calls open; the upstream then lets the calls
finish within the grace period. What was sent is answered and charged once;
what was claimed but not yet sent goes back to waiting with its hold released
(the next worker takes it); the process exits 0. Only when the grace period
ends with a call still in flight does that call, and that call alone, become
``uncertain``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchyard.app import deferred_batch_worker, file_batch_worker, run_worker
from batchyard.service import Service
from batchyard.store import activity, ledger
from tests.support.accounts import make_account
from tests.support.deferred_batches import chat, item_rows, submit
from tests.support.fake_upstream import FakeUpstream
from tests.support.file_batches import chat_line, create, jsonl, lines_of, upload
from tests.support.processes import WorkerProcess, Workers, deployment
from tests.support.runs import Api
from tests.support.server import free_port
from tests.support.services import ServiceFactory
from tests.support.waits import HANG_S

TEXTS = [f"Summarize public release note number {i}." for i in range(4)]
ROWS = [{"text": f"row {i}"} for i in range(12)]
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
FAST_RUNS = {"lease_s": 30, "heartbeat_s": 0.1, "poll_s": 0.05, "flush_s": 0.05}
FAST_FILES = {"lease_s": 30, "poll_s": 0.05, "flush_s": 0.05}
LINES = [f"Summarize public release line {i}." for i in range(10)]


def sigterm(proc: WorkerProcess) -> None:
    """Send SIGTERM without waiting: the test has calls to release first."""
    proc.signalled = signal.SIGTERM
    os.kill(proc.pid, signal.SIGTERM)


async def exited(workers: Workers, proc: WorkerProcess) -> int:
    await workers.until(lambda: not proc.alive, f"{proc.name} exits")
    code = proc.returncode
    assert code is not None
    return code


#: A deployment's service and HTTP client, its one worker process, and a funded account.
Started = tuple[Service, httpx.AsyncClient, WorkerProcess, Any]


@pytest.fixture
def one_worker(
    tmp_path: Path, database_url: str, workers: Workers, make_service: ServiceFactory
) -> Callable[..., AbstractAsyncContextManager[Started]]:
    """A deployment over ``up`` with one real ``batchyard worker`` and a funded account."""

    @asynccontextmanager
    async def start(up: FakeUpstream, *, credit: str, **config: Any) -> AsyncIterator[Started]:
        async with deployment(make_service, tmp_path, database_url, upstream=up, **config) as dep:
            proc = workers.start(config=dep.config, database_url=database_url)
            yield dep.service, dep.http, proc, make_account(dep.service, credit=credit)

    return start


def batch(texts: list[str]) -> dict:
    return {
        "min_discount": 90,
        "requests": [{"custom_id": f"req-{i}", "body": chat(t)} for i, t in enumerate(texts)],
    }


async def test_a_worker_drains_a_deferred_pass_on_sigterm(
    workers: Workers, one_worker: Any
) -> None:
    with FakeUpstream() as up:
        up.hold(after=0)
        async with one_worker(up, credit="1", route={"concurrency": 1}) as (svc, http, proc, acct):
            bid = (await submit(http, acct.headers, batch(TEXTS))).json()["id"]

            def stuck() -> bool:
                items = item_rows(svc, bid)
                return up.held == 1 and all(i.status == "dispatched" for i in items)

            await workers.until(stuck, "every item is claimed and one call is in flight")
            (started,) = [i.custom_id for i in item_rows(svc, bid) if i.sent_at is not None]
            sigterm(proc)
            await workers.until(lambda: "draining" in proc.output(), "the worker drains")
            up.release()  # the call in flight lands within the grace period
            assert await exited(workers, proc) == 0
            drained = {i.custom_id: i for i in item_rows(svc, bid)}
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
            sent_by_worker = list(up.arrived)

            # The next worker takes what was never sent.
            report = await deferred_batch_worker(svc).run_pass()
            final = {i.custom_id: i for i in item_rows(svc, bid)}
            acts = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))

    assert drained[started].status == "succeeded"
    assert {c: i.status for c, i in drained.items() if c != started} == {
        c: "waiting" for c in drained if c != started
    }
    assert all(i.reservation_id is None for c, i in drained.items() if c != started)
    assert bal.held == 0
    assert sent_by_worker == [TEXTS[int(started.removeprefix("req-"))]]
    assert report.succeeded == len(TEXTS) - 1 and report.uncertain == 0
    assert {i.status for i in final.values()} == {"succeeded"}
    assert max(Counter(up.arrived).values()) == 1 and sorted(up.arrived) == sorted(TEXTS)
    assert not [a for a in acts if a["kind"] in ("uncertain", "hold_unresolved")]


async def test_a_worker_drains_a_run_on_sigterm(workers: Workers, one_worker: Any) -> None:
    with FakeUpstream() as up:
        up.hold(after=3)
        async with one_worker(up, credit="5", runs=FAST_RUNS, route={"concurrency": 2}) as (
            svc,
            http,
            proc,
            acct,
        ):
            api = await Api(http, acct.headers).start()
            ds = await api.upload(ROWS)
            run_id = (await api.create({**RUN, "datasetId": ds["id"]})).json()["id"]

            async def status_is(*statuses: str) -> bool:
                return (await api.get(run_id))["status"] in statuses

            await workers.until(lambda: status_is("awaiting_confirmation"), "the run is quoted")
            assert (await api.post(run_id, "confirm")).status_code == 200
            await workers.until(lambda: up.held == 2, "two calls are in flight")
            sigterm(proc)
            await workers.until(lambda: "draining" in proc.output(), "the worker drains")
            up.release()
            assert await exited(workers, proc) == 0
            handed = await api.get(run_id)
            sent_by_worker = len(up.arrived)

            # Another worker continues the run at once: the lease was handed back.
            await run_worker(svc, owner="next").run_until_idle()
            final = await api.get(run_id)
            failures = (
                await http.get(f"{api.runs}/{run_id}/failures", headers=acct.headers)
            ).json()

    assert handed["status"] == "running"
    assert handed["progress"]["rowsUncertain"] == 0
    assert handed["progress"]["rowsDone"] == sent_by_worker == 5
    assert final["status"] == "completed"
    assert final["results"]["rowsSucceeded"] == len(ROWS)
    assert final["results"]["rowsUncertain"] == 0 and failures["data"] == []
    sent = Counter(up.arrived)
    assert len(sent) == len(ROWS) and max(sent.values()) == 1


async def file_batch(http: httpx.AsyncClient, headers: dict[str, str]) -> str:
    content = jsonl([chat_line(f"l{i}", text, max_tokens=8) for i, text in enumerate(LINES)])
    f = (await upload(http, headers, content)).json()
    batch = (await create(http, headers, f["id"])).json()
    assert batch["status"] == "in_progress", batch
    return str(batch["id"])


async def test_a_worker_drains_a_file_batch_on_sigterm(workers: Workers, one_worker: Any) -> None:
    with FakeUpstream() as up:
        up.hold(after=3)
        async with one_worker(
            up, credit="5", file_batches=FAST_FILES, route={"concurrency": 2}
        ) as (svc, http, proc, acct):
            bid = await file_batch(http, acct.headers)
            await workers.until(lambda: up.held == 2, "two calls are in flight")
            sigterm(proc)
            await workers.until(lambda: "draining" in proc.output(), "the worker drains")
            up.release()
            assert await exited(workers, proc) == 0
            handed = Counter(r.state for r in lines_of(svc, bid))
            sent_by_worker = len(up.arrived)

            # Another worker continues the batch at once: nothing of it is held.
            await file_batch_worker(svc, owner="next").run_until_idle()
            done = (await http.get(f"/v1/batches/{bid}", headers=acct.headers)).json()
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
            acts = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))

    assert handed == {"succeeded": sent_by_worker, "pending": len(LINES) - sent_by_worker}
    assert sent_by_worker == 5  # three answered at once, two in flight at the SIGTERM
    assert done["status"] == "completed"
    assert done["request_counts"]["completed"] == len(LINES)
    sent = Counter(up.arrived)
    assert sorted(sent) == sorted(LINES) and max(sent.values()) == 1
    assert bal.held == 0 and bal.settled > 0
    assert not [a for a in acts if a["kind"] in ("uncertain", "hold_unresolved")]


async def test_a_file_batch_line_the_grace_period_cuts_off_is_uncertain_at_once(
    workers: Workers, one_worker: Any
) -> None:
    with FakeUpstream() as up:
        up.hold(after=0)  # and never released while the worker lives
        async with one_worker(
            up, credit="1", file_batches=FAST_FILES, route={"concurrency": 1}, shutdown_grace_s=0.5
        ) as (svc, http, proc, acct):
            bid = await file_batch(http, acct.headers)
            await workers.until(lambda: up.held == 1, "one call is in flight")
            sigterm(proc)
            assert await exited(workers, proc) == 0
            up.release()
            # Well inside the 30 s lease: the worker let go of its lines as it stopped.
            lines = {r.line: r for r in lines_of(svc, bid)}
            acts = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))

    (cut,) = [n for n, r in lines.items() if r.state == "uncertain"]
    assert up.arrived == [LINES[cut - 1]]
    assert {n: r.state for n, r in lines.items() if n != cut} == {
        n: "pending" for n in lines if n != cut
    }
    assert all(r.lease_owner is None for r in lines.values())
    uncertain = [a for a in acts if a["kind"] == "uncertain"]
    assert [(a["ref"], a["detail"]["lines"]) for a in uncertain] == [(bid, [cut])]


async def test_serve_finishes_the_requests_in_progress_on_sigterm(
    tmp_path: Path, database_url: str, workers: Workers, make_service: ServiceFactory
) -> None:
    with FakeUpstream() as up:
        up.hold(after=0)
        async with deployment(
            make_service, tmp_path, database_url, upstream=up, runs=FAST_RUNS
        ) as dep:
            svc = dep.service
            port = free_port()
            acct = make_account(svc, credit="1")
            server = workers.start(
                config=dep.config,
                database_url=database_url,
                name="serve",
                command="serve",
                args=("--port", str(port)),
            )
            base = f"http://127.0.0.1:{port}"

            async def ready() -> bool:
                try:
                    async with httpx.AsyncClient(base_url=base) as c:
                        return (await c.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await workers.until(ready, "serve is ready")
            async with httpx.AsyncClient(base_url=base, timeout=HANG_S) as client:
                body = {**chat("a chat in flight"), "max_tokens": 8}
                call = asyncio.create_task(
                    client.post(
                        "/v1/chat/completions",
                        json=body,
                        headers={**acct.headers, "Idempotency-Key": "in-flight"},
                    )
                )
                await workers.until(lambda: up.held == 1, "the chat call is in flight")
                sigterm(server)
                await workers.until(lambda: "draining" in server.output(), "serve drains")
                up.release()
                answer = await call
            # uvicorn re-raises the signal once it has shut down cleanly.
            assert await exited(workers, server) in (0, -signal.SIGTERM)
            assert "Application shutdown complete" in server.output()
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
            acts = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))

    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "echo: a chat in flight"
    assert bal.held == 0 and bal.settled > 0
    assert [a["kind"] for a in acts] == ["charge"]


async def test_only_a_call_the_grace_period_cuts_off_is_uncertain(
    workers: Workers, one_worker: Any
) -> None:
    with FakeUpstream() as up:
        up.hold(after=0)  # and never released while the worker lives
        async with one_worker(up, credit="1", route={"concurrency": 1}, shutdown_grace_s=0.5) as (
            svc,
            http,
            proc,
            acct,
        ):
            bid = (await submit(http, acct.headers, batch(TEXTS))).json()["id"]

            def stuck() -> bool:
                items = item_rows(svc, bid)
                return up.held == 1 and all(i.status == "dispatched" for i in items)

            await workers.until(stuck, "every item is claimed and one call is in flight")
            (started,) = [i.custom_id for i in item_rows(svc, bid) if i.sent_at is not None]
            sigterm(proc)
            assert await exited(workers, proc) == 0
            up.release()
            items = {i.custom_id: i for i in item_rows(svc, bid)}
            acts = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))

    assert items[started].status == "uncertain"
    assert {c: i.status for c, i in items.items() if c != started} == {
        c: "waiting" for c in items if c != started
    }
    uncertain = [a for a in acts if a["kind"] == "uncertain"]
    assert [a["ref"] for a in uncertain] == [items[started].id]
    # One rule on every door (docs/explanation/ledger.md): an uncertain item is charged
    # nothing and its hold is released, with a release record naming why.
    assert bal.held == 0 and bal.settled == 0
    released = [a for a in acts if a["kind"] == "release" and a["ref"] == items[started].id]
    assert len(released) == 1, acts
