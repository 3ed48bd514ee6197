"""Anthropic's Messages door over the real app: its shapes, its errors, the same core.

The scripted engine answers (a word is a token), so billing is predictable to
the tick; the official SDK against the embedded model is in
tests/integration/compat/test_anthropic_sdk.py.
"""

from __future__ import annotations

import json
from decimal import Decimal

import httpx
import pytest

from batchyard.core.accounts import Scope
from batchyard.engines.protocol import Choice, Completion, CompletionRequest, Usage
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import ModelWarming, UpstreamRateLimited
from batchyard.store import activity, ledger
from tests.support.accounts import add_key, make_account
from tests.support.server import asgi_client, live_server
from tests.support.waits import HANG_S, until

ANSWER = "one two three four five six"
BODY = {
    "model": "kettei-core",
    "max_tokens": 16,
    "system": "Be brief.",
    "messages": [{"role": "user", "content": "Say hi"}],
}
V = {"anthropic-version": "2023-06-01"}


class ToolEngine(ScriptedEngine):
    """Calls the first offered tool, as the embedded engine's grammar would."""

    async def complete(self, request: CompletionRequest) -> Completion:
        done = await super().complete(request)
        if not request.tools:
            return done
        name = request.tools[0]["function"]["name"]
        call = {
            "id": "call_abc123",
            "type": "function",
            "function": {"name": name, "arguments": '{"city": "Paris"}'},
        }
        choice = Choice(text="", finish_reason="tool_calls", tool_calls=[call])
        return Completion(done.model, [choice], Usage(done.usage.input_tokens, 5))


@pytest.fixture
def engine(service):
    eng = ScriptedEngine(ANSWER, clock=service.clock)
    service.engines.set("embedded", eng)
    return eng


def anthropic(acct) -> dict[str, str]:
    return {"x-api-key": acct.key, **V}


def charges(service, org_id):
    rows = service.db.read_sync(lambda c: activity.list_activity(c, org_id, limit=100))
    return [r for r in rows if r["kind"] == "charge"]


def sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def test_a_message_in_anthropics_shape_billed_as_chat_is(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post("/v1/messages", json=BODY, headers=anthropic(acct))
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["id"].startswith("msg.") and msg["model"] == "kettei-core"
    assert msg["content"] == [{"type": "text", "text": ANSWER, "citations": None}]
    assert msg["stop_reason"] == "end_turn" and msg["stop_sequence"] is None
    # The system prompt went to the engine as OpenAI's system message.
    [call] = engine.calls
    assert call.messages[0] == {"role": "system", "content": "Be brief."}
    assert msg["usage"]["input_tokens"] == 4 and msg["usage"]["output_tokens"] == 6
    [charge] = charges(service, acct.org_id)
    assert charge["detail"]["output_tokens"] == 6
    assert Decimal(r.headers["x-batchyard-charge"]) > 0
    assert r.headers["request-id"] == r.headers["x-request-id"]
    assert r.headers["x-ratelimit-limit-requests"]
    assert service.db.read_sync(ledger.audit) == []


async def test_the_bearer_key_works_and_the_version_is_read(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:

        async def at(version: str) -> httpx.Response:
            headers = {**acct.headers, "anthropic-version": version}
            return await http.post("/v1/messages", json=BODY, headers=headers)

        ok = await http.post("/v1/messages", json=BODY, headers=acct.headers)
        old = await http.post("/v1/messages", json=BODY, headers={**acct.headers, **V})
        # The 2.x SDK's date, and one no SDK has sent yet: answered in the newest shapes.
        newer = [await at(v) for v in ("2026-10-21", "2031-02-28")]
        bad = [await at(v) for v in ("latest", "2026-13-01", "2026-1-01", "2026-10-21x")]
        counted = await http.post(
            "/v1/messages/count_tokens",
            json={"model": BODY["model"], "messages": BODY["messages"]},
            headers={**acct.headers, "anthropic-version": "2026-10-21"},
        )
    assert ok.status_code == 200 and old.status_code == 200 and counted.status_code == 200
    assert [r.status_code for r in newer] == [200, 200]
    assert newer[0].json()["type"] == "message"
    assert [r.status_code for r in bad] == [400] * 4
    assert {r.json()["error"]["code"] for r in bad} == {"unsupported_anthropic_version"}


async def test_sampling_and_stops_reach_the_engine_and_max_tokens_is_reported(service, engine):
    acct = make_account(service, credit="1")
    body = {
        **BODY,
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["END"],
    }
    async with asgi_client(service) as http:
        r = await http.post("/v1/messages", json=body, headers=anthropic(acct))
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] == "max_tokens"
    assert r.json()["usage"]["output_tokens"] == 3
    [call] = engine.calls
    assert (call.temperature, call.top_p, call.top_k, call.stop) == (0.5, 0.9, 40, ["END"])


@pytest.mark.parametrize(
    ("body", "headers", "status", "kind", "code"),
    [
        ({**BODY, "max_tokens": None}, None, 400, "invalid_request_error", "invalid_type"),
        (
            {k: v for k, v in BODY.items() if k != "max_tokens"},
            None,
            400,
            "invalid_request_error",
            "invalid_request",
        ),
        ({**BODY, "frequency_penalty": 1}, None, 400, "invalid_request_error", "unknown_field"),
        ({**BODY, "temperature": "1"}, None, 400, "invalid_request_error", "invalid_type"),
        ({**BODY, "model": "nope"}, None, 404, "not_found_error", "model_not_found"),
        (
            {**BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}},
            None,
            400,
            "invalid_request_error",
            "capability_unsupported",
        ),
        (
            {**BODY, "messages": [{"role": "system", "content": "x"}]},
            None,
            400,
            "invalid_request_error",
            "invalid_request",
        ),
        (
            {**BODY, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            None,
            400,
            "invalid_request_error",
            "capability_unsupported",
        ),
        (
            {**BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            None,
            400,
            "invalid_request_error",
            "capability_unsupported",
        ),
        (
            {**BODY, "max_tokens": 10**9},
            None,
            400,
            "invalid_request_error",
            "max_tokens_out_of_range",
        ),
        (BODY, {}, 401, "authentication_error", "missing_api_key"),
        (BODY, {"x-api-key": "sk-nope"}, 401, "authentication_error", "invalid_api_key"),
    ],
)
async def test_bad_requests_are_anthropic_errors_with_a_code_and_charge_nothing(
    service, engine, body, headers, status, kind, code
):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post(
            "/v1/messages", json=body, headers=anthropic(acct) if headers is None else headers
        )
    assert r.status_code == status, r.text
    got = r.json()
    assert got["type"] == "error"
    assert got["error"]["type"] == kind and got["error"]["code"] == code
    assert got["error"]["message"]
    assert got["request_id"] == r.headers["x-request-id"]
    assert engine.calls == [] and charges(service, acct.org_id) == []


async def test_images_are_refused_by_a_text_only_model_with_a_code(service, engine):
    acct = make_account(service, credit="1")
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"},
    }
    body = {
        **BODY,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}],
    }
    async with asgi_client(service) as http:
        r = await http.post("/v1/messages", json=body, headers=anthropic(acct))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "unsupported_input"


async def test_a_read_key_is_refused_with_permission_error(service, engine):
    make_account(service, "acme", credit="1")
    reader = add_key(service, "acme", Scope.READ)
    async with asgi_client(service) as http:
        r = await http.post("/v1/messages", json=BODY, headers=anthropic(reader))
        c = await http.post("/v1/messages/count_tokens", json=BODY, headers=anthropic(reader))
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert c.status_code == 403


async def test_no_credit_is_a_billing_error_and_overload_is_529(service, engine):
    poor = make_account(service, "poor", credit="0")
    rich = make_account(service, "rich", credit="1")
    engine.fail_next(ModelWarming("loading", retry_after=2.0))
    async with asgi_client(service) as http:
        broke = await http.post("/v1/messages", json=BODY, headers=anthropic(poor))
        busy = await http.post("/v1/messages", json=BODY, headers=anthropic(rich))
    assert broke.status_code == 402 and broke.json()["error"]["type"] == "billing_error"
    assert busy.status_code == 529, busy.text
    assert busy.json()["error"]["type"] == "overloaded_error"
    assert busy.headers["retry-after"] == "2" and busy.headers["x-should-retry"] == "true"
    assert charges(service, rich.org_id) == []
    assert service.db.read_sync(ledger.audit) == []


