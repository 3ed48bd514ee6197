"""Batch inference runs over real HTTP: quote, confirm, run, write, settle, cancel."""

from __future__ import annotations

import asyncio
import re
from decimal import Decimal

import pytest
from click.testing import CliRunner

from batchyard.app import run_worker
from batchyard.core.money import to_ticks
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import UpstreamError
from batchyard.store import activity, ledger
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.runs import (
    ISO,
    Api,
    GatedEngine,
    fast_runs,
    http_catalog,
)
from tests.support.server import asgi_client
from tests.support.waits import until

TICKETS = [
    {"text": f"ticket {i} about shipping", "lang": "en" if i % 4 else "fr"} for i in range(40)
]
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
SEED_KEYS = {
    "blockedReason",
    "charge",
    "createdAt",
    "datasetId",
    "error",
    "id",
    "message",
    "mode",
    "model",
    "output",
    "progress",
    "projectId",
    "quote",
    "results",
    "sampling",
    "status",
    "updatedAt",
}


@pytest.fixture
def svc(make_service):
    """A migrated service whose worker polls fast (it still reads the ManualClock).

    The ledger audit runs after the test and must be clean.
    """
    return make_service(runs=fast_runs())


def balance(svc, org_id):
    return svc.db.transact_sync(lambda c: ledger.balance(c, org_id))


async def test_a_run_goes_through_every_state_and_charges_real_usage(svc):
    engine = ScriptedEngine(lambda req: f"re: {req.messages[-1]['content']}", clock=svc.clock)
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS)
        r = await api.create(
            {**RUN, "datasetId": ds["id"], "filter": {"field": "lang", "eq": "en"}}
        )
        assert r.status_code == 201, r.text
        run = r.json()
        assert set(run) >= SEED_KEYS
        assert run["status"] == "preparing" and run["quote"] is None and run["progress"] is None
        assert re.match(
            r"^bir\.[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$", run["id"]
        )
        assert re.match(ISO, run["createdAt"]) and re.match(ISO, run["updatedAt"])
        assert run["output"] == {"type": "field", "field": "answer", "datasetId": ds["id"]}
        assert run["mode"] == {"type": "single_turn"}
        assert run["sampling"] == {
            "maxOutputTokens": 8,
            "samplesPerRow": 1,
            "temperature": None,
            "topP": None,
        }

        quoted = await api.wait(run["id"], "awaiting_confirmation")
        quote = quoted["quote"]
        assert quote["rows"] == 30 and quote["maxOutputTokens"] == 30 * 8
        assert quote["inputTokens"] > 30 and re.match(ISO, quote["expiresAt"])
        assert Decimal(quote["maxCost"]) > 0 and "confirm" in quoted["message"]
        assert balance(svc, acct.org_id).held == 0  # nothing reserved before confirm

        confirmed = (await api.post(run["id"], "confirm")).json()
        assert confirmed["status"] in ("queued", "running", "writing_outputs", "completed")
        done = await api.wait(run["id"], "completed")
        rows = await api.rows(ds["id"])

    assert done["progress"] is None and done["error"] is None and done["blockedReason"] is None
    res = done["results"]
    assert res["rowsSucceeded"] == 30 and res["rowsFailed"] == 0 and res["outputsWritten"] == 30
    assert res["outputTokens"] == 30 * 5  # "re: ticket N about shipping": 5 scripted words
    assert Decimal(done["charge"]) <= Decimal(quote["maxCost"])
    assert Decimal(done["charge"]) > 0 and "Completed" in done["message"]
    by_id = {r["id"]: r for r in rows}
    for i, t in enumerate(TICKETS):
        row = by_id[i + 1]
        if t["lang"] == "en":
            assert row["data"]["answer"] == "re: " + t["text"]
            assert row["version"] == 2
        else:
            assert "answer" not in row["data"] and row["version"] == 1
    assert len(engine.calls) == 30
    bal = balance(svc, acct.org_id)
    assert bal.held == 0 and bal.settled == to_ticks(Decimal(done["charge"]))
    acts = svc.db.transact_sync(lambda c: activity.list_activity(c, acct.org_id))
    charges = [a for a in acts if a["kind"] == "charge" and a["ref"] == run["id"]]
    assert len(charges) == 1 and charges[0]["amount"] == bal.settled


