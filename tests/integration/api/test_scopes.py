"""Scopes as one table: every route of the app × every scope, checked from the table itself.

``batchyard.service.access.ACCESS`` says who may call what. These tests take
the routes from the running app (not from a list of our own), so a route
added without a row fails here, and call each one with a key of each scope:
a scope the row allows never gets 403, any other gets 403
``insufficient_scope``. The reference page is compared with the table, and
an inference key is shown to see only the batches it submitted.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi import FastAPI

from batchyard.app import create_app
from batchyard.core.accounts import Scope
from batchyard.core.clock import ManualClock
from batchyard.core.ids import new_id
from batchyard.service.access import ACCESS, access_for, app_routes, check_complete
from tests.support.accounts import add_key, make_account
from tests.support.deferred_batches import batch_body, feed_route, submit
from tests.support.server import asgi_client

DOCS = Path(__file__).resolve().parents[3] / "docs" / "reference" / "scopes.md"
NOW = ManualClock().now()
PARAMS = {
    "project_id": new_id("pp", NOW),
    "dataset_id": new_id("ds", NOW),
    "run_id": new_id("bir", NOW),
    "batch_id": new_id("bat", NOW),
    "file_id": new_id("file", NOW),
    "version_id": new_id("mv", NOW),
    "endpoint_id": new_id("we", NOW),
    "key_id": new_id("key", NOW),
    "model_id": "kettei-core",
    "row_id": "1",
}


def _url(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PARAMS[m.group(1)], path)


def _routes(service) -> list[tuple[str, str]]:
    return sorted(set(app_routes(create_app(service, close_on_exit=False))))


def test_every_route_of_the_app_has_a_row_and_every_row_a_route(service):
    routes = _routes(service)
    assert [r for r in routes if access_for(*r) is None] == []
    assert sorted(set(ACCESS) - set(routes)) == []


def test_an_app_with_a_route_the_table_lacks_refuses_to_start():
    app = FastAPI()

    @app.get("/v1/unlisted")
    async def unlisted() -> None:
        return None

    with pytest.raises(RuntimeError, match="/v1/unlisted"):
        check_complete(app)


def test_the_reference_page_is_the_table():
    documented = {}
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| (GET|POST|PATCH|PUT|DELETE) \| `([^`]+)` \| ([^|]+) \|(.*)\|$", line)
        if m:
            cells = [c.strip() for c in m.group(4).split("|")]
            documented[(m.group(1), m.group(2))] = (m.group(3).strip(), cells)
    assert set(documented) == set(ACCESS)
    kinds = {"key": "API key", "session": "workspace session", "public": "none"}
    for route, rule in ACCESS.items():
        kind, cells = documented[route]
        assert kind == kinds[rule.kind], route
        for scope, cell in zip((Scope.FULL, Scope.READ, Scope.INFERENCE), cells, strict=True):
            if rule.kind == "public":
                expected = "open"
            elif scope not in rule.scopes:
                expected = "—"
            else:
                expected = "own" if scope in rule.own_only else "yes"
            assert cell == expected, (route, scope)


@pytest.mark.parametrize("scope", list(Scope), ids=lambda s: s.value)
async def test_every_api_route_answers_each_scope_as_the_table_says(service, scope):
    keys = {s: add_key(service, "acme", s) for s in Scope}
    key = keys[scope]
    checked = 0
    async with asgi_client(service, worker=False) as http:
        for method, path in _routes(service):
            rule = access_for(method, path)
            assert rule is not None
            if rule.kind != "key":
                continue
            kwargs = {"json": {}} if method in ("POST", "PATCH") else {}
            r = await http.request(method, _url(path), headers=key.headers, **kwargs)
            refused = r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
            assert r.status_code != 401, (method, path, r.text)
            assert r.status_code < 500, (method, path, r.text)
            assert refused is (scope not in rule.scopes), (method, path, scope, r.text)
            checked += 1
    assert checked == sum(1 for r in ACCESS.values() if r.kind == "key")


async def test_open_routes_need_no_key_and_key_routes_refuse_none(service):
    async with asgi_client(service, worker=False) as http:
        for method, path in _routes(service):
            rule = access_for(method, path)
            assert rule is not None
            if rule.kind == "session":
                continue
            r = await http.request(method, _url(path))
            if rule.kind == "public":
                assert r.status_code not in (401, 403), (method, path)
            else:
                assert r.status_code == 401, (method, path)
                assert r.json()["error"]["code"] == "missing_api_key"


async def test_the_workspace_signs_in_the_scopes_its_row_allows(service):
    rule = access_for("POST", "/workspace/sign-in")
    assert rule is not None
    async with asgi_client(service, worker=False) as http:
        for scope in Scope:
            key = add_key(service, "acme", scope)
            page = await http.get("/workspace/")
            csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
            r = await http.post("/workspace/sign-in", data={"api_key": key.key, "csrf": csrf})
            signed_in = r.status_code == 303 and r.headers["location"] == "/workspace/batches"
            assert signed_in is (scope in rule.scopes), (scope, r.status_code)
            http.cookies.clear()


async def test_an_inference_key_reads_and_cancels_only_the_batches_it_submitted(market):
    svc = market(feed_route("spot"))
    full = make_account(svc, "acme")
    mine = add_key(svc, "acme", Scope.INFERENCE)
    other = add_key(svc, "acme", Scope.INFERENCE)
    reader = add_key(svc, "acme", Scope.READ)
    async with asgi_client(svc, worker=False) as http:
        theirs = (await submit(http, full.headers, batch_body(1))).json()["id"]
        own = (await submit(http, mine.headers, batch_body(1))).json()["id"]
        listed = (await http.get("/v1/batches", headers=mine.headers)).json()["data"]
        assert [b["id"] for b in listed] == [own]
        for path in (f"/v1/batches/{theirs}", f"/v1/batches/{theirs}/results"):
            r = await http.get(path, headers=mine.headers)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found"), path
        cancel = await http.post(f"/v1/batches/{theirs}/cancel", headers=mine.headers)
        assert cancel.status_code == 404
        assert (await http.get(f"/v1/batches/{own}", headers=other.headers)).status_code == 404
        # Read and full keys see the organisation's batches, whoever submitted them.
        for key in (full, reader):
            listing = (await http.get("/v1/batches", headers=key.headers)).json()["data"]
            ids = {b["id"] for b in listing}
            assert ids == {own, theirs}
        assert (await http.get(f"/v1/batches/{own}", headers=reader.headers)).status_code == 200
        stopped = await http.post(f"/v1/batches/{own}/cancel", headers=mine.headers)
        assert stopped.status_code == 200 and stopped.json()["status"] == "canceled"
        refused = await http.post(f"/v1/batches/{own}/cancel", headers=reader.headers)
        assert refused.status_code == 403
