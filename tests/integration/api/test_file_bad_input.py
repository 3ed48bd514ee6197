"""Bad files and bad batches: each a coded 4xx that changes nothing."""

from __future__ import annotations

import dataclasses
import json

import pytest
from sqlalchemy import func, select

from batchyard.core.sections import FileSettings
from batchyard.store import file_batches as fstore
from batchyard.store import files as file_store
from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.file_batches import chat_line, create, jsonl, upload, worker
from tests.support.server import asgi_client
from tests.support.workspace import answer_with


def stored(service):
    def count(c):
        return tuple(
            c.execute(select(func.count()).select_from(t)).scalar_one()
            for t in (file_store.files, file_store.file_lines, fstore.file_batches)
        )

    return service.db.read_sync(count)


def error_of(r):
    return r.status_code, r.json()["error"]["code"]


#: Files that are JSONL but hold a line that is no valid request: each uploads (OpenAI's
#: order) and a batch created from it is ``failed`` naming the line.
BAD_FILES = [
    ("duplicate", [chat_line("a"), chat_line("b"), chat_line("a")], "duplicate_custom_id", 3),
    ("method", [{**chat_line("a"), "method": "GET"}], "invalid_method", 1),
    ("mixed", [chat_line("a"), {**chat_line("b"), "url": "/v1/embeddings"}], "mixed_endpoints", 2),
    ("unknown_model", [chat_line("a", model="gpt-9")], "unknown_model", 1),
    ("max_tokens", [chat_line("a", max_tokens=100_000)], "max_tokens_out_of_range", 1),
    ("max_tokens_str", [chat_line("a", max_tokens="5")], "invalid_type", 1),
    ("stream", [chat_line("a", stream=True)], "streaming_unsupported", 1),
    ("unknown_field", [chat_line("a", bogus=1)], "unknown_field", 1),
    ("line_field", [{**chat_line("a"), "extra": 1}], "unsupported_parameter", 1),
    ("custom_id", [{**chat_line("a"), "custom_id": ""}], "invalid_custom_id", 1),
    ("url", [{**chat_line("a"), "url": "/v1/images"}], "unsupported_endpoint", 1),
    ("not_an_object", [chat_line("a"), "[1, 2]"], "invalid_json", 2),
    ("not_json", [chat_line("a"), "{not json"], "invalid_json", 2),
    ("cut_short", [json.dumps(chat_line("a"))[:-3]], "invalid_json", 1),
]


@pytest.mark.parametrize(
    ("lines", "code", "line"), [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES]
)
async def test_a_bad_line_uploads_and_fails_the_batch_naming_it(service, lines, code, line):
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        up = await upload(http, acct.headers, jsonl(lines))
        assert up.status_code == 200, up.text
        assert up.json()["lines"] == len(lines)
        content = await http.get(f"/v1/files/{up.json()['id']}/content", headers=acct.headers)
        r = await create(http, acct.headers, up.json()["id"])
        again = await http.get(f"/v1/batches/{r.json()['id']}", headers=acct.headers)
    assert content.content == jsonl(lines), "the file reads back as it was sent"
    assert r.status_code == 200, r.text
    batch = r.json()
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    assert again.json()["status"] == "failed"
    errors = batch["errors"]
    assert errors["object"] == "list"
    assert [(e["code"], e["line"]) for e in errors["data"]] == [(code, line)]
    first = errors["data"][0]
    assert set(first) == {"code", "line", "message", "param"}
    assert first["message"].startswith(f"line {line}:")
    assert first["param"] is None or not first["param"].startswith("line")
    counts = batch["request_counts"]
    assert (counts["total"], counts["completed"], counts["failed"]) == (0, 0, 0)
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0 and bal.settled == 0
    assert stored(service)[2] == 1  # the failed batch, and no line of it to run


async def test_every_invalid_line_is_listed(service):
    acct = make_account(service, credit="1")
    lines = [chat_line("a"), chat_line("b", model="gpt-9"), chat_line("c"), chat_line("a")]
    async with asgi_client(service, worker=False) as http:
        up = await upload(http, acct.headers, jsonl(lines))
        r = await create(http, acct.headers, up.json()["id"])
    assert [(e["code"], e["line"]) for e in r.json()["errors"]["data"]] == [
        ("unknown_model", 2),
        ("duplicate_custom_id", 4),
    ]


async def test_lines_that_are_not_json_or_not_utf8_upload_and_read_back_as_sent(service):
    acct = make_account(service, credit="1")
    content = jsonl([chat_line("a")]) + b"{oops\n" + b"caf\xe9 \xff\n" + jsonl([chat_line("b")])
    async with asgi_client(service, worker=False) as http:
        up = await upload(http, acct.headers, content)
        assert up.status_code == 200, up.text
        back = await http.get(f"/v1/files/{up.json()['id']}/content", headers=acct.headers)
        r = await create(http, acct.headers, up.json()["id"])
    assert up.json()["lines"] == 4 and back.content == content
    batch = r.json()
    assert batch["status"] == "failed" and batch["request_counts"]["total"] == 0
    errors = batch["errors"]["data"]
    assert [(e["code"], e["line"], e["param"]) for e in errors] == [
        ("invalid_json", 2, None),
        ("invalid_json", 3, None),
    ]
    assert "not valid JSON" in errors[0]["message"] and "not UTF-8" in errors[1]["message"]
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0 and bal.settled == 0