async def test_progress_is_reported_while_running_and_cancel_keeps_answered_rows(svc):
    engine = GatedEngine(open_first=5)
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS)
        run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
        await api.wait(run["id"], "awaiting_confirmation")
        await api.post(run["id"], "confirm")

        async def five_done() -> bool:
            nonlocal cur
            cur = await api.get(run["id"])
            return bool(cur["status"] == "running" and cur["progress"]["rowsDone"] == 5)

        cur = {}
        await until(five_done, "five rows are done")
        assert cur["progress"] == {
            "rowsDone": 5,
            "rowsFailed": 0,
            "rowsUncertain": 0,
            "rowsTotal": 40,
            "inputTokens": cur["progress"]["inputTokens"],
            # The scripted engine keeps no prompt cache.
            "cachedInputTokens": 0,
            "outputTokens": 15,
        }
        stopping = (await api.post(run["id"], "cancel")).json()
        assert stopping["status"] == "stopping" and stopping["progress"] is not None
        engine.gate.set()  # the two calls in flight land and are kept
        canceled = await api.wait(run["id"], "canceled")
        again = await api.post(run["id"], "cancel")
        rows = await api.rows(ds["id"])
    assert again.status_code == 409 and again.json()["error"]["code"] == "invalid_state"
    assert stopping["error"]["code"] == canceled["error"]["code"] == "canceled"
    res = canceled["results"]
    assert res["rowsSucceeded"] == 7 and res["rowsCanceled"] == 33 and res["outputsWritten"] == 7
    assert len(engine.prompts) == 7
    assert sum("answer" in r["data"] for r in rows) == 7
    bal = balance(svc, acct.org_id)
    assert bal.held == 0 and bal.settled == to_ticks(Decimal(canceled["charge"])) > 0


async def test_rows_are_frozen_at_the_quote_and_samples_fill_a_new_dataset(svc):
    engine = ScriptedEngine(lambda req: f"echo {req.messages[-1]['content']}", clock=svc.clock)
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="5")
    chats = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(chats)
        body = {
            "datasetId": ds["id"],
            "model": {"type": "base", "id": "kettei-core"},
            "output": {"type": "dataset", "name": "answers"},
            "sampling": {"maxOutputTokens": 4, "samplesPerRow": 3, "temperature": 0.7, "topP": 0.9},
        }
        run = (await api.create(body)).json()
        assert run["input"] == {"type": "messages"}
        await api.wait(run["id"], "awaiting_confirmation")
        edit = await http.patch(
            f"/v1/projects/{api.project}/datasets/{ds['id']}/rows/1",
            json={"data": {"messages": [{"role": "user", "content": "edited"}]}},
            headers=acct.headers,
        )
        assert edit.status_code == 200
        await api.post(run["id"], "confirm")
        done = await api.wait(run["id"], "completed")
        out_id = done["output"]["datasetId"]
        assert out_id and out_id.startswith("ds.")
        out = await api.rows(out_id)
        meta = (
            await http.get(f"/v1/projects/{api.project}/datasets/{out_id}", headers=acct.headers)
        ).json()
    assert (
        meta["kind"] == "chat-sft" and meta["sourceRunId"] == run["id"] and meta["rowCount"] == 12
    )
    assert all(r.n == 3 and r.temperature == 0.7 and r.top_p == 0.9 for r in engine.calls)
    prompts = sorted(r.messages[-1]["content"] for r in engine.calls)
    assert prompts == ["q0", "q1", "q2", "q3"]  # "edited" came after the quote
    first = [r["data"] for r in out if r["data"]["sourceRowId"] == 1]
    assert len(first) == 3 and {r["sample"] for r in first} == {0, 1, 2}
    assert first[0]["messages"] == [
        {"role": "user", "content": "q0"},
        {"role": "assistant", "content": "echo q0"},
    ]


async def test_samples_in_a_field_are_a_list(svc):
    svc.engines.set("embedded", ScriptedEngine("yes", clock=svc.clock))
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS[:3])
        run = (
            await api.create(
                {
                    **RUN,
                    "datasetId": ds["id"],
                    "sampling": {"maxOutputTokens": 2, "samplesPerRow": 2},
                }
            )
        ).json()
        await api.wait(run["id"], "awaiting_confirmation")
        await api.post(run["id"], "confirm")
        await api.wait(run["id"], "completed")
        rows = await api.rows(ds["id"])
    assert [r["data"]["answer"] for r in rows] == [["yes", "yes"]] * 3


async def test_failed_rows_are_counted_and_listed_not_fatal(svc):
    boom = UpstreamError("upstream said 500")
    svc.engines.set(
        "embedded", ScriptedEngine("ok", clock=svc.clock, failures=[None, boom, None, boom])
    )
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS[:10])
        run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
        await api.wait(run["id"], "awaiting_confirmation")
        await api.post(run["id"], "confirm")
        done = await api.wait(run["id"], "completed")
        failures = (await http.get(f"{api.runs}/{run['id']}/failures", headers=acct.headers)).json()
    assert done["results"]["rowsSucceeded"] == 8 and done["results"]["rowsFailed"] == 2
    assert [f["state"] for f in failures["data"]] == ["failed", "failed"]
    assert failures["data"][0]["error"]["code"] == "upstream_error"


