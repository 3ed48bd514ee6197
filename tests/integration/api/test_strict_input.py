"""Strict input, case by case: each way a careful attacker got a 500 or a silent acceptance.

The fuzz suite (``test_fuzz.py``) sweeps every endpoint; these are the cases
found by hand, kept by name so a regression says exactly what came back:
a NaN that poisoned a project, surrogates and deep nesting that crashed the
parser, lists where strings go, coerced booleans and numeric strings, typos
silently ignored, clamped paging, Unicode digits taken as IDs, and POSTs that
ignored ``Idempotency-Key``.
"""

from __future__ import annotations

import json

import pytest

from tests.support.accounts import make_account
from tests.support.deferred_batches import batch_body, submit
from tests.support.runs import Api, jsonl
from tests.support.server import asgi_client

RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def api(market):
    from tests.support.deferred_batches import feed_route

    svc = market(feed_route("spot"))
    acct = make_account(svc, credit="5", tier=3)
    async with asgi_client(svc, worker=False) as http:
        api = await Api(http, acct.headers).start()
        api.dataset = (await api.upload([{"text": "hello"}, {"text": "again"}]))["id"]
        yield api


def error_of(r) -> tuple[int, str, str | None]:
    err = r.json()["error"]
    return r.status_code, err["code"], err.get("param")


async def raw(api, method: str, path: str, content: bytes, **headers: str):
    return await api.http.request(
        method, path, content=content, headers={**api.headers, **JSON, **headers}
    )


async def test_a_nan_is_refused_and_the_project_stays_readable(api):
    body = {**RUN, "datasetId": api.dataset, "sampling": {"temperature": float("nan")}}
    text = json.dumps(body, allow_nan=True).encode()
    r = await raw(api, "POST", api.runs, text, **{"Idempotency-Key": "nan"})
    assert error_of(r)[:2] == (400, "invalid_json")
    flt = json.dumps({**RUN, "datasetId": api.dataset, "filter": {"field": "x", "eq": "NaN"}})
    r = await raw(api, "POST", api.runs, flt.replace('"NaN"', "NaN").encode())
    assert error_of(r)[:2] == (400, "invalid_json")
    listed = await api.http.get(api.runs, headers=api.headers)
    assert listed.status_code == 200 and listed.json()["data"] == []


async def test_an_upload_with_a_nan_is_refused_with_its_line(api):
    r = await api.http.post(
        f"/v1/projects/{api.project}/datasets?name=bad",
        content=jsonl([{"text": "fine"}]) + b'{"text": "bad", "score": NaN}\n',
        headers={**api.headers, "Content-Type": "application/x-ndjson"},
    )
    assert error_of(r)[:2] == (400, "invalid_dataset_file")
    assert "line 2" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b'{"name": "\\ud800"}', "invalid_json"),
        (b'{"name": "a\\u0000b"}', "unsupported_character"),
        (b"[" * 50_000, "invalid_json"),
        (b'{"name": "a", "name": "b"}', "invalid_json"),
        (b'{"name": 1e400}', "invalid_json"),
        (b'{"name": ["a"]}', "invalid_type"),
        (b'{"name": "a", "nmae": "typo"}', "unknown_field"),
    ],
    ids=["surrogate", "nul", "deep", "duplicate", "overflow", "list", "typo"],
)
async def test_a_project_body_is_strict_json_of_a_strict_shape(api, content, code):
    r = await raw(api, "POST", "/v1/projects", content)
    assert error_of(r)[:2] == (400, code), r.text


async def test_a_body_needs_the_json_content_type(api):
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        r = await api.http.post(
            "/v1/projects", content=b'{"name": "x"}', headers={**api.headers, "Content-Type": ctype}
        )
        assert error_of(r)[:2] == (415, "unsupported_media_type")
    r = await api.http.post("/v1/projects", content=b'{"name": "x"}', headers=api.headers)
    assert r.status_code == 415


@pytest.mark.parametrize(
    ("change", "code", "param"),
    [
        ({"completion_window": ["24h"]}, "invalid_type", "completion_window"),
        ({"min_discount": "90"}, "invalid_min_discount", "min_discount"),
        ({"min_discount": True}, "invalid_min_discount", "min_discount"),
    ],
)
async def test_a_batch_takes_no_list_for_a_string_and_no_string_for_a_number(
    api, change, code, param
):
    r = await submit(api.http, api.headers, {**batch_body(1), **change})
    assert error_of(r) == (400, code, param)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (
            {"role": ["user"], "content": "hi"},
            "invalid_request",
            "requests[0].body.messages[0].role",
        ),
        ({"role": "user", "content": "hi"}, None, None),
    ],
)
async def test_a_message_role_must_be_a_string(api, body, code, param):
    payload = batch_body(1)
    payload["requests"][0]["body"]["messages"] = [body]
    r = await submit(api.http, api.headers, payload)
    if code is None:
        assert r.status_code == 201, r.text
    else:
        assert error_of(r) == (400, code, param)


