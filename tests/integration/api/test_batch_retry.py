"""Retry only what failed (``POST …/retry``): a new batch of the failed, expired, canceled items.

The retry keeps each item's ``custom_id`` and body, is quoted and held like
any batch, names the batch it retries (which names it back), answers the same
under one ``Idempotency-Key``, and never sends again an item that succeeded
or is uncertain.
"""

from __future__ import annotations

import asyncio
import json

from batchyard.core.money import parse_money, to_ticks
from batchyard.engines.protocol import Completion, CompletionRequest
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import ModelOutputInvalid
from batchyard.service import Service
from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.deferred_batches import (
    BlockingEngine,
    batch_body,
    eventually,
    feed_route,
    submit,
)
from tests.support.fake_upstream import FakeUpstream
from tests.support.file_batches import (
    chat_line,
    create,
    jsonl,
    lines_of,
    parse_lines,
    upload,
    worker,
)
from tests.support.runs import http_catalog
from tests.support.server import asgi_client


class Flaky:
    """Fails every prompt that says ``flaky`` until ``healed``; answers the rest."""

    name = "flaky"

    def __init__(self, service: Service) -> None:
        self._inner = ScriptedEngine("an answer", clock=service.clock)
        self.healed = False
        self.prompts: list[str] = []

    async def complete(self, request: CompletionRequest) -> Completion:
        text = json.dumps(request.messages)
        self.prompts.append(text)
        if "flaky" in text and not self.healed:
            raise ModelOutputInvalid("the model answered outside the schema")
        return await self._inner.complete(request)

    async def aclose(self) -> None:
        return None


def balance(service: Service, org_id: str) -> ledger.Balance:
    return service.db.read_sync(lambda c: ledger.balance(c, org_id))


async def test_a_retry_sends_only_the_failed_lines_and_charges_only_them(service):
    engine = Flaky(service)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    texts = ["flaky one" if i in (1, 4) else f"Say hi to {i}." for i in range(6)]
    lines = [chat_line(f"r{i}", text, max_tokens=8) for i, text in enumerate(texts)]
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl(lines))).json()
        first = (await create(http, acct.headers, f["id"])).json()
        early = await http.post(f"/v1/batches/{first['id']}/retry", headers=acct.headers)
        await worker(service).run_until_idle()
        settled_first = balance(service, acct.org_id).settled

        key = {**acct.headers, "Idempotency-Key": "retry-the-flaky-ones"}
        r = await http.post(f"/v1/batches/{first['id']}/retry", headers=key)
        same = await http.post(f"/v1/batches/{first['id']}/retry", headers=key)
        again = await http.post(f"/v1/batches/{first['id']}/retry", headers=acct.headers)
        assert r.status_code == 200, r.text
        retry = r.json()
        assert balance(service, acct.org_id).held == to_ticks(parse_money(retry["max_cost"]))

        engine.healed = True
        sent_before = len(engine.prompts)
        await worker(service).run_until_idle()
        done = (await http.get(f"/v1/batches/{retry['id']}", headers=acct.headers)).json()
        original = (await http.get(f"/v1/batches/{first['id']}", headers=acct.headers)).json()
        out = await http.get(f"/v1/files/{done['output_file_id']}/content", headers=acct.headers)
        again_done = await http.post(f"/v1/batches/{retry['id']}/retry", headers=acct.headers)

    assert early.status_code == 409 and early.json()["error"]["code"] == "batch_not_ended"
    assert same.json() == retry
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_retried"
    assert retry["retry_of"] == first["id"] and original["retried_by"] == retry["id"]
    assert retry["retry"] == {
        "of": first["id"],
        "lines": 2,
        "not_retried": {"succeeded": 4, "uncertain": 0, "uncertain_custom_ids": []},
    }
    assert retry["request_counts"]["total"] == 2
    assert to_ticks(parse_money(retry["max_cost"])) < to_ticks(parse_money(first["max_cost"]))
    assert len(engine.prompts) - sent_before == 2  # only the two that failed were sent again
    assert [x["custom_id"] for x in parse_lines(out.content)] == ["r1", "r4"]
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 2
    bal = balance(service, acct.org_id)
    assert bal.held == 0
    assert bal.settled - settled_first == to_ticks(parse_money(done["charge"])) > 0
    assert again_done.status_code == 409
    assert again_done.json()["error"]["code"] == "nothing_to_retry"


