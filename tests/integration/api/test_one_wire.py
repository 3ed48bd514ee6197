"""One answer, whichever way it was asked for: the door, a file batch, a deferred batch.

The same engine answers the same request on each path; read by the official
SDKs' own types, the bodies are the same object but for their ID and time (and
the batchyard fields each path adds beside the provider's: ``charge``, where
it ran). Before the wire layer was one, a file batch's chat completion had no
``refusal`` and no ``system_fingerprint``, its token logprobs no
``top_logprobs`` (which the SDK requires), and a deferred batch's had no
``logprobs`` either; a file batch's text completion dropped ``echo`` and
``logprobs``, its embeddings ``dimensions``, and a Message Batch's message the
stop sequence that ended it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from anthropic.types import Message
from openai.types import Completion as TextCompletion
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from batchyard.engines.protocol import Completion, CompletionRequest
from batchyard.engines.scripted import ScriptedEngine
from tests.support.accounts import make_account
from tests.support.deferred_batches import chat, submit
from tests.support.deferred_batches import worker as deferred_batch_worker
from tests.support.file_batches import create, jsonl, parse_lines, upload
from tests.support.file_batches import worker as file_worker
from tests.support.server import asgi_client

ANSWER = "release summary"


class CachingEngine(ScriptedEngine):
    """The scripted answer, with two prompt tokens read from a prompt cache, as llama.cpp's."""

    async def complete(self, request: CompletionRequest) -> Completion:
        done = await super().complete(request)
        return dataclasses.replace(
            done, usage=dataclasses.replace(done.usage, cached_input_tokens=2)
        )


class StopReportingEngine(CachingEngine):
    """Says which stop sequence ended the answer, as vLLM does (``stop_reason``)."""

    async def complete(self, request: CompletionRequest) -> Completion:
        done = await super().complete(request)
        if not request.stop:
            return done
        return dataclasses.replace(done, raw={"choices": [{"stop_reason": request.stop[0]}]})


def _engine(service, kind: type[CachingEngine] = CachingEngine) -> CachingEngine:
    engine = kind(ANSWER, clock=service.clock)
    service.engines.set("embedded", engine)  # kettei-core's route, 95 % off (deferred runs)
    return engine


