"""Retrying a batch inference run (``POST …/retry``): a new run of the failed and canceled rows.

The retry keeps each row's ID and frozen version, is quoted at once and
confirmed like any run (nothing held before), names the run it retries
(which names it back), answers the same under one ``Idempotency-Key``, and
never sends again a row that succeeded or is uncertain. A call its upstream
answered 503 before taking it is sent again by the worker, a bounded number
of times, before the row counts as failed.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest
from sqlalchemy import update

from batchyard.client import AsyncClient
from batchyard.core.money import parse_money, to_ticks
from batchyard.store import ledger
from batchyard.store.runs import run_items
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.runs import FIELD_RUN as RUN
from tests.support.runs import Api, RowEngine, fast_runs, http_catalog
from tests.support.server import asgi_client


def balance(svc, org_id):
    return svc.db.transact_sync(lambda c: ledger.balance(c, org_id))


def ticks(value: str | None) -> int:
    return to_ticks(parse_money(value or "0"))


@pytest.mark.parametrize("postgres", [False, True], ids=["sqlite", "postgresql"])
async def test_a_retry_run_sends_only_the_failed_rows_and_charges_only_them(make_service, postgres):
    svc = make_service(runs=fast_runs(), postgres=postgres)
    engine = RowEngine("flaky")
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="5")
    rows = [{"text": f"flaky {i}" if i in (1, 4) else f"row {i}"} for i in range(6)]
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        run_id, ds_id = await api.confirmed(rows, RUN)
        early = await api.post(run_id, "retry")
        first = await api.wait(run_id, "completed")
        settled_first = balance(svc, acct.org_id).settled
        held_before = balance(svc, acct.org_id).held

        client = AsyncClient(base_url=str(http.base_url), api_key=acct.key, http_client=http)
        retry = await client.retry_run(api.project, run_id, idempotency_key="retry-the-flaky")
        same = await client.retry_run(api.project, run_id, idempotency_key="retry-the-flaky")
        again = await api.post(run_id, "retry")
        held_unconfirmed = balance(svc, acct.org_id).held

        engine.healed = True
        sent_before = len(engine.prompts)
        confirmed = await api.post(retry["id"], "confirm")
        assert confirmed.status_code == 200, confirmed.text
        done = await api.wait(retry["id"], "completed")
        original = await api.get(run_id)
        answers = {r["id"]: r["data"].get("answer") for r in await api.rows(ds_id)}
        retry_of_retry = await api.post(retry["id"], "retry")

    assert early.status_code == 409 and early.json()["error"]["code"] == "batch_not_ended"
    assert first["results"]["rowsFailed"] == 2
    assert retry["status"] == "awaiting_confirmation" and retry["quote"]["rows"] == 2
    assert retry["retry"] == {
        "of": run_id,
        "rows": 2,
        "notRetried": {"succeeded": 4, "uncertain": 0, "uncertainRowIds": [], "tooLong": 0},
    }
    assert same == retry  # one Idempotency-Key, one retry
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_retried"
    assert retry["retryOf"] == run_id and original["retriedBy"] == retry["id"]
    assert held_unconfirmed == held_before == 0  # quoted, nothing held before confirm
    assert ticks(retry["quote"]["maxCost"]) < ticks(first["quote"]["maxCost"])
    # Only the two rows that failed were sent again, with the text the first run froze.
    assert sorted(engine.prompts[sent_before:]) == ["flaky 1", "flaky 4"]
    assert done["results"]["rowsSucceeded"] == 2 and done["results"]["rowsFailed"] == 0
    assert answers == {i + 1: f"answer to {r['text']}" for i, r in enumerate(rows)}
    bal = balance(svc, acct.org_id)
    assert bal.held == 0
    assert bal.settled - settled_first == ticks(done["charge"]) > 0
    assert Decimal(done["charge"]) <= Decimal(retry["quote"]["maxCost"])
    assert retry_of_retry.status_code == 409
    assert retry_of_retry.json()["error"]["code"] == "nothing_to_retry"


async def test_uncertain_and_succeeded_rows_are_never_retried_and_are_named(make_service):
    svc = make_service(runs=fast_runs())
    engine = RowEngine("flaky")
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="5")
    rows = [{"text": f"flaky {i}" if i < 2 else f"row {i}"} for i in range(4)]
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        run_id, _ = await api.confirmed(rows, RUN)
        await api.wait(run_id, "completed")
        # Row 1 failed; say its call was in flight when its worker died: it may have been
        # answered upstream, so it must not be sent again.
        svc.db.transact_sync(
            lambda c: c.execute(
                update(run_items)
                .where(run_items.c.run_id == run_id, run_items.c.row_id == 1)
                .values(state="uncertain")
            )
        )
        r = await api.post(run_id, "retry")
        assert r.status_code == 201, r.text
        retry = r.json()
        confirmed = await api.post(retry["id"], "confirm")
        assert confirmed.status_code == 200, confirmed.text
        engine.healed = True
        sent_before = len(engine.prompts)
        await api.wait(retry["id"], "completed")
        failures = await http.get(f"{api.runs}/{retry['id']}/failures", headers=acct.headers)

    assert retry["retry"]["rows"] == 1
    assert retry["retry"]["notRetried"] == {
        "succeeded": 2,
        "uncertain": 1,
        "uncertainRowIds": [1],
        "tooLong": 0,
    }
    assert engine.prompts[sent_before:] == ["flaky 1"]  # row 2 only: the uncertain row 1 stays
    assert failures.json()["data"] == []


@pytest.mark.parametrize(("retries", "succeeded", "answered_upstream"), [(2, 2, 2), (1, 1, 1)])
async def test_a_row_the_upstream_refused_with_503_is_sent_again_within_its_bound(
    make_service, retries, succeeded, answered_upstream
):
    # The fake upstream answers the first two calls 503 (it took nothing): the worker sends
    # the row again after the pause, up to ``upstream_unavailable_retries`` times; past
    # that the row fails. Nothing else is sent twice.
    with FakeUpstream(mode="echo") as up:
        svc = make_service(
            catalog=http_catalog(up.base_url),
            runs=fast_runs(concurrency=1),
            upstream_unavailable_retries=retries,
        )
        acct = make_account(svc, credit="5")
        up.fail_next(2, status=503)
        async with asgi_client(svc) as http:
            api = await Api(http, acct.headers).start()
            run_id, _ = await api.confirmed([{"text": f"row {i}"} for i in range(2)], RUN)
            done = await wait_ticking(svc, api, run_id)
            failures = await http.get(f"{api.runs}/{run_id}/failures", headers=acct.headers)
    assert done["status"] == "completed", done
    assert done["results"]["rowsSucceeded"] == succeeded
    assert [(f["rowId"], f["error"]["code"]) for f in failures.json()["data"]] == [
        (1, "upstream_error")
    ] * (2 - succeeded)
    assert up.statuses[503] == 2 and up.statuses[200] == answered_upstream


async def wait_ticking(svc, api: Api, run_id: str) -> dict:
    """Wait for the run to end, moving the clock on so the worker's pauses pass."""
    while True:
        run = await api.get(run_id)
        if run["status"] in ("completed", "failed", "canceled"):
            return run
        svc.clock.advance(0.2)
        await asyncio.sleep(0.02)


async def test_a_retry_of_a_dataset_output_run_adds_to_the_same_output_dataset(make_service):
    svc = make_service(runs=fast_runs())
    engine = RowEngine("flaky")
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="5")
    rows = [{"text": "flaky 0"}, {"text": "row 1"}, {"text": "row 2"}]
    body = {**RUN, "output": {"type": "dataset", "name": "answers"}}
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        run_id, _ = await api.confirmed(rows, body)
        first = await api.wait(run_id, "completed")
        retry = (await api.post(run_id, "retry")).json()
        engine.healed = True
        await api.post(retry["id"], "confirm")
        done = await api.wait(retry["id"], "completed")
        out = await api.rows(first["output"]["datasetId"])

    assert done["output"]["datasetId"] == first["output"]["datasetId"]
    assert sorted(r["data"]["sourceRowId"] for r in out) == [1, 2, 3]
    answers = {r["data"]["sourceRowId"]: r["data"]["messages"][-1]["content"] for r in out}
    assert answers[1] == "answer to flaky 0"
