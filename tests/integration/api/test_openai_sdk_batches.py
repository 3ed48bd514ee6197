"""The official ``openai`` SDK, unchanged, drives Files and Batches on the embedded model.

``files.create`` → ``batches.create`` → ``batches.retrieve`` until completed →
``files.content(output_file_id)``, against a live server on loopback with its
own background worker and the real SmolLM2 model. Every object the server
sends is validated strictly against the SDK's own types (``FileObject``,
``Batch``, ``ChatCompletion``), not only loaded the lenient way the SDK does.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Batch, FileDeleted, FileObject
from openai.types.chat import ChatCompletion

from batchyard.core.clock import SystemClock
from tests.support.accounts import make_account
from tests.support.deferred_batches import batch_body, submit
from tests.support.file_batches import chat_line, jsonl
from tests.support.server import live_server
from tests.support.waits import HANG_S, until

pytestmark = pytest.mark.model


def strict(model: type, raw: dict) -> None:
    model.model_validate(raw, strict=True)


async def test_files_and_batches_with_the_official_sdk_on_the_embedded_model(make_service):
    service = make_service(clock=SystemClock())
    acct = make_account(service, credit="1")
    lines = [
        chat_line("greet", "Say hello.", max_tokens=8),
        chat_line("count", "Count to three.", max_tokens=8, temperature=0),
    ]
    async with live_server(service) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=acct.key, max_retries=0)
        raw = await client.files.with_raw_response.create(
            file=("requests.jsonl", jsonl(lines)), purpose="batch"
        )
        strict(FileObject, raw.http_response.json())
        uploaded = raw.parse()
        assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))

        raw = await client.batches.with_raw_response.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"suite": "sdk"},
        )
        strict(Batch, raw.http_response.json())
        batch = raw.parse()
        assert batch.status == "in_progress" and batch.request_counts.total == 2

        async def ended() -> bool:
            nonlocal batch
            raw = await client.batches.with_raw_response.retrieve(batch.id)
            strict(Batch, raw.http_response.json())
            batch = raw.parse()
            return batch.status in ("completed", "failed", "expired", "cancelled")

        await until(ended, "the batch ends", interval=0.5)
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == 2 and batch.output_file_id

        content = await client.files.content(batch.output_file_id)
        out = [json.loads(x) for x in content.text.splitlines()]
        assert [x["custom_id"] for x in out] == ["greet", "count"]
        for x in out:
            assert x["error"] is None and x["response"]["status_code"] == 200
            strict(ChatCompletion, x["response"]["body"])
            assert x["response"]["body"]["usage"]["completion_tokens"] <= 8

        raw = await client.files.with_raw_response.retrieve(batch.output_file_id)
        strict(FileObject, raw.http_response.json())
        assert raw.parse().bytes == len(content.content)

        # A deferred batch shows in the same listing, and both validate.
        async with httpx.AsyncClient(base_url=base, timeout=HANG_S) as http:
            assert (await submit(http, acct.headers, batch_body(1))).status_code == 201
        raw = await client.batches.with_raw_response.list(limit=10)
        page = raw.http_response.json()
        assert len(page["data"]) == 2 and page["has_more"] is False
        for item in page["data"]:
            strict(Batch, item)
        listed = [b.id async for b in client.batches.list(limit=1)]
        assert batch.id in listed and len(listed) == 2
        files = [f async for f in client.files.list()]
        for f in files:
            strict(FileObject, f.model_dump(exclude_unset=True))

        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(batch.id)
        with pytest.raises(openai.ConflictError):
            await _in_use(client)
        raw = await client.files.with_raw_response.delete(uploaded.id)
        strict(FileDeleted, raw.http_response.json())
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(uploaded.id)
        await client.close()


async def _in_use(client: openai.AsyncOpenAI) -> None:
    """Deleting the input of a batch still running is refused (409 ``file_in_use``)."""
    f = await client.files.create(
        file=("one.jsonl", jsonl([chat_line("one", max_tokens=4)])), purpose="batch"
    )
    await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    await client.files.delete(f.id)


async def test_a_file_with_invalid_lines_uploads_and_its_batch_fails_with_the_sdk(make_service):
    """OpenAI's order: ``files.create`` takes any lines, JSON or not; the batch fails."""
    from batchyard.store import ledger

    service = make_service(clock=SystemClock())
    acct = make_account(service, credit="1")
    lines = [
        chat_line("good", "Say hello.", max_tokens=8),
        chat_line("bad-model", "Say hello.", model="no-such-model"),
        {**chat_line("bad-method"), "method": "GET"},
        chat_line("good"),  # a custom_id seen before
        '{"custom_id": "cut", "method": "POST"',  # not JSON
    ]
    async with live_server(service, worker=False) as base:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=acct.key, max_retries=0)
        uploaded = await client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
        raw = await client.batches.with_raw_response.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        strict(Batch, raw.http_response.json())
        batch = raw.parse()
        again = await client.batches.retrieve(batch.id)
    assert batch.status == again.status == "failed", batch
    assert batch.errors is not None and batch.errors.data is not None
    got = [(e.code, e.line, e.param) for e in batch.errors.data]
    assert got == [
        ("unknown_model", 2, "body.model"),
        ("invalid_method", 3, "method"),
        ("duplicate_custom_id", 4, "custom_id"),
        ("invalid_json", 5, None),
    ]
    assert all(e.message and e.message.startswith(f"line {e.line}:") for e in batch.errors.data)
    assert batch.errors.object == "list" and batch.request_counts.total == 0
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0 and bal.settled == 0
