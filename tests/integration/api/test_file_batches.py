"""OpenAI's Files and Batches over HTTP: upload, create with the quote held, run, download."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from batchyard.core.accounts import Scope
from batchyard.core.money import charge_ticks, from_ticks, parse_money, to_ticks
from batchyard.store import ledger
from tests.support.accounts import add_key, make_account
from tests.support.cached_routes import cached_catalog, settled
from tests.support.deferred_batches import BlockingEngine, batch_body, eventually, submit
from tests.support.file_batches import (
    chat_line,
    create,
    jsonl,
    lines_of,
    parse_lines,
    upload,
    worker,
)
from tests.support.server import asgi_client
from tests.support.workspace import answer_with


def balance(service, org_id):
    return service.db.read_sync(lambda c: ledger.balance(c, org_id))


async def test_upload_create_run_and_download_in_input_order(service):
    engine = answer_with(service, "hello there")
    acct = make_account(service, credit="1")
    content = jsonl([chat_line(f"req-{i}", f"Say hi to {i}.") for i in range(5)])
    async with asgi_client(service, worker=False) as http:
        up = await upload(http, acct.headers, content)
        assert up.status_code == 200, up.text
        f = up.json()
        assert f["object"] == "file" and f["purpose"] == "batch" and f["bytes"] == len(content)
        assert f["filename"] == "requests.jsonl" and isinstance(f["created_at"], int)
        assert (await http.get(f"/v1/files/{f['id']}", headers=acct.headers)).json() == f
        listed = (await http.get("/v1/files", headers=acct.headers)).json()
        assert [x["id"] for x in listed["data"]] == [f["id"]] and listed["has_more"] is False
        same = await http.get(f"/v1/files/{f['id']}/content", headers=acct.headers)
        assert same.content == content

        r = await create(http, acct.headers, f["id"], metadata={"job": "greetings"})
        assert r.status_code == 200, r.text
        batch = r.json()
        assert batch["status"] == "in_progress" and batch["dialect"] == "file"
        assert batch["request_counts"]["total"] == 5 and batch["request_counts"]["waiting"] == 5
        assert batch["metadata"] == {"job": "greetings"}
        held = to_ticks(parse_money(batch["max_cost"]))
        assert held > 0 and balance(service, acct.org_id).held == held

        await worker(service).run_until_idle()
        done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
        assert done["status"] == "completed", done
        assert done["request_counts"]["completed"] == 5 and done["request_counts"]["failed"] == 0
        assert done["error_file_id"] is None and isinstance(done["completed_at"], int)
        out = await http.get(f"/v1/files/{done['output_file_id']}/content", headers=acct.headers)
        meta = (await http.get(f"/v1/files/{done['output_file_id']}", headers=acct.headers)).json()

    results = parse_lines(out.content)
    assert [x["custom_id"] for x in results] == [f"req-{i}" for i in range(5)]
    assert meta["purpose"] == "batch_output" and meta["bytes"] == len(out.content)
    for x in results:
        assert x["error"] is None and x["response"]["status_code"] == 200
        assert x["response"]["body"]["choices"][0]["message"]["content"] == "hello there"
        assert x["response"]["request_id"] == x["response"]["body"]["id"]
    charges = sum(to_ticks(parse_money(x["response"]["body"]["charge"])) for x in results)
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled == charges == to_ticks(parse_money(done["charge"]))
    assert len(engine.calls) == 5


async def test_insufficient_credit_fails_the_batch_at_once_and_holds_nothing(service):
    answer_with(service)
    acct = make_account(service, credit="0.0000001")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a", max_tokens=1000)]))).json()
        r = await create(http, acct.headers, f["id"])
    batch = r.json()
    assert r.status_code == 200
    assert batch["status"] == "failed" and isinstance(batch["failed_at"], int)
    (error,) = batch["errors"]["data"]
    assert error["code"] == "insufficient_credit" and "Nothing was held" in error["message"]
    assert lines_of(service, batch["id"]) == []
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled == 0


async def test_an_expired_window_fails_the_rest_with_batch_expired(service, clock):
    answer_with(service)
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a"), chat_line("b")]))).json()
        batch = (await create(http, acct.headers, f["id"], window="1h")).json()
        clock.advance(3601)
        await worker(service).tick()
        done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
        errors = await http.get(f"/v1/files/{done['error_file_id']}/content", headers=acct.headers)
    assert done["status"] == "expired" and done["output_file_id"] is None
    assert done["request_counts"]["expired"] == 2
    lines = parse_lines(errors.content)
    assert [(x["custom_id"], x["response"], x["error"]["code"]) for x in lines] == [
        ("a", None, "batch_expired"),
        ("b", None, "batch_expired"),
    ]
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled == 0


async def test_cancel_stops_unsent_lines_and_a_finished_batch_cannot_be_cancelled(service):
    answer_with(service)
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a"), chat_line("b")]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        r = await http.post(f"/v1/batches/{batch['id']}/cancel", headers=acct.headers)
        assert r.json()["status"] == "cancelling" and isinstance(r.json()["cancelling_at"], int)
        await worker(service).tick()
        done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
        again = await http.post(f"/v1/batches/{batch['id']}/cancel", headers=acct.headers)
    assert done["status"] == "cancelled" and done["request_counts"]["canceled"] == 2
    assert again.status_code == 409 and again.json()["error"]["code"] == "batch_not_cancellable"
    assert balance(service, acct.org_id).held == 0


async def test_two_workers_share_one_batch_and_answer_each_line_once(service):
    engine = answer_with(service)
    acct = make_account(service, credit="5")
    content = jsonl([chat_line(f"r{i}") for i in range(40)])
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, content)).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        a, b = worker(service, "wkr.a"), worker(service, "wkr.b")
        await asyncio.gather(a.run_until_idle(), b.run_until_idle())
        done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 40
    assert len(engine.calls) == 40
    assert all(row.state == "succeeded" for row in lines_of(service, batch["id"]))


async def test_a_min_discount_waits_for_the_market_within_the_window(service, clock):
    """The embedded route is 95 % off kettei-core's direct price: 99 waits, 90 runs."""
    answer_with(service)
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]))).json()
        waits = (await create(http, acct.headers, f["id"], metadata={"min_discount": "99"})).json()
        runs = (await create(http, acct.headers, f["id"], metadata={"min_discount": "90"})).json()
        await worker(service).run_until_idle()
        w = (await http.get(f"/v1/batches/{waits['id']}", headers=acct.headers)).json()
        r = (await http.get(f"/v1/batches/{runs['id']}", headers=acct.headers)).json()
        clock.advance(24 * 3600 + 1)
        await worker(service).tick()
        w2 = (await http.get(f"/v1/batches/{waits['id']}", headers=acct.headers)).json()
    assert w["status"] == "in_progress" and w["request_counts"]["waiting"] == 1
    assert w["min_discount"] == 99
    assert r["status"] == "completed"
    # Charged at the route's offered price (0.005/0.02 per Mtok), not the direct one.
    line = lines_of(service, runs["id"])[0]
    direct = (
        Decimal("0.10") * line.usage_input / 10**6 + Decimal("0.40") * line.usage_output / 10**6
    )
    assert from_ticks(line.charge) < direct
    assert w2["status"] == "expired"