async def test_an_upstream_429_past_its_retries_is_overloaded(service, engine):
    service.dispatcher.upstream_429_retries = 0
    acct = make_account(service, credit="1")
    engine.fail_next(UpstreamRateLimited("busy", retry_after=0.0))
    async with asgi_client(service) as http:
        r = await http.post("/v1/messages", json=BODY, headers=anthropic(acct))
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"


async def test_over_the_tier_limit_is_a_429_rate_limit_error_with_retry_after(make_service):
    service = make_service(limits_queue_s=0)
    service.engines.set("embedded", ScriptedEngine(ANSWER, clock=service.clock))
    acct = make_account(service, credit="1")
    got = []
    async with asgi_client(service) as http:
        for _ in range(service.tier(0).max_in_flight + 2):
            got.append(await http.post("/v1/messages", json=BODY, headers=anthropic(acct)))
    limited = [r for r in got if r.status_code == 429]
    assert limited, [r.status_code for r in got]
    err = limited[0]
    assert err.json()["error"]["type"] == "rate_limit_error"
    assert err.json()["error"]["code"] == "rate_limited"
    assert int(err.headers["retry-after"]) >= 1


async def test_the_same_idempotency_key_answers_once_and_replays_errors_in_the_envelope(
    service, engine
):
    acct = make_account(service, credit="1")
    h = {**anthropic(acct), "Idempotency-Key": "msg-key-1"}
    async with asgi_client(service) as http:
        first = await http.post("/v1/messages", json=BODY, headers=h)
        again = await http.post("/v1/messages", json=BODY, headers=h)
        other = await http.post("/v1/messages", json={**BODY, "max_tokens": 5}, headers=h)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert other.status_code == 409
    assert other.json()["type"] == "error"
    assert other.json()["error"]["code"] == "idempotency_conflict"
    assert len(engine.calls) == 1 and len(charges(service, acct.org_id)) == 1


async def test_tool_use_and_tool_result_map_onto_openai_tools(service):
    engine = ToolEngine(ANSWER, clock=service.clock)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    body = {**BODY, "tools": [tool], "tool_choice": {"type": "any"}}
    async with asgi_client(service) as http:
        r = await http.post("/v1/messages", json=body, headers=anthropic(acct))
        assert r.status_code == 200, r.text
        msg = r.json()
        [use] = msg["content"]
        assert msg["stop_reason"] == "tool_use"
        assert use == {
            "type": "tool_use",
            "id": "toolu_abc123",
            "name": "get_weather",
            "input": {"city": "Paris"},
        }
        sent = engine.calls[0]
        assert sent.tool_choice == "required"
        assert sent.tools == [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather in a city",
                    "parameters": tool["input_schema"],
                },
            }
        ]
        follow = {
            **BODY,
            "tools": [tool],
            "messages": [
                *BODY["messages"],
                {"role": "assistant", "content": msg["content"]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use["id"], "content": "18C, sunny"},
                        {"type": "text", "text": "So?"},
                    ],
                },
            ],
            "tool_choice": {"type": "none"},
        }
        r2 = await http.post("/v1/messages", json=follow, headers=anthropic(acct))
    assert r2.status_code == 200, r2.text
    assert r2.json()["content"][0]["type"] == "text"
    second = engine.calls[1]
    assert second.tools is None
    assert second.messages[2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    }
    assert second.messages[3] == {
        "role": "tool",
        "tool_call_id": "toolu_abc123",
        "content": "18C, sunny",
    }
    assert second.messages[4] == {"role": "user", "content": "So?"}