async def test_a_broken_route_fails_the_run_after_a_streak(make_service):
    svc = make_service(runs=fast_runs(failure_streak=5))
    svc.engines.set(
        "embedded", ScriptedEngine("ok", clock=svc.clock, failures=[UpstreamError("down")] * 40)
    )
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS)
        run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
        await api.wait(run["id"], "awaiting_confirmation")
        await api.post(run["id"], "confirm")
        failed = await api.wait(run["id"], "failed")
    assert failed["error"]["code"] == "too_many_failures" and failed["charge"] == "0"
    assert failed["results"]["rowsCanceled"] > 0
    assert balance(svc, acct.org_id).held == 0


async def test_without_funds_a_run_is_blocked_and_moves_on_when_credit_arrives(svc):
    svc.engines.set("embedded", ScriptedEngine("ok", clock=svc.clock))
    acct = make_account(svc, credit="0")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS[:5])
        run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
        await api.wait(run["id"], "awaiting_confirmation")
        blocked = (await api.post(run["id"], "confirm")).json()
        assert blocked["status"] == "blocked" and blocked["blockedReason"] == "funds"
        assert "credit" in blocked["message"]
        svc.db.transact_sync(
            lambda c: ledger.top_up(c, acct.org_id, to_ticks(Decimal("1")), svc.clock.now())
        )
        done = await api.wait(run["id"], "completed")
    assert done["blockedReason"] is None and done["results"]["rowsSucceeded"] == 5


async def test_a_large_quote_waits_for_billing_review_and_the_cli_approves_it(make_service):
    svc = make_service(runs=fast_runs(), billing_review_threshold=Decimal("0.000001"))
    svc.engines.set("embedded", ScriptedEngine("ok", clock=svc.clock))
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS[:5])
        run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
        await api.wait(run["id"], "awaiting_confirmation")
        held = (await api.post(run["id"], "confirm")).json()
        assert held["status"] == "blocked" and held["blockedReason"] == "billing_review"
        assert f"batchyard runs approve {run['id']}" in held["message"]
        from batchyard.cli.runs import runs as runs_cli

        result = CliRunner().invoke(
            runs_cli, ["approve", run["id"], "--database", svc.settings.database_url]
        )
        assert result.exit_code == 0, result.output
        done = await api.wait(run["id"], "completed")
    assert done["results"]["rowsSucceeded"] == 5


async def test_confirm_rules_invalid_state_and_quote_expired(svc):
    svc.engines.set("embedded", ScriptedEngine("ok", clock=svc.clock))
    acct = make_account(svc, credit="5")
    async with asgi_client(svc, worker=False) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS[:3])
        early = (await api.create({**RUN, "datasetId": ds["id"]})).json()
        too_soon = await api.post(early["id"], "confirm")
        await run_worker(svc).run_until_idle()
        await api.wait(early["id"], "awaiting_confirmation")
        svc.clock.advance(24 * 3600 + 1)
        expired = await api.post(early["id"], "confirm")
        after = await api.get(early["id"])
        canceled = (await api.post(early["id"], "cancel")).json()
        confirm_canceled = await api.post(early["id"], "confirm")
    assert too_soon.status_code == 409 and too_soon.json()["error"]["code"] == "invalid_state"
    assert expired.status_code == 409 and expired.json()["error"]["code"] == "quote_expired"
    assert after["status"] == "awaiting_confirmation"
    assert canceled["status"] == "canceled" and canceled["charge"] is None
    # docs/reference/runs.md: "failure or cancellation details" (issue 22: it was null).
    assert canceled["error"]["code"] == "canceled"
    assert canceled["error"]["canceledByKeyId"] == acct.key_id
    assert canceled["error"]["canceledAt"].endswith("Z")
    assert confirm_canceled.status_code == 409
    assert balance(svc, acct.org_id).held == 0