async def test_purpose_size_and_line_limits(make_service):
    service = make_service(files=FileSettings(max_bytes=2000, max_lines=3))
    acct = make_account(service)
    async with asgi_client(service, worker=False) as http:
        purpose = await upload(http, acct.headers, jsonl([chat_line("a")]), purpose="fine-tune")
        output = await upload(http, acct.headers, jsonl([chat_line("a")]), purpose="batch_output")
        unknown = await upload(http, acct.headers, jsonl([chat_line("a")]), purpose="x")
        big = await upload(http, acct.headers, jsonl([chat_line("a", "word " * 500)]))
        many = await upload(http, acct.headers, jsonl([chat_line(str(i)) for i in range(4)]))
        empty = await upload(http, acct.headers, b"\n\n")
        not_multipart = await http.post(
            "/v1/files", headers=acct.headers, content=b"{}", params={"purpose": "batch"}
        )
        extra = await upload(http, acct.headers, jsonl([chat_line("a")]), color="red")
    assert error_of(purpose) == (400, "invalid_purpose")
    assert error_of(output) == (400, "invalid_purpose")
    assert error_of(unknown) == (400, "invalid_purpose")
    assert error_of(big) == (413, "file_too_large")
    assert error_of(many) == (400, "too_many_lines")
    assert "line 4" in many.json()["error"]["message"]
    assert error_of(empty) == (400, "empty_file")
    assert error_of(not_multipart) == (415, "unsupported_media_type")
    assert error_of(extra) == (400, "unsupported_parameter")
    assert stored(service) == (0, 0, 0)


async def test_bad_batches_change_nothing(service, clock):
    answer_with(service)
    acct = make_account(service, credit="1")
    other = make_account(service, "globex", credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]))).json()
        gone = (await upload(http, acct.headers, jsonl([chat_line("b")]))).json()
        assert (await http.delete(f"/v1/files/{gone['id']}", headers=acct.headers)).json() == {
            "id": gone["id"],
            "object": "file",
            "deleted": True,
        }
        before = stored(service)
        theirs = await create(http, other.headers, f["id"])
        deleted = await create(http, acct.headers, gone["id"])
        mismatch = await create(http, acct.headers, f["id"], endpoint="/v1/embeddings")
        window = await create(http, acct.headers, f["id"], window="36h")
        # Not strings at all: read by the declared body, never hashed by hand (was a 500).
        windows = [await create(http, acct.headers, f["id"], window=w) for w in ({}, [], 24)]
        endpoint = await create(http, acct.headers, f["id"], endpoint={})
        unknown = await create(http, acct.headers, f["id"], colour="red")
        meta = await create(http, acct.headers, f["id"], metadata={"min_discount": "150"})
        after = stored(service)
        batch = (await create(http, acct.headers, f["id"])).json()
        in_use = await http.delete(f"/v1/files/{f['id']}", headers=acct.headers)
        their_file = await http.get(f"/v1/files/{f['id']}", headers=other.headers)
        their_content = await http.get(f"/v1/files/{f['id']}/content", headers=other.headers)
        their_batch = await http.get(f"/v1/batches/{batch['id']}", headers=other.headers)
        their_cancel = await http.post(f"/v1/batches/{batch['id']}/cancel", headers=other.headers)
        bad_limit = await http.get("/v1/batches?limit=0", headers=acct.headers)
        bad_order = await http.get("/v1/files?order=up", headers=acct.headers)
        await worker(service).run_until_idle()
        freed = await http.delete(f"/v1/files/{f['id']}", headers=acct.headers)
    assert error_of(theirs) == (404, "file_not_found")
    assert error_of(deleted) == (404, "file_deleted")
    assert error_of(mismatch)[0] == 400
    assert error_of(window) == (400, "invalid_completion_window")
    assert [error_of(w) for w in windows] == [(400, "invalid_completion_window")] * 3
    assert error_of(endpoint) == (400, "unsupported_endpoint")
    assert [w.json()["error"]["param"] for w in windows] == ["completion_window"] * 3
    assert error_of(unknown) == (400, "unsupported_parameter")
    assert error_of(meta) == (400, "min_discount_out_of_range")
    assert before == after
    assert error_of(in_use) == (409, "file_in_use")
    assert [x.status_code for x in (their_file, their_content, their_batch, their_cancel)] == [
        404
    ] * 4
    assert error_of(bad_limit) == (400, "invalid_limit")
    assert error_of(bad_order) == (400, "invalid_request")
    assert freed.status_code == 200
    bal = service.db.read_sync(lambda c: ledger.balance(c, other.org_id))
    assert bal.held == 0 and bal.settled == 0


async def test_a_file_whose_url_differs_from_the_batch_endpoint_is_refused_naming_a_line(
    make_service,
):
    service = make_service()
    acct = make_account(service)
    line = {
        "custom_id": "e",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "kettei-core", "input": "hello"},
    }
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([line]))).json()
        r = await create(http, acct.headers, f["id"])
    assert error_of(r) == (400, "endpoint_mismatch")
    assert r.json()["error"]["message"].startswith("line 1:")
    assert (
        dataclasses.asdict(service.db.read_sync(lambda c: ledger.balance(c, acct.org_id)))["held"]
        == 0
    )
