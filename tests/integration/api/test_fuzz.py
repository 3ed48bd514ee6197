"""Every endpoint, fed what careless and hostile clients send: never a 5xx, never a trace left.

For every route that reads a body, Hypothesis draws bodies from the route's
own request model (``api.bodies``, ``service.batch_requests``, chat's model)
with hostile values, and breaks a valid body one way at a time; every
endpoint also gets each malformed-JSON family (``tests.support.fuzz``) and
the wrong content types; every GET gets odd paging parameters and odd IDs.

Each answer must be below 500; a 4xx must carry the coded error body
(``code``, ``message``, ``retryable``); and a refused request must leave the
store as it found it: the row count of every table is compared before and
after. It runs on SQLite and on PostgreSQL, where a NUL character is refused
by the database itself (so it must be refused before it gets there).

Hypothesis is derandomized (a fixed seed per test, no example database), so CI
runs the same examples every time; ``FUZZ_EXAMPLES`` sets how many.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from sqlalchemy import func, select

# Every table on the metadata: these modules declare their own.
import batchyard.store.deferred_batches
import batchyard.store.market_history
import batchyard.store.work_items  # noqa: F401
from batchyard.api.bodies import DecideBody, KeepWarmBody, ProjectBody, RowPatchBody
from batchyard.core.clock import ManualClock
from batchyard.core.ids import new_id
from batchyard.core.openai_bodies import ChatRequest, CompletionTextRequest, EmbeddingRequest
from batchyard.core.sealing import generate_key, key_text
from batchyard.engines.scripted import ScriptedEngine
from batchyard.service import Service
from batchyard.service.batch_requests import BatchBody
from batchyard.service.runs import RunBody
from batchyard.store import ledger
from batchyard.store.tables import metadata
from tests.support.accounts import Account, make_account
from tests.support.deferred_batches import batch_body, chat
from tests.support.file_batches import chat_line, upload
from tests.support.file_batches import jsonl as file_jsonl
from tests.support.fuzz import MALFORMED, encode, from_model, mutations
from tests.support.runs import jsonl
from tests.support.server import asgi_app

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
JSON = {"Content-Type": "application/json"}

FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)


@dataclass
class World:
    """A deployment with one of everything, and the means to check a request against it."""

    service: Service
    http: httpx.AsyncClient
    account: Account
    ids: dict[str, str]
    requests: int = 0
    refused: dict[int, int] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        def q(conn: Any) -> dict[str, int]:
            return {
                t.name: int(conn.execute(select(func.count()).select_from(t)).scalar_one())
                for t in metadata.sorted_tables
            }

        return self.service.db.read_sync(q)

    async def send(
        self,
        method: str,
        url: str,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        what: str = "",
    ) -> httpx.Response:
        before = self.counts()
        r = await self.http.request(
            method, url, content=content, headers={**self.account.headers, **(headers or {})}
        )
        self.requests += 1
        where = f"{method} {url} ({what}): {r.status_code} {r.text[:300]}"
        assert r.status_code < 500, where
        if r.status_code >= 400:
            self.refused[r.status_code] = self.refused.get(r.status_code, 0) + 1
            error = r.json()["error"]
            assert isinstance(error["code"], str) and re.fullmatch(r"[a-z_]+", error["code"]), where
            assert isinstance(error["message"], str) and error["message"], where
            assert isinstance(error["retryable"], bool), where
            assert self.counts() == before, f"a refused request changed the store: {where}"
        return r


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str  # with {project}, {dataset}, {run}, {batch} from World.ids
    model: type[BaseModel] | None
    valid: Callable[[dict[str, str]], dict[str, Any]]
    key_min: int = 0  # an Idempotency-Key of this length is required

    def url(self, ids: dict[str, str]) -> str:
        return self.path.format(**ids)

    def headers(self, n: int) -> dict[str, str]:
        if not self.key_min:
            return JSON
        return {**JSON, "Idempotency-Key": f"fuzz-key-{n:08d}"}


RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8, "temperature": 0.5},
    "filter": {"field": "lang", "eq": "en"},
}
DECIDE = {
    "model": "kettei-core",
    "input": {"text": "The parcel arrived broken."},
    "decisions": [
        {
            "id": "sentiment",
            "question": "How does the writer feel?",
            "outcomes": [{"id": "negative"}, {"id": "positive", "description": "happy"}],
        }
    ],
}
PROJECT = "/v1/projects/{project}"
RUNS = PROJECT + "/batch-inference-runs"

ENDPOINTS = [
    Endpoint("POST", "/v1/projects", ProjectBody, lambda _: {"name": "fuzzed"}),
    Endpoint("POST", PROJECT + "/datasets", None, lambda _: {"name": "d", "kind": "text"}),
    Endpoint(
        "PATCH",
        PROJECT + "/datasets/{dataset}/rows/1",
        RowPatchBody,
        lambda _: {"data": {"note": "checked", "score": 3}},
    ),
    Endpoint("POST", RUNS, RunBody, lambda ids: {**RUN, "datasetId": ids["dataset"]}, key_min=1),
    Endpoint("POST", RUNS + "/{run}/confirm", None, lambda _: {}),
    Endpoint("POST", "/v1/decide", DecideBody, lambda _: DECIDE),
    Endpoint("POST", "/v1/decide/estimate", DecideBody, lambda _: DECIDE),
    Endpoint("POST", "/v1/models/kettei-core/keep-warm", KeepWarmBody, lambda _: {"minutes": 5}),
    Endpoint("POST", "/v1/batches", BatchBody, lambda _: batch_body(2), key_min=8),
    Endpoint(
        "POST",
        "/v1/batches",
        None,
        lambda ids: {
            "input_file_id": ids["file"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"team": "support"},
        },
    ),
    Endpoint("POST", "/v1/batches/{batch}/cancel", None, lambda _: {}),
    Endpoint("POST", "/v1/chat/completions", ChatRequest, lambda _: chat(max_tokens=8)),
    Endpoint(
        "POST",
        "/v1/completions",
        CompletionTextRequest,
        lambda _: {"model": "kettei-core", "prompt": "Say hi", "max_tokens": 8},
    ),
    Endpoint(
        "POST",
        "/v1/embeddings",
        EmbeddingRequest,
        lambda _: {"model": "kettei-core", "input": ["one", "two"]},
    ),
]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def world(request, make_service, clock: ManualClock) -> AsyncIterator[World]:
    svc = make_service(
        postgres=request.param == "postgres", batch_encryption_key=key_text(generate_key())
    )
    svc.engines.set("embedded", ScriptedEngine("a short answer", clock=clock))
    top = max(t.level for t in svc.settings.tiers)
    acct = make_account(svc, credit="1000", tier=top)
    async with asgi_app(svc, worker=False) as client, client() as http:
        h = acct.headers
        project = (await http.post("/v1/projects", json={"name": "p"}, headers=h)).json()["id"]
        rows = [{"text": f"ticket {i}", "lang": "en" if i % 2 else "fr"} for i in range(4)]
        ds = await http.post(
            f"/v1/projects/{project}/datasets?name=tickets",
            content=jsonl(rows),
            headers={**h, "Content-Type": "application/x-ndjson"},
        )
        dataset = ds.json()["id"]
        run = await http.post(
            f"/v1/projects/{project}/batch-inference-runs",
            json={**RUN, "datasetId": dataset},
            headers={**h, "Idempotency-Key": "the-run"},
        )
        batch = await http.post(
            "/v1/batches", json=batch_body(1), headers={**h, "Idempotency-Key": "the-batch"}
        )
        lines = file_jsonl([chat_line(f"line-{i}", f"text {i}") for i in range(3)])
        uploaded = await upload(http, h, lines)
        assert (ds.status_code, run.status_code, batch.status_code) == (201, 201, 201)
        assert uploaded.status_code == 200, uploaded.text
        ids = {
            "project": project,
            "dataset": dataset,
            "run": run.json()["id"],
            "batch": batch.json()["id"],
            "file": uploaded.json()["id"],
        }
        yield World(svc, http, acct, ids)


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: f"{e.method} {e.path}")
@FUZZ
@given(data=st.data())
async def test_bodies_drawn_from_the_request_model(world: World, endpoint: Endpoint, data) -> None:
    valid = endpoint.valid(world.ids)
    strategies = [mutations(valid)] if valid else []
    if endpoint.model is not None:
        strategies.append(from_model(endpoint.model))
    if not strategies:
        strategies.append(st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
    body = data.draw(st.one_of(strategies), label="body")
    await world.send(
        endpoint.method,
        endpoint.url(world.ids),
        content=encode(body),
        headers=endpoint.headers(world.requests),
        what="drawn body",
    )


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: f"{e.method} {e.path}")
async def test_malformed_json_and_wrong_content_types(world: World, endpoint: Endpoint) -> None:
    url = endpoint.url(world.ids)
    for name, raw in MALFORMED.items():
        r = await world.send(
            endpoint.method, url, content=raw, headers=endpoint.headers(world.requests), what=name
        )
        if name not in ("empty", "whitespace"):  # a call that takes no body may take nothing
            assert 400 <= r.status_code < 500, (name, r.status_code)
    valid = encode(endpoint.valid(world.ids))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "application/xml", None):
        headers = {k: v for k, v in endpoint.headers(world.requests).items() if k != "Content-Type"}
        if ctype is not None:
            headers["Content-Type"] = ctype
        r = await world.send(
            endpoint.method, url, content=valid, headers=headers, what=f"content type {ctype}"
        )
        if endpoint.model is not None or endpoint.path.endswith("/datasets"):
            assert r.status_code in (400, 415), (ctype, r.status_code, r.text)


ODD = ["0", "-1", "100000", "١", "²", "1.5", "abc", "", "9" * 30, "\x00", "%00", "1e3", " 5"]
PAGED = [
    ("/v1/activity", ("limit", "after")),
    ("/v1/batches", ("limit", "after")),
    ("/v1/files", ("limit", "after")),
    (RUNS, ("limit", "cursor", "status")),
    (PROJECT + "/datasets/{dataset}/rows", ("limit", "cursor")),
    (RUNS + "/{run}/failures", ("limit", "cursor")),
]


@pytest.mark.parametrize("path,params", PAGED, ids=[p for p, _ in PAGED])
async def test_paging_parameters_are_checked_not_clamped(world: World, path: str, params) -> None:
    url = path.format(**world.ids)
    numeric = path.endswith(("/rows", "/failures"))  # cursors there are row IDs
    for param in params:
        for value in ODD:
            r = await world.send("GET", url + "?" + httpx.QueryParams({param: value}).__str__())
            if param == "limit":
                bad = True
            elif param in ("cursor", "after"):
                bad = value != "" and not (numeric and value in ("0", "100000"))
            else:
                bad = value != ""
            if bad:
                assert r.status_code == 400, (param, value, r.text)
                assert r.json()["error"]["param"] == param
            else:
                assert r.status_code == 200, (param, value, r.text)
    twice = await world.send("GET", url + "?limit=1&limit=2")
    assert twice.status_code == 400


def _bad_ids(prefix: str) -> list[str]:
    good = new_id(prefix, ManualClock().now())
    return [
        good.upper(),
        good + "x",
        good[:-1],
        good.replace(".", "%00", 1),
        prefix + ".1",
        "١",
        "9" * 30,
        "%F0%9F%92%A9",
        good.replace("-7", "-4", 1),  # a UUIDv4
    ]


async def test_odd_ids_in_every_path_are_404_and_never_reach_the_store(world: World) -> None:
    templates = {
        "project": ("pp", ["/v1/projects/{project}", PROJECT + "/datasets/{dataset}"]),
        "dataset": ("ds", [PROJECT + "/datasets/{dataset}", PROJECT + "/datasets/{dataset}/rows"]),
        "run": ("bir", [RUNS + "/{run}", RUNS + "/{run}/failures"]),
        "batch": ("bat", ["/v1/batches/{batch}", "/v1/batches/{batch}/results"]),
        "file": ("file", ["/v1/files/{file}", "/v1/files/{file}/content"]),
    }
    for name, (prefix, paths) in templates.items():
        for path in paths:
            for bad in _bad_ids(prefix):
                url = path.format(**{**world.ids, name: bad})
                r = await world.send("GET", url, what=f"{name} id {bad!r}")
                assert r.status_code == 404, (url, r.text)
    rows = PROJECT + "/datasets/{dataset}/rows/"
    for row in ["0", "-1", "١", "²", str(2**31), str(2**63), "9" * 30, "1.0", "%00"]:
        url = rows.format(**world.ids) + row
        r = await world.send(
            "PATCH", url, content=b'{"data": {"a": 1}}', headers=JSON, what=f"row {row!r}"
        )
        assert r.status_code == 404, (row, r.text)


async def test_the_workspace_form_takes_malformed_json_without_a_5xx(world: World) -> None:
    http = world.http
    page = await http.get("/workspace/")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    signed = await http.post(
        "/workspace/sign-in", data={"api_key": world.account.key, "csrf": csrf}
    )
    assert signed.status_code == 303
    listing = await http.get("/workspace/batches")
    session_csrf = re.search(r'name="csrf" value="([^"]+)"', listing.text).group(1)
    for name, raw in MALFORMED.items():
        before = world.counts()
        text = raw.decode("utf-8", "replace")
        r = await http.post(
            "/workspace/batches",
            data={"body": text, "idempotency_key": f"ws-fuzz-{name}", "csrf": session_csrf},
        )
        assert r.status_code < 500, (name, r.status_code)
        if r.status_code >= 400:
            assert world.counts() == before, name
    for bad in ["%00", "١", "bat.%00", "9" * 30]:
        r = await http.get(f"/workspace/batches/{bad}")
        assert r.status_code in (404, 400), (bad, r.status_code)
    for bad in ["\x00", "١", "bat.\x00", "9" * 30]:
        r = await http.get("/workspace/batches", params={"after": bad})
        assert r.status_code == 200, (bad, r.status_code)


FILE_BODIES = {
    "empty": b"",
}
#: Lines that are no valid request (not even JSON): they upload (OpenAI's order) and fail
#: the batch, each named in ``errors.data``.
LINE_BODIES = {
    "nan": b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": NaN}\n',
    "surrogate": b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/chat/completions"}\n',
    "nul": b'{"custom_id": "a\\u0000", "method": "POST", "url": "/v1/chat/completions"}\n',
    "deep": b"[" * 50_000 + b"\n",
    "not json": b"hello\n",
    "not utf-8": b'{"custom_id": "\xff"}\n',
    "wrong types": file_jsonl([{**chat_line("a"), "body": {"model": ["x"], "messages": 1}}]),
    "huge int": file_jsonl([chat_line("a", max_tokens=10**30)]),
    "not an object": b"[1, 2]\n",
    "no body": b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}\n',
}


async def test_invalid_lines_upload_and_fail_their_batch(world: World) -> None:
    for name, content in LINE_BODIES.items():
        r = await upload(world.http, world.account.headers, content)
        assert r.status_code == 200, (name, r.text)
        body = encode(
            {
                "input_file_id": r.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
        )
        before = world.service.db.read_sync(lambda c: ledger.balance(c, world.account.org_id))
        created = await world.send("POST", "/v1/batches", content=body, headers=JSON, what=name)
        assert created.status_code == 200, (name, created.text)
        assert created.json()["status"] == "failed", (name, created.text)
        errors = created.json()["errors"]["data"]
        assert [e["line"] for e in errors] == [1], (name, errors)
        after = world.service.db.read_sync(lambda c: ledger.balance(c, world.account.org_id))
        assert after == before, f"a failed batch held or charged something: {name}"


async def test_file_uploads_refuse_malformed_files_and_bodies(world: World) -> None:
    for name, content in FILE_BODIES.items():
        before = world.counts()
        r = await upload(world.http, world.account.headers, content)
        assert r.status_code < 500, (name, r.text)
        if r.status_code >= 400:
            assert isinstance(r.json()["error"]["code"], str), name
            assert world.counts() == before, f"a refused upload changed the store: {name}"
        else:
            raise AssertionError(f"{name} was accepted: {r.text}")
    for ctype in ("application/json", "text/plain", None):
        headers = {k: v for k, v in {"Content-Type": ctype}.items() if v}
        r = await world.send("POST", "/v1/files", content=b"{}", headers=headers, what=ctype or "")
        assert r.status_code in (400, 415), (ctype, r.text)
    r = await world.send(
        "POST",
        "/v1/files",
        content=b"--x\r\nContent-Disposition: form-data; name=file\r\n\r\nxx",
        headers={"Content-Type": "multipart/form-data; boundary=x"},
        what="truncated multipart",
    )
    assert 400 <= r.status_code < 500