async def test_a_stream_is_anthropics_events_and_billed_once(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post("/v1/messages", json={**BODY, "stream": True}, headers=anthropic(acct))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    names = [name for name, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == ANSWER
    # message_start counts the prompt with the model's tokenizer (before it runs);
    # message_delta carries the engine's own usage, which is what is billed.
    start = events[0][1]["message"]
    tok = service.tokenizer(service.catalog.model("kettei-core"))
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert start["content"] == [] and start["usage"]["input_tokens"] == tok.count_messages(prompt)
    end = events[-2][1]
    assert end["delta"]["stop_reason"] == "end_turn"
    assert end["usage"] | {"input_tokens": 4, "output_tokens": 6} == end["usage"]
    [charge] = charges(service, acct.org_id)
    assert charge["detail"]["output_tokens"] == 6


async def test_a_replayed_stream_is_the_saved_message_as_events(service, engine):
    acct = make_account(service, credit="1")
    h = {**anthropic(acct), "Idempotency-Key": "stream-msg-1"}
    body = {**BODY, "stream": True}
    async with asgi_client(service) as http:
        first = await http.post("/v1/messages", json=body, headers=h)
        again = await http.post("/v1/messages", json=body, headers=h)
    assert again.headers["Idempotent-Replayed"] == "true"
    replay = sse(again.text)
    assert replay[0][1]["message"]["id"] == sse(first.text)[0][1]["message"]["id"]
    deltas = [d["delta"]["text"] for n, d in replay if n == "content_block_delta"]
    assert deltas == [ANSWER]
    assert replay[-1][0] == "message_stop"
    assert len(engine.calls) == 1 and len(charges(service, acct.org_id)) == 1


async def test_a_streamed_tool_call_is_a_tool_use_block_with_input_json(service):
    service.engines.set("embedded", ToolEngine(ANSWER, clock=service.clock))
    acct = make_account(service, credit="1")
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    body = {**BODY, "stream": True, "tools": [tool]}
    async with asgi_client(service) as http:
        r = await http.post("/v1/messages", json=body, headers=anthropic(acct))
    events = sse(r.text)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[-1] == {
        "type": "tool_use",
        "id": "toolu_abc123",
        "name": "get_weather",
        "input": {},
    }
    partial = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert partial[-1] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_a_stream_cut_short_pays_for_what_was_produced(service, engine):
    """Words come a clock second apart; the client reads two and hangs up."""
    engine.stream_delay_s = 1.0
    acct = make_account(service, credit="1")
    body = {**BODY, "stream": True}
    async with (
        live_server(service) as base,
        httpx.AsyncClient(base_url=base, timeout=HANG_S) as http,
    ):
        async with http.stream("POST", "/v1/messages", json=body, headers=anthropic(acct)) as r:
            seen = []
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text_delta"' in line:
                    seen.append(json.loads(line[6:])["delta"]["text"])
                if len(seen) == 2:
                    break
                service.clock.advance(1.0)
        await until(lambda: bool(charges(service, acct.org_id)), "the stopped stream is charged")
    [charge] = charges(service, acct.org_id)
    assert charge["detail"]["stopped"]
    assert 2 <= charge["detail"]["output_tokens"] < 6
    assert service.db.read_sync(lambda c: ledger.balance(c, acct.org_id)).held == 0
    assert service.db.read_sync(ledger.audit) == []


async def test_count_tokens_counts_runs_nothing_and_charges_nothing(service, engine):
    acct = make_account(service, credit="1")
    body = {k: v for k, v in BODY.items() if k != "max_tokens"}
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    async with asgi_client(service) as http:
        plain = await http.post("/v1/messages/count_tokens", json=body, headers=anthropic(acct))
        tools = await http.post(
            "/v1/messages/count_tokens", json={**body, "tools": [tool]}, headers=anthropic(acct)
        )
        bad = await http.post(
            "/v1/messages/count_tokens", json={**body, "max_tokens": 5}, headers=anthropic(acct)
        )
    assert plain.status_code == 200 and set(plain.json()) == {"input_tokens"}
    tok = service.tokenizer(service.catalog.model("kettei-core"))
    expected = tok.count_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    )
    assert plain.json()["input_tokens"] == expected
    # The tools' instructions are part of the prompt the model reads.
    assert tools.json()["input_tokens"] > expected
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "unknown_field"
    assert engine.calls == [] and charges(service, acct.org_id) == []
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0
