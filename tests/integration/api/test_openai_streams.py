"""Streams, completions and embeddings over real HTTP: OpenAI's shapes, billed exactly.

Streams are read over a real socket (``live_server``): in-process transports
hand back a whole body at once, and a client that hangs up half-way is the
subject of one test here.
"""

from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy import func, select

from batchyard.engines.scripted import ScriptedEngine
from batchyard.store import accounts, activity, ledger
from batchyard.store.tables import idempotency_keys
from tests.support.accounts import make_account
from tests.support.deferred_batches import eventually
from tests.support.server import asgi_client, live_server
from tests.support.waits import HANG_S, until

CHAT = {
    "model": "kettei-core",
    "messages": [{"role": "user", "content": "Say hi"}],
    "max_tokens": 16,
    "stream": True,
    "stream_options": {"include_usage": True},
}
ANSWER = "one two three four five six"


@pytest.fixture
def engine(service):
    eng = ScriptedEngine(ANSWER, clock=service.clock)
    service.engines.set("embedded", eng)
    return eng


def events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def charges(service, org_id):
    rows = service.db.read_sync(lambda c: activity.list_activity(c, org_id, limit=100))
    return [r for r in rows if r["kind"] == "charge"]


async def test_a_stream_is_chunks_then_usage_then_done_and_billed_once(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post("/v1/chat/completions", json=CHAT, headers=acct.headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == ANSWER
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == 2
    [charge] = charges(service, acct.org_id)
    assert charge["detail"]["output_tokens"] == 6
    assert r.headers["x-ratelimit-limit-requests"] == "30"


async def test_a_replayed_stream_is_the_saved_answer_as_a_stream(service, engine):
    acct = make_account(service, credit="1")
    h = {**acct.headers, "Idempotency-Key": "stream-1"}
    async with asgi_client(service) as http:
        first = await http.post("/v1/chat/completions", json=CHAT, headers=h)
        again = await http.post("/v1/chat/completions", json=CHAT, headers=h)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["content-type"].startswith("text/event-stream")
    replay = events(again.text)
    assert replay[-1] == "[DONE]"
    assert replay[0]["choices"][0]["delta"]["content"] == ANSWER
    assert replay[0]["id"] == events(first.text)[0]["id"]
    assert replay[-2]["usage"]["completion_tokens"] == 6
    assert len(engine.calls) == 1 and len(charges(service, acct.org_id)) == 1


async def test_a_client_that_hangs_up_half_way_pays_for_what_was_produced(service, engine):
    """Words come a clock second apart; the client reads two and goes away."""
    engine.stream_delay_s = 1.0
    acct = make_account(service, credit="1")
    async with (
        live_server(service) as base,
        httpx.AsyncClient(base_url=base, timeout=HANG_S) as http,
    ):
        async with http.stream(
            "POST", "/v1/chat/completions", json=CHAT, headers=acct.headers
        ) as r:
            seen = []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                    if delta:
                        seen.append(delta)
                if len(seen) == 2:
                    break
                service.clock.advance(1.0)
        # Hung up; the server notices, stops the stream and settles.
        await until(lambda: bool(charges(service, acct.org_id)), "the stopped stream is charged")
    [charge] = charges(service, acct.org_id)
    assert charge["detail"]["stopped"]
    assert 2 <= charge["detail"]["output_tokens"] < 6
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0
    assert service.db.read_sync(ledger.audit) == []


async def test_completions_and_embeddings_answer_in_openais_shape(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        text = await http.post(
            "/v1/completions",
            json={"model": "kettei-core", "prompt": "Count:", "max_tokens": 3, "echo": True},
            headers=acct.headers,
        )
        emb = await http.post(
            "/v1/embeddings",
            json={"model": "kettei-core", "input": ["a b", "c"], "dimensions": 4},
            headers=acct.headers,
        )
        b64 = await http.post(
            "/v1/embeddings",
            json={"model": "kettei-core", "input": "a b", "encoding_format": "base64"},
            headers=acct.headers,
        )
    assert text.status_code == 200, text.text
    body = text.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Count:one two three"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert emb.status_code == 200, emb.text
    data = emb.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and len(data[0]["embedding"]) == 4
    assert isinstance(b64.json()["data"][0]["embedding"], str)
    assert engine.embed_calls == [["a b", "c"], ["a b"]]


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/v1/completions", {"model": "kettei-core", "prompt": [100256]}, "invalid_request"),
        (
            "/v1/completions",
            {"model": "kettei-core", "prompt": "a", "suffix": "b"},
            "capability_unsupported",
        ),
        ("/v1/embeddings", {"model": "kettei-core", "input": ""}, "invalid_request"),
        ("/v1/embeddings", {"model": "kettei-core", "input": "a", "colour": 1}, "unknown_field"),
        ("/v1/embeddings", {"model": "nope", "input": "a"}, "model_not_found"),
    ],
)
async def test_refusals_are_coded_and_cost_nothing(service, engine, path, body, code):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post(path, json=body, headers=acct.headers)
    assert r.json()["error"]["code"] == code, r.text
    assert r.headers["x-should-retry"] == "false"
    assert engine.calls == [] and engine.embed_calls == []


async def test_non_finite_numbers_are_not_json(service, engine):
    acct = make_account(service, credit="1")
    raw = (
        b'{"model": "kettei-core", "messages": [{"role": "user", "content": "x"}],'
        b' "temperature": NaN}'
    )
    async with asgi_client(service) as http:
        r = await http.post(
            "/v1/chat/completions",
            content=raw,
            headers={**acct.headers, "content-type": "application/json"},
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


async def test_request_ids_are_on_every_answer_and_a_sane_one_is_kept(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        mine = await http.get("/v1/models", headers={**acct.headers, "x-request-id": "trace-42"})
        anon = await http.get("/v1/models")
        odd = await http.get("/nowhere", headers={"x-request-id": "a b\\c"})
    assert mine.headers["x-request-id"] == "trace-42"
    assert anon.status_code == 401 and anon.headers["x-request-id"].startswith("req_")
    assert odd.status_code == 404 and odd.headers["x-request-id"].startswith("req_")
    assert mine.headers["x-ratelimit-remaining-requests"] == "5"
    assert "x-ratelimit-limit-requests" not in anon.headers


async def test_log_lines_carry_the_request_id(service, engine, caplog):
    import logging

    from batchyard.logs import JsonFormatter

    acct = make_account(service, credit="1")
    caplog.set_level(logging.DEBUG, logger="batchyard")
    async with asgi_client(service) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": False, "stream_options": None},
            headers={**acct.headers, "x-request-id": "trace-7"},
        )
    assert r.status_code == 200, r.text
    lines = [json.loads(JsonFormatter().format(rec)) for rec in caplog.records]
    answered = [line for line in lines if line["msg"] == "answered"]
    assert answered and answered[0]["request_id"] == "trace-7"
    assert answered[0]["status"] == 200


async def test_a_keyed_stream_under_zero_data_retention_keeps_nothing_and_frees_its_key(
    service, engine
):
    """``run_once``'s rule for streams too: nothing kept, and the key runs again (not 409)."""
    acct = make_account(service, credit="1")
    service.db.transact_sync(lambda c: accounts.set_zero_data_retention(c, acct.org_id, True))
    h = {**acct.headers, "Idempotency-Key": "zdr-stream"}
    async with asgi_client(service) as http:
        first = await http.post("/v1/chat/completions", json=CHAT, headers=h)
        again = await http.post("/v1/chat/completions", json=CHAT, headers=h)
    assert first.status_code == again.status_code == 200, again.text
    assert "Idempotent-Replayed" not in again.headers
    assert events(again.text)[-1] == "[DONE]"
    assert len(engine.calls) == 2 and len(charges(service, acct.org_id)) == 2
    kept = service.db.read_sync(
        lambda c: c.execute(select(func.count()).select_from(idempotency_keys)).scalar_one()
    )
    assert kept == 0


async def test_a_keyed_stream_cut_short_frees_its_key_for_the_retry(service, engine):
    """The client reads two words and hangs up: its retry with the key runs, whole."""
    engine.stream_delay_s = 1.0
    acct = make_account(service, credit="1")
    h = {**acct.headers, "Idempotency-Key": "cut-short"}
    async with (
        live_server(service) as base,
        httpx.AsyncClient(base_url=base, timeout=HANG_S) as http,
    ):
        async with http.stream("POST", "/v1/chat/completions", json=CHAT, headers=h) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    seen += 1
                if seen == 3:
                    break
                service.clock.advance(1.0)
        await eventually(lambda: bool(charges(service, acct.org_id)))
        engine.stream_delay_s = 0.0

        async def freed() -> bool:  # the key is freed just after the partial charge
            nonlocal retry
            retry = await http.post("/v1/chat/completions", json=CHAT, headers=h)
            return retry.status_code != 409

        retry = None
        await until(freed, "the key is freed", interval=0.02)
        assert retry is not None
    assert retry.status_code == 200 and "Idempotent-Replayed" not in retry.headers
    text = "".join(
        c["choices"][0]["delta"].get("content", "") for c in events(retry.text)[:-1] if c["choices"]
    )
    assert text == ANSWER
    assert len(engine.calls) == 2
