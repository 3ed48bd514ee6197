"""The OpenAPI document and the server agree: what one requires the other refuses without.

Every test's answers are already checked against the document on the side
(``tests.support.wire_check``); these tests make the cases the issue found
explicit. The lists of the runs API (dataset rows, runs, a run's failures) carry
``object: "list"`` as the document says; a body field the server refuses to go
without is required in the document, and a field the document requires is one
the server refuses to go without; a call that takes no body takes none.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

from batchyard.core.sealing import generate_key, key_text
from batchyard.engines.scripted import ScriptedEngine
from tests.support.accounts import Account, make_account
from tests.support.deferred_batches import batch_body, chat
from tests.support.file_batches import chat_line, jsonl, upload
from tests.support.runs import jsonl as rows_jsonl
from tests.support.server import asgi_app
from tests.support.wire_check import WIRE

RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
DECIDE = {
    "model": "kettei-core",
    "input": {"text": "The parcel arrived broken."},
    "decisions": [
        {"id": "sentiment", "question": "How?", "outcomes": [{"id": "bad"}, {"id": "good"}]}
    ],
}
PROJECT = "/v1/projects/{project}"
RUNS = PROJECT + "/batch-inference-runs"


@dataclass
class World:
    http: httpx.AsyncClient
    account: Account
    ids: dict[str, str]
    doc: dict[str, Any]
    keys: int = 0

    def key(self) -> dict[str, str]:
        self.keys += 1
        return {"Idempotency-Key": f"agree-key-{self.keys:06d}"}


@pytest.fixture
async def world(make_service, clock) -> AsyncIterator[World]:
    svc = make_service(batch_encryption_key=key_text(generate_key()))
    svc.engines.set("embedded", ScriptedEngine("a short answer", clock=clock))
    top = max(t.level for t in svc.settings.tiers)
    acct = make_account(svc, credit="100", tier=top)
    h = acct.headers
    async with asgi_app(svc, worker=False) as client, client() as http:
        project = (await http.post("/v1/projects", json={"name": "p"}, headers=h)).json()["id"]
        ds = await http.post(
            f"/v1/projects/{project}/datasets?name=tickets",
            content=rows_jsonl([{"text": f"ticket {i}"} for i in range(3)]),
            headers={**h, "Content-Type": "application/x-ndjson"},
        )
        run = await http.post(
            f"/v1/projects/{project}/batch-inference-runs",
            json={**RUN, "datasetId": ds.json()["id"]},
            headers={**h, "Idempotency-Key": "the-run"},
        )
        uploaded = await upload(http, h, jsonl([chat_line("a")]))
        assert (ds.status_code, run.status_code, uploaded.status_code) == (201, 201, 200)
        ids = {
            "project": project,
            "dataset": ds.json()["id"],
            "run": run.json()["id"],
            "file": uploaded.json()["id"],
        }
        doc = (await http.get("/openapi.json")).json()
        yield World(http, acct, ids, doc)


async def test_the_seed_002_lists_are_the_documents_lists(world: World) -> None:
    h = world.account.headers
    document = WIRE.document(world.doc)
    for path in (
        RUNS,
        PROJECT + "/datasets/{dataset}/rows",
        RUNS + "/{run}/failures",
    ):
        url = path.format(**world.ids)
        r = await world.http.get(url, headers=h)
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "list"
        assert {"data", "hasMore", "nextCursor"} <= set(r.json())
        assert WIRE.problems(document, "GET", url, 200, "application/json", r.content) == []


#: (method, path, template, a valid body, needs an Idempotency-Key)
BODIES: list[tuple[str, str, str, Any, bool]] = [
    ("POST", "/v1/projects", "/v1/projects", lambda ids: {"name": "q"}, False),
    (
        "POST",
        PROJECT + "/datasets",
        "/v1/projects/{project_id}/datasets",
        lambda ids: {"name": "d", "kind": "text"},
        False,
    ),
    (
        "PATCH",
        PROJECT + "/datasets/{dataset}/rows/1",
        "/v1/projects/{project_id}/datasets/{dataset_id}/rows/{row_id}",
        lambda ids: {"data": {"note": "x"}},
        False,
    ),
    (
        "POST",
        RUNS,
        "/v1/projects/{project_id}/batch-inference-runs",
        lambda ids: {**RUN, "datasetId": ids["dataset"]},
        True,
    ),
    ("POST", "/v1/decide", "/v1/decide", lambda ids: DECIDE, False),
    ("POST", "/v1/decide/estimate", "/v1/decide/estimate", lambda ids: DECIDE, False),
    (
        "POST",
        "/v1/models/kettei-core/keep-warm",
        "/v1/models/{model_id}/keep-warm",
        lambda ids: {"minutes": 5},
        False,
    ),
    ("POST", "/v1/batches", "/v1/batches", lambda ids: batch_body(1), True),
    (
        "POST",
        "/v1/batches",
        "/v1/batches",
        lambda ids: {
            "input_file_id": ids["file"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"team": "support"},
        },
        False,
    ),
    ("POST", "/v1/chat/completions", "/v1/chat/completions", lambda ids: chat(max_tokens=8), False),
    (
        "POST",
        "/v1/completions",
        "/v1/completions",
        lambda ids: {"model": "kettei-core", "prompt": "Say hi", "max_tokens": 8},
        False,
    ),
    (
        "POST",
        "/v1/embeddings",
        "/v1/embeddings",
        lambda ids: {"model": "kettei-core", "input": ["one", "two"]},
        False,
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "template", "valid", "keyed"),
    BODIES,
    ids=[f"{b[0]} {b[1]} {i}" for i, b in enumerate(BODIES)],
)
async def test_a_field_is_required_in_the_document_exactly_when_the_server_requires_it(
    world: World, method: str, path: str, template: str, valid: Any, keyed: bool
) -> None:
    body = valid(world.ids)
    schema = world.doc["paths"][template][method.lower()]["requestBody"]["content"][
        "application/json"
    ]["schema"]
    check = Draft202012Validator({**schema, "components": world.doc["components"]})
    assert check.is_valid(body), list(check.iter_errors(body))[:1]
    url = path.format(**world.ids)
    h = world.account.headers
    for dropped in [None, *body]:
        sent = {k: v for k, v in body.items() if k != dropped}
        r = await world.http.request(
            method, url, json=sent, headers={**h, **(world.key() if keyed else {})}
        )
        allowed = check.is_valid(sent)
        where = f"{method} {path} without {dropped!r}: {r.status_code} {r.text[:200]}"
        if not allowed:
            assert r.status_code == 400, f"the document requires it, the server does not: {where}"
        elif r.status_code == 400:
            param = r.json()["error"].get("param") or ""
            missing = dropped is not None and param.split(".")[0] == dropped
            assert not missing, f"the server requires it, the document does not: {where}"
    if body != {}:
        r = await world.http.request(
            method, url, json={}, headers={**h, **(world.key() if keyed else {})}
        )
        if r.status_code == 400:
            assert not check.is_valid({}), f"{method} {path} {{}} is refused: {r.text[:200]}"


async def test_calls_that_take_no_body_take_none(world: World) -> None:
    h = world.account.headers
    run = RUNS.format(**world.ids) + "/" + world.ids["run"]
    cancel = await world.http.post(f"{run}/cancel", headers=h)
    assert cancel.status_code == 200, cancel.text
    again = await world.http.post(
        f"{run}/cancel", content=b"{}", headers={**h, "Content-Type": "application/json"}
    )
    # ``{}`` is taken as no body: the answer is about the run's state, not the body.
    assert again.status_code == 409 and again.json()["error"]["code"] == "invalid_state"
