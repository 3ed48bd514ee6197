"""Following a batch while it runs (``/finished``): every item once, in the final format.

Each test lets the engine answer one call at a time, reads the finished
items in small pages from a cursor between answers, and checks at the end
that what was read, in pieces, while the batch ran, is exactly the final
results: every item once, each line as the output or error file holds it.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from batchyard.client import AsyncClient
from batchyard.engines.protocol import Completion, CompletionRequest
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import ModelOutputInvalid
from batchyard.service import Service
from tests.support.accounts import make_account
from tests.support.clocks import ReleasingClock
from tests.support.deferred_batches import (
    batch_body,
    eventually,
    feed_route,
    set_price,
    submit,
)
from tests.support.deferred_batches import worker as deferred_worker
from tests.support.file_batches import (
    chat_line,
    create,
    jsonl,
    lines_of,
    parse_lines,
    upload,
    worker,
)
from tests.support.following import read_pages
from tests.support.server import asgi_client


class OneAtATime:
    """Answers one call per ``release()``; a prompt naming ``fail`` fails at once."""

    name = "one-at-a-time"

    def __init__(self, service: Service) -> None:
        self._inner = ScriptedEngine("an answer", clock=service.clock)
        self._gate = asyncio.Semaphore(0)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.release()

    async def complete(self, request: CompletionRequest) -> Completion:
        if "fail" in json.dumps(request.messages):
            raise ModelOutputInvalid("the model answered outside the schema")
        await self._gate.acquire()
        return await self._inner.complete(request)

    async def aclose(self) -> None:
        return None


def ended_lines(service: Service, batch_id: str) -> int:
    """How many of the batch's lines have ended, read from the store."""
    return sum(1 for r in lines_of(service, batch_id) if r.state not in ("pending", "dispatched"))


async def test_a_file_batch_read_in_pieces_while_it_runs_is_its_final_files(service):
    engine = OneAtATime(service)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    texts = ["fail please" if i % 5 == 3 else f"Say hi to {i}." for i in range(14)]
    lines = [chat_line(f"r{i}", text) for i, text in enumerate(texts)]
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl(lines))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        path = f"/v1/batches/{batch['id']}/finished"

        first = await http.get(path, headers=acct.headers)
        assert first.json() == {
            "object": "list",
            "data": [],
            "cursor": "0",
            "has_more": False,
            "ended": False,
        }
        running = asyncio.create_task(worker(service).run_until_idle())
        seen: list[dict[str, Any]] = []
        cursor, read_while_running, ended_so_far = "0", 0, 0
        while ended_so_far < len(lines):
            engine.release()
            await eventually(lambda n=ended_so_far: ended_lines(service, batch["id"]) > n)
            ended_so_far = ended_lines(service, batch["id"])
            got, cursor, ended = await read_pages(http, path, acct.headers, cursor, limit=3)
            seen += got
            if not ended:
                read_while_running += len(got)
        await running
        got, cursor, ended = await read_pages(http, path, acct.headers, cursor, limit=3)
        seen += got
        assert ended
        done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
        out = await http.get(f"/v1/files/{done['output_file_id']}/content", headers=acct.headers)
        err = await http.get(f"/v1/files/{done['error_file_id']}/content", headers=acct.headers)

    assert read_while_running >= len(lines) // 2  # most were read while the batch ran
    assert Counter(x["custom_id"] for x in seen) == Counter(f"r{i}" for i in range(14))
    final = parse_lines(out.content) + parse_lines(err.content)
    assert sorted(seen, key=lambda x: x["custom_id"]) == sorted(final, key=lambda x: x["custom_id"])
    assert len(parse_lines(err.content)) == 3


async def test_a_page_past_the_end_is_empty_and_a_bad_cursor_is_a_coded_400(service):
    service.engines.set("embedded", ScriptedEngine("ok", clock=service.clock))
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a"), chat_line("b")]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        await worker(service).run_until_idle()
        path = f"/v1/batches/{batch['id']}/finished"
        whole = (await http.get(path, headers=acct.headers)).json()
        after = {"after": whole["cursor"]}
        past = (await http.get(path, params=after, headers=acct.headers)).json()
        bad = await http.get(path, params={"after": "-1"}, headers=acct.headers)
        extra = await http.get(path, params={"order": "desc"}, headers=acct.headers)
        other = make_account(service, "globex", credit="1")
        hidden = await http.get(path, headers=other.headers)
    assert sorted(x["custom_id"] for x in whole["data"]) == ["a", "b"]
    assert whole["ended"] is True and whole["has_more"] is False
    assert past == {
        "object": "list",
        "data": [],
        "cursor": whole["cursor"],
        "has_more": False,
        "ended": True,
    }
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_cursor"
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "order"
    assert hidden.status_code == 404


