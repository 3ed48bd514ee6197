"""Streams, tools and embeddings passed through a route of engine ``openai_http``.

The fake upstream speaks OpenAI's streaming and tool-call shapes over real
HTTP; the gateway passes them on and bills from the upstream's own usage.
"""

from __future__ import annotations

import json

import pytest

from batchyard.store import activity
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.remote_routes import remote_catalog
from tests.support.server import asgi_client

CHAT = {
    "model": "remote-model",
    "messages": [{"role": "user", "content": "tell me four words"}],
    "max_tokens": 16,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


@pytest.fixture
def upstream():
    with FakeUpstream(mode="echo") as up:
        yield up


def service_with(make_service, upstream, **route):
    catalog = remote_catalog(upstream.base_url, upstream_model="fake", **route)
    return make_service(catalog=catalog)


def data_events(text: str) -> list:
    return [
        line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in text.split("\n\n")
        if line.startswith("data: ")
    ]


async def test_a_stream_is_passed_through_and_billed_from_the_upstreams_usage(
    make_service, upstream
):
    svc = service_with(make_service, upstream)
    acct = make_account(svc, credit="1")
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with asgi_client(svc) as http:
        r = await http.post("/v1/chat/completions", json=body, headers=acct.headers)
    assert upstream.last_request["stream"] is True
    assert upstream.last_request["stream_options"] == {"include_usage": True}
    evs = data_events(r.text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in evs[:-1] if c["choices"])
    assert text == "echo: tell me four words"
    assert evs[-2]["usage"]["completion_tokens"] == 5
    rows = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id, limit=10))
    [charge] = [row for row in rows if row["kind"] == "charge"]
    assert charge["detail"]["output_tokens"] == 5 and charge["detail"]["input_tokens"] == 4


async def test_tools_pass_through_where_the_route_supports_them(make_service, upstream):
    svc = service_with(make_service, upstream, supports_tools=True)
    acct = make_account(svc, credit="1")
    async with asgi_client(svc) as http:
        r = await http.post(
            "/v1/chat/completions", json={**CHAT, "tools": [TOOL]}, headers=acct.headers
        )
        streamed = await http.post(
            "/v1/chat/completions",
            json={**CHAT, "tools": [TOOL], "stream": True},
            headers=acct.headers,
        )
    assert r.status_code == 200, r.text
    assert upstream.last_request["tools"] == [TOOL]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    pieces = [
        c["choices"][0]["delta"]["tool_calls"]
        for c in data_events(streamed.text)[:-1]
        if c["choices"] and c["choices"][0]["delta"].get("tool_calls")
    ]
    assert pieces and pieces[0][0]["index"] == 0


async def test_a_route_without_tools_refuses_them_with_a_code(make_service, upstream):
    svc = service_with(make_service, upstream)
    acct = make_account(svc, credit="1")
    async with asgi_client(svc) as http:
        r = await http.post(
            "/v1/chat/completions", json={**CHAT, "tools": [TOOL]}, headers=acct.headers
        )
        models = await http.get("/v1/models/remote-model", headers=acct.headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "capability_unsupported"
    assert upstream.requests == 0
    caps = models.json()["capabilities"]
    assert caps["tools"] is False and caps["embeddings"] is False and caps["streaming"] is True


async def test_embeddings_pass_through(make_service, upstream):
    svc = service_with(make_service, upstream, serves_embeddings=True)
    acct = make_account(svc, credit="1")
    async with asgi_client(svc) as http:
        r = await http.post(
            "/v1/embeddings",
            json={"model": "remote-model", "input": ["ab", "abcd"]},
            headers=acct.headers,
        )
    assert r.status_code == 200, r.text
    assert [d["embedding"][0] for d in r.json()["data"]] == [2.0, 4.0]
    assert r.json()["usage"]["prompt_tokens"] == 2