async def test_both_dialects_share_one_listing_and_one_object(service, clock):
    answer_with(service)
    acct = make_account(service, credit="1")
    reader = add_key(service, "acme", Scope.READ)
    async with asgi_client(service, worker=False) as http:
        seed = (await submit(http, acct.headers, batch_body(1))).json()
        clock.advance(1)
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]))).json()
        filed = (await create(http, acct.headers, f["id"])).json()
        listed = (await http.get("/v1/batches?limit=1", headers=reader.headers)).json()
        rest = (
            await http.get(f"/v1/batches?limit=1&after={listed['last_id']}", headers=reader.headers)
        ).json()
        refused = await create(http, reader.headers, f["id"])
    assert [b["id"] for b in listed["data"]] == [filed["id"]] and listed["has_more"] is True
    assert [b["id"] for b in rest["data"]] == [seed["id"]] and rest["has_more"] is False
    for view in (seed, filed):
        assert isinstance(view["created_at"], int) and isinstance(view["expires_at"], int)
        assert isinstance(view["deadline"], str)
        assert {"total", "completed", "failed", "waiting"} <= view["request_counts"].keys()
    assert seed["dialect"] == "deferred" and seed["input_file_id"] == ""
    assert refused.status_code == 403


async def test_privacy_redacts_a_line_before_it_is_stored(service):
    answer_with(service)
    acct = make_account(service, credit="1")
    line = chat_line("p", "Mail jane.doe@example.com now", privacy={"mode": "redact"})
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([line]))).json()
        stored = (await http.get(f"/v1/files/{f['id']}/content", headers=acct.headers)).content
    assert b"jane.doe@example.com" not in stored
    assert b"privacy" not in stored
    assert f["bytes"] == len(stored)