async def test_uncertain_lines_are_named_and_never_sent_again(service, clock):
    engine = BlockingEngine("late")
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line(f"r{i}") for i in range(3)]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        crashed = worker(service, "wkr.crashed")
        await crashed.tick()
        await eventually(lambda: len(engine.calls) == 2)
        await crashed.stop()
        clock.advance(61)
        await http.post(f"/v1/batches/{batch['id']}/cancel", headers=acct.headers)
        engine.release.set()
        await worker(service, "wkr.next").run_until_idle()
        r = await http.post(f"/v1/batches/{batch['id']}/retry", headers=acct.headers)
    states = {row.custom_id: row.state for row in lines_of(service, batch["id"])}
    uncertain = sorted(cid for cid, state in states.items() if state == "uncertain")
    retried = sorted(cid for cid, state in states.items() if state == "canceled")
    assert len(uncertain) == 2 and len(retried) == 1
    assert r.status_code == 200, r.text
    assert r.json()["retry"]["not_retried"] == {
        "succeeded": 0,
        "uncertain": 2,
        "uncertain_custom_ids": uncertain,
    }
    assert r.json()["retry"]["lines"] == 1


async def test_a_message_batch_retry_is_a_message_batch_of_its_errored_requests(service):
    engine = Flaky(service)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    headers = {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}
    body = {
        "requests": [
            {
                "custom_id": f"m{i}",
                "params": {
                    "model": "kettei-core",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "flaky" if i == 2 else "Hi."}],
                },
            }
            for i in range(3)
        ]
    }
    async with asgi_client(service, worker=False) as http:
        batch = (await http.post("/v1/messages/batches", json=body, headers=headers)).json()
        await worker(service).run_until_idle()
        r = await http.post(f"/v1/messages/batches/{batch['id']}/retry", headers=headers)
        engine.healed = True
        await worker(service).run_until_idle()
        results = await http.get(f"/v1/messages/batches/{r.json()['id']}/results", headers=headers)
    assert r.status_code == 200, r.text
    retry = r.json()
    assert retry["type"] == "message_batch" and retry["retry_of"] == batch["id"]
    assert retry["request_counts"]["processing"] == 1 and retry["retry"]["lines"] == 1
    lines = [json.loads(x) for x in results.text.splitlines() if x]
    assert [(x["custom_id"], x["result"]["type"]) for x in lines] == [("m2", "succeeded")]


async def test_a_deferred_batch_is_not_retried_here_and_another_org_sees_nothing(market):
    svc = market(feed_route("spot"))
    acct = make_account(svc)
    other = make_account(svc, "globex")
    async with asgi_client(svc, worker=False) as http:
        bid = (await submit(http, acct.headers, batch_body(1))).json()["id"]
        mine = await http.post(f"/v1/batches/{bid}/retry", headers=acct.headers)
        theirs = await http.post(f"/v1/batches/{bid}/retry", headers=other.headers)
    assert mine.status_code == 409 and mine.json()["error"]["code"] == "retry_unsupported"
    assert theirs.status_code == 404


async def test_a_line_the_upstream_refused_with_503_is_sent_again_by_the_worker(make_service):
    # The automatic retry is the runner's, shared by every kind: a file batch's line the
    # upstream answered 503 (it took nothing) is sent again and answered, not failed.
    with FakeUpstream(mode="echo") as up:
        svc = make_service(catalog=http_catalog(up.base_url))
        acct = make_account(svc, credit="1")
        up.fail_next(1, status=503)
        async with asgi_client(svc, worker=False) as http:
            f = (await upload(http, acct.headers, jsonl([chat_line("r0"), chat_line("r1")]))).json()
            batch = (await create(http, acct.headers, f["id"])).json()
            files = asyncio.create_task(worker(svc).run_until_idle())
            while not files.done():
                svc.clock.advance(1.0)  # the pause before the line is sent again
                await asyncio.sleep(0.01)
            await files
            done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
    assert done["status"] == "completed"
    counts = done["request_counts"]
    assert (counts["total"], counts["completed"], counts["failed"]) == (2, 2, 0)
    assert up.statuses[503] == 1 and up.statuses[200] == 2