async def test_a_message_batch_followed_gives_its_results_lines(service):
    engine = OneAtATime(service)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    headers = {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}
    body = {
        "requests": [
            {
                "custom_id": f"m{i}",
                "params": {
                    "model": "kettei-core",
                    "max_tokens": 16,
                    "messages": [{"role": "user", "content": f"Say hi to {i}."}],
                },
            }
            for i in range(5)
        ]
    }
    async with asgi_client(service, worker=False) as http:
        batch = (await http.post("/v1/messages/batches", json=body, headers=headers)).json()
        path = f"/v1/messages/batches/{batch['id']}/finished"
        running = asyncio.create_task(worker(service).run_until_idle())
        engine.release(2)
        await eventually(lambda: ended_lines(service, batch["id"]) >= 2)
        early, cursor, ended = await read_pages(http, path, headers, "0", limit=1)
        assert len(early) == 2 and not ended
        engine.release(3)
        await running
        rest, cursor, ended = await read_pages(http, path, headers, cursor, limit=2)
        final = await http.get(f"/v1/messages/batches/{batch['id']}/results", headers=headers)
    assert ended
    lines = [json.loads(x) for x in final.text.splitlines() if x]
    key = lambda x: x["custom_id"]  # noqa: E731
    assert sorted(early + rest, key=key) == sorted(lines, key=key)
    assert all(x["result"]["type"] == "succeeded" for x in early + rest)


async def test_the_python_client_follows_a_batch_to_its_end(service):
    engine = OneAtATime(service)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    lines = [chat_line(f"c{i}", f"Say hi to {i}.") for i in range(6)]

    async with asgi_client(service, worker=True) as http:
        f = (await upload(http, acct.headers, jsonl(lines))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        ticks = ReleasingClock(
            lambda: ended_lines(service, batch["id"]), len(lines), engine.release
        )
        client = AsyncClient(
            base_url=str(http.base_url), api_key=acct.key, http_client=http, clock=ticks
        )
        followed = [x async for x in client.follow_batch(batch["id"], poll=1.0)]
    assert sorted(x["custom_id"] for x in followed) == [f"c{i}" for i in range(6)]
    assert all(x["response"]["status_code"] == 200 for x in followed)


async def test_a_deferred_batch_followed_pass_by_pass_is_its_results(market, clock):
    svc = market(feed_route("spot"))
    svc.engines.set("spot", ScriptedEngine("answer", clock=clock))
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        bid = (await submit(http, acct.headers, batch_body(12))).json()["id"]
        path = f"/v1/batches/{bid}/finished"
        set_price(svc, "spot", "0.001", "0.004")
        await deferred_worker(svc).run_pass()  # ten a pass, as the spec says
        first, cursor, ended = await read_pages(http, path, acct.headers, "0", limit=4)
        assert len(first) == 10 and not ended
        clock.advance(15)
        await deferred_worker(svc).run_pass()
        rest, cursor, ended = await read_pages(http, path, acct.headers, cursor, limit=4)
        res = await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)
    assert ended and len(rest) == 2
    final = [json.loads(x) for x in res.content.splitlines()]
    key = lambda x: x["custom_id"]  # noqa: E731
    assert sorted(first + rest, key=key) == sorted(final, key=key)
    assert all(x["status"] == "succeeded" for x in final)


async def test_canceled_items_are_followed_once_each(market):
    svc = market(feed_route("spot"))
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        bid = (await submit(http, acct.headers, batch_body(3))).json()["id"]
        await http.post(f"/v1/batches/{bid}/cancel", headers=acct.headers)
        got, _, ended = await read_pages(http, f"/v1/batches/{bid}/finished", acct.headers, "0", 2)
    assert ended and [x["status"] for x in got] == ["canceled"] * 3
    assert len({x["custom_id"] for x in got}) == 3