async def test_idempotent_create_and_listing_with_cursor(svc):
    acct = make_account(svc, credit="5")
    async with asgi_client(svc, worker=False) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS[:3])
        body = {**RUN, "datasetId": ds["id"]}
        a = await api.create(body, key="same")
        b = await api.create(body, key="same")
        c = await api.create({**body, "sampling": {"maxOutputTokens": 9}}, key="same")
        no_key = await http.post(api.runs, json=body, headers=acct.headers)
        long_key = await api.create(body, key="k" * 129)
        ids = [a.json()["id"]] + [(await api.create(body)).json()["id"] for _ in range(4)]
        pages, cursor = [], None
        while True:
            params = {"limit": 2, "status": "preparing", **({"cursor": cursor} if cursor else {})}
            page = (await http.get(api.runs, params=params, headers=acct.headers)).json()
            pages.append([r["id"] for r in page["data"]])
            cursor = page["nextCursor"]
            if not cursor:
                break
        none = (
            await http.get(api.runs, params={"status": "completed"}, headers=acct.headers)
        ).json()
        bad = await http.get(api.runs, params={"status": "nope"}, headers=acct.headers)
    assert a.status_code == b.status_code == 201 and a.json()["id"] == b.json()["id"]
    assert c.status_code == 409 and c.json()["error"]["code"] == "idempotency_conflict"
    assert (
        no_key.status_code == 400 and no_key.json()["error"]["code"] == "idempotency_key_required"
    )
    assert long_key.status_code == 400
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [rid for page in pages for rid in page] == sorted(ids, reverse=True)
    assert none["data"] == [] and bad.status_code == 400


@pytest.mark.parametrize(
    ("patch", "status", "code"),
    [
        ({"datasetId": "ds.00000000-0000-7000-8000-000000000000"}, 404, "not_found"),
        ({"output": {"type": "field", "field": "text"}}, 400, "output_overwrites_input"),
        ({"output": {"type": "table"}}, 400, "unsupported_output_type"),
        ({"sampling": {"samplesPerRow": 9}}, 400, "samples_per_row_out_of_range"),
        ({"sampling": {"samplesPerRow": 0}}, 400, "samples_per_row_out_of_range"),
        ({"sampling": {"maxOutputTokens": 0}}, 400, "max_output_tokens_out_of_range"),
        ({"sampling": {"maxOutputTokens": 5000}}, 400, "max_output_tokens_out_of_range"),
        ({"sampling": {"temperature": 3}}, 400, "sampling_out_of_range"),
        ({"filter": {"field": "lang", "eq": "de"}}, 400, "filter_matches_no_rows"),
        ({"filter": {"field": "lang", "like": "de"}}, 400, "invalid_filter"),
        ({"model": {"type": "lora", "id": "kettei-core"}}, 400, "unsupported_model_type"),
        ({"model": {"type": "base", "id": "nope"}}, 404, "unknown_model"),
        ({"model": {"type": "base", "id": "kettei-fat"}}, 400, "model_unavailable"),
        ({"mode": {"type": "multi_turn"}}, 400, "unsupported_mode"),
        ({"input": {"type": "field", "field": "body"}}, 400, "input_field_not_found"),
        ({"input": {"type": "messages"}}, 400, "input_field_not_found"),
    ],
)
async def test_bad_input_is_a_clear_4xx_and_creates_nothing(svc, patch, status, code):
    acct = make_account(svc, credit="5")
    async with asgi_client(svc, worker=False) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(TICKETS[:3])
        r = await api.create({**RUN, "datasetId": ds["id"], **patch})
        listing = (await http.get(api.runs, headers=acct.headers)).json()
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert listing["data"] == []


async def test_datasets_and_runs_of_other_projects_and_organisations_are_404(svc):
    a = make_account(svc, "a", credit="5")
    b = make_account(svc, "b", credit="5")
    async with asgi_client(svc, worker=False) as http:
        mine = await Api(http, a.headers).start()
        other_project = await Api(http, a.headers).start()
        theirs = await Api(http, b.headers).start()
        ds = await mine.upload(TICKETS[:3])
        run = (await mine.create({**RUN, "datasetId": ds["id"]})).json()
        wrong_project = await other_project.create({**RUN, "datasetId": ds["id"]})
        other_org = await theirs.create({**RUN, "datasetId": ds["id"]})
        peek = await http.get(f"{mine.runs}/{run['id']}", headers=b.headers)
        peek2 = await http.get(f"{other_project.runs}/{run['id']}", headers=a.headers)
        poke = await http.post(f"{mine.runs}/{run['id']}/cancel", headers=b.headers)
    for r in (wrong_project, other_org, peek, peek2, poke):
        assert r.status_code == 404, r.text