async def test_a_crashed_worker_leaves_its_lines_uncertain_never_resent_never_charged(
    service, clock
):
    engine = BlockingEngine("late")
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line(f"r{i}") for i in range(3)]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        crashed = worker(service, "wkr.crashed")
        await crashed.tick()
        await eventually(lambda: len(engine.calls) == 2)  # the embedded route's two contexts
        await crashed.stop()  # its calls are abandoned mid-flight, as a kill would
        clock.advance(61)  # past the lease
        engine.release.set()
        await worker(service, "wkr.next").run_until_idle()
        done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
        errors = await http.get(f"/v1/files/{done['error_file_id']}/content", headers=acct.headers)
    assert done["status"] == "completed"
    counts = done["request_counts"]
    assert (counts["uncertain"], counts["completed"]) == (2, 1)
    assert len(engine.calls) == 3  # the two uncertain lines were never sent again
    assert [x["error"]["code"] for x in parse_lines(errors.content)] == ["uncertain"] * 2
    charged = sum(row.charge or 0 for row in lines_of(service, batch["id"]))
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled == charged > 0


async def test_expired_files_and_abandoned_uploads_are_swept(service, clock):
    from batchyard.store import files as file_store

    acct = make_account(service, credit="1")
    now = clock.now()
    service.db.transact_sync(
        lambda c: file_store.create_file(
            c, file_id="file.abandoned", org_id=acct.org_id, purpose="batch", filename="x", now=now
        )
    )
    async with asgi_client(service, worker=False) as http:
        fields = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]), **fields)).json()
        assert f["expires_at"] == f["created_at"] + 3600
        clock.advance(3601)
        assert await worker(service).sweep_files(clock.now()) == (1, 1)
        gone = await http.get(f"/v1/files/{f['id']}", headers=acct.headers)
    assert gone.status_code == 404


async def test_completions_and_embeddings_lines_run_and_answer_in_their_endpoint_s_shape(service):
    engine = answer_with(service, "a reply")
    acct = make_account(service, credit="1")
    completions = [
        {
            "custom_id": f"c-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "kettei-core", "prompt": f"Once upon a time {i}", "max_tokens": 6},
        }
        for i in range(3)
    ]
    embeddings = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "kettei-core", "input": [f"text {i}", "more"]},
        }
        for i in range(2)
    ]
    async with asgi_client(service, worker=False) as http:
        results = {}
        for endpoint, lines in (("/v1/completions", completions), ("/v1/embeddings", embeddings)):
            f = (await upload(http, acct.headers, jsonl(lines))).json()
            r = await create(http, acct.headers, f["id"], endpoint=endpoint)
            assert r.status_code == 200, r.text
            await worker(service).run_until_idle()
            done = (await http.get(f"/v1/batches/{r.json()['id']}", headers=acct.headers)).json()
            assert done["status"] == "completed" and done["request_counts"]["failed"] == 0, done
            out = await http.get(
                f"/v1/files/{done['output_file_id']}/content", headers=acct.headers
            )
            results[endpoint] = (done, parse_lines(out.content))
    done, lines = results["/v1/completions"]
    assert [x["custom_id"] for x in lines] == ["c-0", "c-1", "c-2"]
    for x in lines:
        body = x["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == "a reply"
        assert body["id"] == x["response"]["request_id"]
    # A text completion reaches the engine as a raw prompt, without a chat template.
    assert [c.prompt for c in engine.calls] == [f"Once upon a time {i}" for i in range(3)]
    done, lines = results["/v1/embeddings"]
    for x in lines:
        body = x["response"]["body"]
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
        assert all(len(d["embedding"]) == 8 for d in body["data"])
        assert body["usage"]["prompt_tokens"] > 0
    assert engine.embed_calls == [["text 0", "more"], ["text 1", "more"]]
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled > 0


@pytest.mark.model
async def test_a_lines_cached_prompt_tokens_are_charged_at_the_routes_cached_price(make_service):
    service = make_service(catalog=cached_catalog())
    acct = make_account(service, credit="1")
    system = {"role": "system", "content": "You answer support tickets in one short sentence."}
    lines = [
        {
            **chat_line(f"req-{i}"),
            "body": {
                "model": "kettei-core",
                "messages": [system, {"role": "user", "content": f"Ticket {i}: where is it?"}],
                "max_tokens": 4,
            },
        }
        for i in range(3)
    ]
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl(lines))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        await worker(service).run_until_idle()
        done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
        out = await http.get(f"/v1/files/{done['output_file_id']}/content", headers=acct.headers)
    assert done["request_counts"]["completed"] == 3, done
    cached = []
    for x in parse_lines(out.content):
        body = x["response"]["body"]
        cached.append((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        expected = charge_ticks(settled(service.catalog, "kettei-core", body["usage"]))
        assert to_ticks(parse_money(body["charge"])) == expected
    # The lines share their system prompt: the engine reads it once.
    assert max(cached) > 0
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled == to_ticks(parse_money(done["charge"]))