def same_object(sdk_type: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """``body`` read as the SDK's type: what it sets of the type's own fields, less ID and time.

    ``exclude_unset`` keeps a field the body left out apart from one it sent as
    null, so a missing ``refusal`` or ``logprobs`` is a difference.
    """
    read = sdk_type.model_validate(body).model_dump(exclude_unset=True)
    return {
        k: v for k, v in read.items() if k in sdk_type.model_fields and k not in ("id", "created")
    }


async def _file_batch(http, headers, endpoint: str, body: dict[str, Any], service) -> dict:
    """``body`` run as the one line of a file batch; the body of its answer."""
    line = {"custom_id": "a", "method": "POST", "url": endpoint, "body": body}
    f = (await upload(http, headers, jsonl([line]))).json()
    batch = (await create(http, headers, f["id"], endpoint=endpoint)).json()
    await file_worker(service).run_until_idle()
    done = (await http.get(f"/v1/batches/{batch['id']}", headers=headers)).json()
    assert done["status"] == "completed", done
    out = await http.get(f"/v1/files/{done['output_file_id']}/content", headers=headers)
    (answered,) = parse_lines(out.content)
    return answered["response"]["body"]


async def test_a_chat_completion_is_one_object_from_the_door_a_file_batch_and_a_deferred_batch(
    service,
):
    _engine(service)
    acct = make_account(service, credit="1")
    body = chat()
    async with asgi_client(service, worker=False) as http:
        door = await http.post("/v1/chat/completions", json=body, headers=acct.headers)
        assert door.status_code == 200, door.text
        filed = await _file_batch(http, acct.headers, "/v1/chat/completions", body, service)
        batch = {"min_discount": 90, "requests": [{"custom_id": "a", "body": body}]}
        deferred = (await submit(http, acct.headers, batch)).json()
        assert (await deferred_batch_worker(service).run_pass()).succeeded == 1
        results = await http.get(deferred["results_url"], headers=acct.headers)
    (line,) = [json.loads(x) for x in results.content.splitlines()]
    bodies = [door.json(), filed, line["result"]["body"]]

    door_view, file_view, deferred_view = (same_object(ChatCompletion, b) for b in bodies)
    assert door_view == file_view == deferred_view
    assert door_view["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ANSWER, "refusal": None},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    assert door_view["system_fingerprint"] is None
    assert door_view["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    # batchyard's own fields ride beside OpenAI's, each path's as before.
    assert {"charge", "reservation_id", "created_at"} <= bodies[0].keys()
    assert {"charge", "route"} <= bodies[1].keys()
    assert {"charge", "route", "reservation_id", "created_at"} <= bodies[2].keys()


async def test_logprobs_are_the_same_from_the_door_and_a_file_batch_and_read_by_the_sdk(service):
    _engine(service)
    acct = make_account(service, credit="1")
    body = chat("Say it.", logprobs=True)
    async with asgi_client(service, worker=False) as http:
        door = (await http.post("/v1/chat/completions", json=body, headers=acct.headers)).json()
        filed = await _file_batch(http, acct.headers, "/v1/chat/completions", body, service)
    assert same_object(ChatCompletion, door) == same_object(ChatCompletion, filed)
    logprobs = ChatCompletion.model_validate(filed).choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.token for t in logprobs.content] == ANSWER.split()
    assert all(t.top_logprobs == [] for t in logprobs.content)


async def test_a_text_completion_line_echoes_and_has_logprobs_as_the_door_does(service):
    _engine(service)
    acct = make_account(service, credit="1")
    body = {
        "model": "kettei-core",
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "echo": True,
        "logprobs": 0,
    }
    async with asgi_client(service, worker=False) as http:
        door = (await http.post("/v1/completions", json=body, headers=acct.headers)).json()
        filed = await _file_batch(http, acct.headers, "/v1/completions", body, service)
    assert same_object(TextCompletion, door) == same_object(TextCompletion, filed)
    choice = TextCompletion.model_validate(filed).choices[0]
    assert choice.text == "Once upon a time" + ANSWER
    assert choice.logprobs is not None and choice.logprobs.tokens == ANSWER.split()


async def test_an_embeddings_line_keeps_its_dimensions_and_encoding_as_the_door_does(service):
    _engine(service)
    acct = make_account(service, credit="1")
    body = {"model": "kettei-core", "input": ["first text", "second text"], "dimensions": 3}
    packed = {**body, "encoding_format": "base64"}
    async with asgi_client(service, worker=False) as http:
        door = (await http.post("/v1/embeddings", json=body, headers=acct.headers)).json()
        filed = await _file_batch(http, acct.headers, "/v1/embeddings", body, service)
        door_packed = (await http.post("/v1/embeddings", json=packed, headers=acct.headers)).json()
        filed_packed = await _file_batch(http, acct.headers, "/v1/embeddings", packed, service)
    view = same_object(CreateEmbeddingResponse, filed)
    assert same_object(CreateEmbeddingResponse, door) == view
    assert [len(d["embedding"]) for d in view["data"]] == [3, 3]
    # The SDK decodes base64 before its type reads it: the raw data is compared.
    assert door_packed["data"] == filed_packed["data"]
    assert [len(d["embedding"]) for d in filed_packed["data"]] == [16, 16]  # 3 float32s


async def test_a_message_batch_answers_the_message_the_door_answers(service):
    _engine(service, StopReportingEngine)
    acct = make_account(service, credit="1")
    anthropic = {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}
    params = {
        "model": "kettei-core",
        "max_tokens": 16,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say hi."}],
        "stop_sequences": ["###"],
    }
    async with asgi_client(service, worker=False) as http:
        door = (await http.post("/v1/messages", json=params, headers=anthropic)).json()
        batch = {"requests": [{"custom_id": "a", "params": params}]}
        made = (await http.post("/v1/messages/batches", json=batch, headers=anthropic)).json()
        await file_worker(service).run_until_idle()
        out = await http.get(f"/v1/messages/batches/{made['id']}/results", headers=anthropic)
    (line,) = [json.loads(x) for x in out.text.splitlines()]
    view = same_object(Message, door)
    assert view == same_object(Message, line["result"]["message"])
    assert (view["stop_reason"], view["stop_sequence"]) == ("stop_sequence", "###")
    # The two cached prompt tokens are counted apart, as Anthropic counts cache reads.
    # The scripted engine counts the prompt's words: "Be brief." and "Say hi." are 4.
    usage = view["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (4 - 2, 2)


async def test_a_message_stream_says_at_its_end_what_the_cache_gave(service):
    """message_start counts the whole prompt; message_delta splits it as Anthropic does."""
    _engine(service)
    acct = make_account(service, credit="1")
    anthropic = {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}
    params = {
        "model": "kettei-core",
        "max_tokens": 16,
        "stream": True,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say hi."}],
    }
    async with asgi_client(service, worker=False) as http:
        r = await http.post("/v1/messages", json=params, headers=anthropic)
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
    start = next(e for e in events if e["type"] == "message_start")
    delta = next(e for e in events if e["type"] == "message_delta")
    assert start["message"]["usage"]["input_tokens"] >= 4
    assert (delta["usage"]["input_tokens"], delta["usage"]["cache_read_input_tokens"]) == (2, 2)