async def test_five_thousand_rows_through_a_fake_upstream_over_http(make_service):
    # How fast is bench/runs.py's question; this one is that every row is answered once.
    with FakeUpstream(mode="echo") as up:
        svc = make_service(catalog=http_catalog(up.base_url), runs=fast_runs(concurrency=16))
        acct = make_account(svc, credit="10")
        rows = [{"text": f"row {i} says hello"} for i in range(5000)]
        async with asgi_client(svc) as http:
            api = await Api(http, acct.headers).start()
            ds = await api.upload(rows)
            run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
            quoted = await api.wait(run["id"], "awaiting_confirmation")
            await api.post(run["id"], "confirm")
            done = await api.wait(run["id"], "completed")
            out = await api.rows(ds["id"])
        await svc.stop_workers()
    assert done["results"]["rowsSucceeded"] == 5000
    assert up.statuses[200] == 5000 and up.rate_limited == 0
    assert all(r["data"]["answer"] == f"echo: row {r['id'] - 1} says hello" for r in out)
    assert Decimal(done["charge"]) <= Decimal(quoted["quote"]["maxCost"])


@pytest.mark.postgres
async def test_the_same_flow_on_postgresql_with_two_workers_claiming(make_service):
    svc = make_service(postgres=True, runs=fast_runs(max_active_runs=1))
    engine = ScriptedEngine(lambda req: f"re: {req.messages[-1]['content']}", clock=svc.clock)
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="5")
    workers = [run_worker(svc, owner=f"worker-{i}") for i in range(2)]
    async with asgi_client(svc, worker=False) as http:
        api = await Api(http, acct.headers).start()
        tasks = [asyncio.create_task(w.run_forever()) for w in workers]
        run_ids, datasets = [], []
        for d in range(4):
            ds = await api.upload([{"text": f"d{d} row {i}"} for i in range(25)], name=f"d{d}")
            datasets.append(ds["id"])
            run_ids.append((await api.create({**RUN, "datasetId": ds["id"]})).json()["id"])
        for rid in run_ids:
            await api.wait(rid, "awaiting_confirmation")
            assert (await api.post(rid, "confirm")).status_code == 200
        finals = [await api.wait(rid, "completed") for rid in run_ids]
        answered = [r for d in datasets for r in await api.rows(d)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    prompts = [c.messages[-1]["content"] for c in engine.calls]
    assert len(prompts) == len(set(prompts)) == 100
    executions = [rid for w in workers for rid, status in w.claims if status == "running"]
    assert sorted(executions) == sorted(run_ids)  # each run executed by exactly one worker
    assert all(w.claims for w in workers)  # and both workers took a share
    assert all(f["results"]["rowsSucceeded"] == 25 for f in finals)
    assert all(r["data"]["answer"] == "re: " + r["data"]["text"] for r in answered)
    bal = balance(svc, acct.org_id)
    assert bal.held == 0 and bal.settled == sum(to_ticks(Decimal(f["charge"])) for f in finals)


@pytest.mark.model
@pytest.mark.timeout(900)  # 48 rows on the real model: minutes on a loaded machine
async def test_a_run_on_the_embedded_model_end_to_end(svc):
    # Enough rows to keep both of the engine's contexts busy through several
    # commits and lease renewals; bench/runs.py measures throughput.
    acct = make_account(svc, credit="5")
    rows = [{"text": f"Name one colour. Ticket {i}.", "lang": "en"} for i in range(48)]
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        ds = await api.upload(rows)
        run = (
            await api.create(
                {**RUN, "datasetId": ds["id"], "sampling": {"maxOutputTokens": 8, "temperature": 0}}
            )
        ).json()
        quoted = await api.wait(run["id"], "awaiting_confirmation")
        running = (await api.post(run["id"], "confirm")).json()
        seen = {running["status"]}
        while True:
            cur = await api.get(run["id"])
            seen.add(cur["status"])
            if cur["status"] == "completed":
                break
            assert cur["status"] in ("queued", "running", "writing_outputs"), cur
            await asyncio.sleep(0.05)
        out = await api.rows(ds["id"])
    assert "running" in seen
    quote, res = quoted["quote"], cur["results"]
    assert quote["rows"] == 48 and res["rowsSucceeded"] == 48 and res["rowsFailed"] == 0
    assert 0 < res["outputTokens"] <= quote["maxOutputTokens"] == 48 * 8
    assert (
        res["inputTokens"] <= quote["inputTokens"]
    )  # the quote counts with the model's own vocabulary
    # Every row's prompt opens like the others ("Name one colour. Ticket"): the engine
    # reads that opening from its cache for all but the first rows it answers at once.
    assert 0 < res["cachedInputTokens"] < res["inputTokens"]
    assert Decimal(cur["charge"]) <= Decimal(quote["maxCost"])
    assert all(isinstance(r["data"]["answer"], str) and r["data"]["answer"].strip() for r in out)
    bal = balance(svc, acct.org_id)
    assert bal.held == 0 and bal.settled == to_ticks(Decimal(cur["charge"]))
