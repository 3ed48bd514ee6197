"""The statuses the API really sends are the ones its OpenAPI document lists.

A tour of the endpoints that provokes each kind of answer (success, bad body,
no key, wrong scope, unknown object, conflict, no credit, over the limit, too
large); each answer's status must be documented for its operation.
"""

from __future__ import annotations

import pytest

from batchyard.core.accounts import Scope
from batchyard.engines.scripted import ScriptedEngine
from tests.support.accounts import add_key, make_account
from tests.support.server import asgi_client

CHAT = {"model": "kettei-core", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def service(make_service):
    svc = make_service(limits_queue_s=0, max_body_bytes=64 * 1024)
    svc.engines.set("embedded", ScriptedEngine("ok then", clock=svc.clock))
    return svc


async def test_every_status_sent_is_documented(service):
    rich = make_account(service, "rich", credit="5")
    poor = make_account(service, "poor", credit="0")
    reader = add_key(service, "rich", Scope.INFERENCE)
    sent: list[tuple[str, str, int]] = []
    async with asgi_client(service, worker=False) as http:
        doc = (await http.get("/openapi.json")).json()

        async def call(method: str, template: str, path: str | None = None, **kw):
            r = await http.request(method, path or template, **kw)
            sent.append((method.lower(), template, r.status_code))
            return r

        h = rich.headers
        await call("POST", "/v1/chat/completions", json=CHAT, headers=h)
        await call("POST", "/v1/chat/completions", json={**CHAT, "n": "2"}, headers=h)
        await call("POST", "/v1/chat/completions", json=CHAT)
        await call("POST", "/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=h)
        await call("POST", "/v1/chat/completions", json=CHAT, headers=poor.headers)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
        await call("POST", "/v1/chat/completions", json=big, headers=h)
        keyed = {**h, "Idempotency-Key": "tour-1"}
        await call("POST", "/v1/chat/completions", json=CHAT, headers=keyed)
        await call("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 5}, headers=keyed)
        for _ in range(service.tier(0).max_in_flight + 1):
            await call(
                "POST", "/v1/completions", json={"model": "kettei-core", "prompt": "a"}, headers=h
            )
        await call(
            "POST",
            "/v1/embeddings",
            json={"model": "kettei-core", "input": "a"},
            headers=poor.headers,
        )
        await call("GET", "/v1/account", headers=reader.headers)
        await call("GET", "/v1/account", headers=h)
        await call("GET", "/v1/models", headers=h)
        await call("GET", "/v1/models/{model_id}", "/v1/models/nope", headers=h)
        await call("GET", "/v1/activity", "/v1/activity?limit=x", headers=h)
        await call("GET", "/v1/batches/{batch_id}", "/v1/batches/bat.nope", headers=h)
        await call("POST", "/v1/projects", json={"name": "p"}, headers=h)
        await call("GET", "/v1/projects/{project_id}", "/v1/projects/pp.nope", headers=h)
        await call("POST", "/v1/decide/estimate", json={"model": "kettei-core"}, headers=h)
        msg = {**CHAT, "max_tokens": 4}
        await call("POST", "/v1/messages", json=msg, headers=h)
        await call("POST", "/v1/messages", json={**msg, "top_k": "1"}, headers=h)
        await call("POST", "/v1/messages", json=msg)
        await call("POST", "/v1/messages", json={**msg, "model": "nope"}, headers=h)
        await call("POST", "/v1/messages", json=msg, headers=poor.headers)
        count = {"model": "kettei-core", "messages": CHAT["messages"]}
        await call("POST", "/v1/messages/count_tokens", json=count, headers=h)
        await call("POST", "/v1/messages/count_tokens", json={**count, "n": 1}, headers=h)
        mb = "/v1/messages/batches"
        made = await call(
            "POST", mb, json={"requests": [{"custom_id": "a", "params": msg}]}, headers=h
        )
        await call("POST", mb, json={"requests": []}, headers=h)
        await call(
            "POST", mb, json={"requests": [{"custom_id": "a", "params": msg}]}, headers=poor.headers
        )
        await call("GET", mb, headers=h)
        await call("GET", mb + "/{batch_id}", mb + "/bat.nope", headers=h)
        if made.status_code == 200:
            bid = made.json()["id"]
            await call("GET", mb + "/{batch_id}", f"{mb}/{bid}", headers=h)
            await call("GET", mb + "/{batch_id}/results", f"{mb}/{bid}/results", headers=h)
            await call("POST", mb + "/{batch_id}/cancel", f"{mb}/{bid}/cancel", headers=h)
        await call("GET", "/healthz")

    statuses = {status for _, _, status in sent}
    assert {200, 201, 400, 401, 402, 403, 404, 409, 413, 429} <= statuses, sent
    undocumented = [
        (method, template, status)
        for method, template, status in sent
        if str(status) not in doc["paths"][template][method]["responses"]
    ]
    assert undocumented == []