@pytest.mark.parametrize(
    ("privacy", "code"),
    [
        ("", "invalid_type"),
        (0, "invalid_type"),
        ([], "invalid_type"),
        ({"mode": "x"}, "invalid_privacy_mode"),
    ],
)
async def test_privacy_must_be_an_object_with_a_mode(api, privacy, code):
    payload = batch_body(1)
    payload["requests"][0]["body"]["privacy"] = privacy
    r = await submit(api.http, api.headers, payload)
    assert error_of(r)[:2] == (400, code)


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [
        ("/v1/decide", {"max_output_tokens": True}, "invalid_type", "max_output_tokens"),
        ("/v1/decide", {"max_output_tokens": "5"}, "invalid_type", "max_output_tokens"),
        ("/v1/decide", {"max_output_token": 5}, "unknown_field", "max_output_token"),
        ("/v1/decide/estimate", {"fallbak": "none"}, "unknown_field", "fallbak"),
    ],
)
async def test_decide_coerces_nothing_and_names_a_typo(api, path, body, code, param):
    decide = {
        "model": "kettei-core",
        "input": {"text": "x"},
        "decisions": [{"id": "a", "question": "q?", "outcomes": [{"id": "y"}, {"id": "n"}]}],
    }
    r = await api.http.post(path, json={**decide, **body}, headers=api.headers)
    assert error_of(r) == (400, code, param)


async def test_runs_and_rows_name_their_typos(api):
    sampled = {**RUN, "datasetId": api.dataset, "sampling": {"maxOutputToken": 8}}
    r = await api.create(sampled)
    assert error_of(r) == (400, "unknown_field", "sampling.maxOutputToken")
    r = await api.create({**RUN, "datasetId": api.dataset, "sampling": {"maxOutputTokens": True}})
    assert error_of(r) == (400, "invalid_type", "sampling.maxOutputTokens")
    row = f"/v1/projects/{api.project}/datasets/{api.dataset}/rows/1"
    r = await api.http.patch(row, json={"data": {"a": 1}, "extra": 1}, headers=api.headers)
    assert error_of(r) == (400, "unknown_field", "extra")
    r = await raw(api, "PATCH", row, b'{"data": {"a": NaN}}')
    assert error_of(r)[:2] == (400, "invalid_json")


@pytest.mark.parametrize("row", ["²", "١", str(2**31), str(2**63), "9" * 30, "0", "-1"])
async def test_a_row_id_is_ascii_decimal_in_range(api, row):
    r = await api.http.patch(
        f"/v1/projects/{api.project}/datasets/{api.dataset}/rows/{row}",
        json={"data": {"a": 1}},
        headers=api.headers,
    )
    assert error_of(r)[:2] == (404, "not_found")


@pytest.mark.parametrize(
    ("query", "code", "param"),
    [
        ("limit=0", "invalid_limit", "limit"),
        ("limit=-1", "invalid_limit", "limit"),
        ("limit=100000", "invalid_limit", "limit"),
        ("limit=²", "invalid_limit", "limit"),
        ("cursor=abc", "invalid_cursor", "cursor"),
        ("cursor=" + "9" * 30, "invalid_cursor", "cursor"),
    ],
)
async def test_paging_is_checked_not_clamped(api, query, code, param):
    r = await api.http.get(
        f"/v1/projects/{api.project}/datasets/{api.dataset}/rows?{query}", headers=api.headers
    )
    assert error_of(r) == (400, code, param)
    r = await api.http.get(f"/v1/activity?{query.replace('cursor', 'after')}", headers=api.headers)
    assert r.status_code == 400


async def test_every_post_honours_its_idempotency_key(api):
    http, h = api.http, api.headers

    async def twice(method: str, path: str, **kwargs):
        first = await http.request(method, path, headers={**h, "Idempotency-Key": path}, **kwargs)
        again = await http.request(method, path, headers={**h, "Idempotency-Key": path}, **kwargs)
        assert first.is_success, first.text
        assert again.headers.get("idempotent-replayed") == "true", path
        assert again.json() == first.json()
        return first.json()

    project = await twice("POST", "/v1/projects", json={"name": "once"})
    datasets = f"/v1/projects/{project['id']}/datasets"
    await twice("POST", datasets, json={"name": "empty"})
    up_path = datasets + "?name=up"
    first = await http.post(
        up_path,
        content=jsonl([{"text": "a"}]),
        headers={**h, "Content-Type": "application/x-ndjson", "Idempotency-Key": "up"},
    )
    again = await http.post(
        up_path,
        content=jsonl([{"text": "a"}]),
        headers={**h, "Content-Type": "application/x-ndjson", "Idempotency-Key": "up"},
    )
    assert again.json()["id"] == first.json()["id"]
    other = await http.post(
        up_path,
        content=jsonl([{"text": "b"}]),
        headers={**h, "Content-Type": "application/x-ndjson", "Idempotency-Key": "up"},
    )
    assert error_of(other)[:2] == (409, "idempotency_conflict")
    row = f"{datasets}/{first.json()['id']}/rows/1"
    await twice("PATCH", row, json={"data": {"note": "x"}})
    run = await api.create({**RUN, "datasetId": api.dataset})
    assert run.status_code == 201
    await twice("POST", f"{api.runs}/{run.json()['id']}/cancel")
