"""The official ``anthropic`` SDK, unchanged, drives Message Batches on the embedded model.

``messages.batches.create`` → ``retrieve`` until ended → ``results``, then
``list`` and ``cancel``, against a live server on loopback with its own
background worker and the real SmolLM2 model. Every object is validated
strictly against the SDK's own types from the raw JSON and walked for fields
the types do not declare.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from anthropic.types import Message
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
from pydantic import BaseModel

from batchyard.core.clock import SystemClock
from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.server import live_server
from tests.support.waits import until

pytestmark = pytest.mark.model


def no_unknown_fields(obj: Any, where: str) -> None:
    if isinstance(obj, BaseModel):
        assert not obj.model_extra, f"{where}: unknown {obj.model_extra}"
        for name in type(obj).model_fields:
            no_unknown_fields(getattr(obj, name), f"{where}.{name}")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            no_unknown_fields(item, f"{where}[{i}]")


def exactly(model: type[BaseModel], text: str) -> Any:
    parsed = model.model_validate_json(text, strict=True)
    no_unknown_fields(parsed, model.__name__)
    return parsed


def request(cid: str, text: str) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "params": {
            "model": "kettei-core",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": text}],
        },
    }


async def test_message_batches_with_the_official_sdk_on_the_embedded_model(make_service):
    service = make_service(clock=SystemClock())
    acct = make_account(service, credit="1")
    async with live_server(service) as base:
        client = anthropic.AsyncAnthropic(base_url=base, api_key=acct.key)
        raw = await client.messages.batches.with_raw_response.create(
            requests=[request("greet", "Say hello."), request("count", "Count to three.")]
        )
        batch = exactly(MessageBatch, raw.text)
        assert batch.processing_status == "in_progress" and batch.results_url is None
        assert batch.request_counts.processing == 2

        async def ended() -> bool:
            nonlocal batch
            raw = await client.messages.batches.with_raw_response.retrieve(batch.id)
            batch = exactly(MessageBatch, raw.text)
            return batch.processing_status == "ended"

        await until(ended, "the batch ends", interval=0.5)
        assert batch.request_counts.succeeded == 2 and batch.results_url

        got = [r async for r in await client.messages.batches.results(batch.id)]
        assert [r.custom_id for r in got] == ["greet", "count"]
        for r in got:
            no_unknown_fields(r, "result")
            exactly(MessageBatchIndividualResponse, r.model_dump_json(exclude_unset=True))
            assert r.result.type == "succeeded"
            message = r.result.message
            exactly(Message, message.model_dump_json(exclude_unset=True))
            assert 1 <= message.usage.output_tokens <= 8

        second = await client.messages.batches.create(requests=[request("later", "Hi.")])
        listed = [b.id async for b in client.messages.batches.list(limit=1)]
        assert listed == [second.id, batch.id]
        page = await client.messages.batches.with_raw_response.list(limit=10)
        assert json.loads(page.text)["has_more"] is False
        canceled = await client.messages.batches.cancel(second.id)
        assert canceled.processing_status in ("canceling", "ended")
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.batches.retrieve("bat.nope")

        # The worker finishes (or cancels) the second batch; nothing stays held.
        async def second_ended() -> bool:
            got = await client.messages.batches.retrieve(second.id)
            return got.processing_status == "ended"

        await until(second_ended, "the second batch ends", interval=0.5)
        await client.close()
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0 and bal.settled > 0
    assert service.db.read_sync(ledger.audit) == []
