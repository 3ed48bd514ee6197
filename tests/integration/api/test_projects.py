"""Projects and datasets over real HTTP: uploads, versioned rows, organisation walls."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import func, select

from batchyard.store.projects import dataset_rows, datasets
from tests.support.accounts import make_account
from tests.support.server import asgi_client

JSONL = "application/x-ndjson"


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


async def _project(http, acct, name="p"):
    r = await http.post("/v1/projects", json={"name": name}, headers=acct.headers)
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def test_projects_belong_to_their_organisation(service):
    a = make_account(service, "acme")
    b = make_account(service, "other")
    async with asgi_client(service, worker=False) as http:
        pid = await _project(http, a, "support")
        got = await http.get(f"/v1/projects/{pid}", headers=a.headers)
        foreign = await http.get(f"/v1/projects/{pid}", headers=b.headers)
        bad = await http.post("/v1/projects", json={"name": ""}, headers=a.headers)
    assert got.status_code == 200
    body = got.json()
    assert body["id"].startswith("pp.") and body["name"] == "support"
    assert body["createdAt"].endswith("Z")
    assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "not_found"
    assert bad.status_code == 400


async def test_jsonl_upload_is_streamed_in_and_paged_out(service):
    acct = make_account(service)
    rows = [{"text": f"question {i}", "lang": "en" if i % 2 else "fr"} for i in range(2500)]

    async def chunks():
        data = jsonl(rows)
        for i in range(0, len(data), 7000):
            yield data[i : i + 7000]

    async with asgi_client(service, worker=False) as http:
        pid = await _project(http, acct)
        r = await http.post(
            f"/v1/projects/{pid}/datasets",
            params={"name": "tickets"},
            content=chunks(),
            headers={**acct.headers, "Content-Type": JSONL},
        )
        assert r.status_code == 201, r.text
        ds = r.json()
        assert ds["id"].startswith("ds.") and ds["rowCount"] == 2500
        assert ds["kind"] == "text" and ds["fields"] == ["text", "lang"]
        seen, cursor = [], None
        while True:
            page = await http.get(
                f"/v1/projects/{pid}/datasets/{ds['id']}/rows",
                params={"limit": 1000, **({"cursor": cursor} if cursor else {})},
                headers=acct.headers,
            )
            body = page.json()
            seen += body["data"]
            cursor = body["nextCursor"]
            if not cursor:
                break
    assert [r["data"]["text"] for r in seen] == [r["text"] for r in rows]
    assert all(r["version"] == 1 for r in seen)


async def test_csv_and_parquet_uploads(service):
    acct = make_account(service)
    table = pa.table({"text": ["a b", "c d", "e"], "score": [1, 2, 3]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    async with asgi_client(service, worker=False) as http:
        pid = await _project(http, acct)
        c = await http.post(
            f"/v1/projects/{pid}/datasets?name=csv",
            content=b'\xef\xbb\xbftext,lang\nhello,en\n"with, comma",fr\n',
            headers={**acct.headers, "Content-Type": "text/csv"},
        )
        p = await http.post(
            f"/v1/projects/{pid}/datasets?name=pq&format=parquet",
            content=buf.getvalue(),
            headers={**acct.headers, "Content-Type": "application/octet-stream"},
        )
        assert c.status_code == 201 and p.status_code == 201, (c.text, p.text)
        crow = await http.get(
            f"/v1/projects/{pid}/datasets/{c.json()['id']}/rows", headers=acct.headers
        )
        prow = await http.get(
            f"/v1/projects/{pid}/datasets/{p.json()['id']}/rows", headers=acct.headers
        )
    assert [r["data"] for r in crow.json()["data"]] == [
        {"text": "hello", "lang": "en"},
        {"text": "with, comma", "lang": "fr"},
    ]
    assert [r["data"] for r in prow.json()["data"]][2] == {"text": "e", "score": 3}


async def test_chat_sft_rows_and_edits_make_versions(service):
    acct = make_account(service)
    msgs = [{"role": "user", "content": "hi"}]
    async with asgi_client(service, worker=False) as http:
        pid = await _project(http, acct)
        r = await http.post(
            f"/v1/projects/{pid}/datasets?name=chat",
            content=jsonl([{"messages": msgs}, {"messages": msgs, "lang": "en"}]),
            headers={**acct.headers, "Content-Type": JSONL},
        )
        ds = r.json()
        assert ds["kind"] == "chat-sft"
        url = f"/v1/projects/{pid}/datasets/{ds['id']}/rows/1"
        edit = await http.patch(url, json={"data": {"lang": "de"}}, headers=acct.headers)
        broken = await http.patch(url, json={"data": {"messages": "nope"}}, headers=acct.headers)
        missing = await http.patch(
            f"/v1/projects/{pid}/datasets/{ds['id']}/rows/99",
            json={"data": {"a": 1}},
            headers=acct.headers,
        )
        rows = (
            await http.get(f"/v1/projects/{pid}/datasets/{ds['id']}/rows", headers=acct.headers)
        ).json()
    assert edit.status_code == 200, edit.text
    assert edit.json()["version"] == 2 and edit.json()["data"] == {"messages": msgs, "lang": "de"}
    assert broken.status_code == 400 and missing.status_code == 404
    assert rows["data"][0]["version"] == 2 and rows["data"][1]["version"] == 1
    versions = service.db.transact_sync(
        lambda c: c.execute(select(func.count()).select_from(dataset_rows)).scalar()
    )
    assert versions == 3


async def test_empty_dataset_and_bad_uploads_leave_nothing(service):
    acct = make_account(service)
    other = make_account(service, "other")
    async with asgi_client(service, worker=False) as http:
        pid = await _project(http, acct)
        empty = await http.post(
            f"/v1/projects/{pid}/datasets",
            json={"name": "e", "kind": "chat-sft"},
            headers=acct.headers,
        )
        bad_line = await http.post(
            f"/v1/projects/{pid}/datasets?name=b",
            content=jsonl([{"text": "ok"}] * 1500) + b"{nope\n",
            headers={**acct.headers, "Content-Type": JSONL},
        )
        not_chat = await http.post(
            f"/v1/projects/{pid}/datasets?name=b&kind=chat-sft",
            content=jsonl([{"text": "ok"}]),
            headers={**acct.headers, "Content-Type": JSONL},
        )
        fmt = await http.post(
            f"/v1/projects/{pid}/datasets?name=b",
            content=b"x",
            headers={**acct.headers, "Content-Type": "image/png"},
        )
        foreign_project = await http.post(
            f"/v1/projects/{pid}/datasets", json={"name": "x"}, headers=other.headers
        )
        foreign_ds = await http.get(
            f"/v1/projects/{pid}/datasets/{empty.json()['id']}", headers=other.headers
        )
    assert empty.status_code == 201 and empty.json()["rowCount"] == 0
    assert bad_line.status_code == 400
    assert bad_line.json()["error"]["code"] == "invalid_dataset_file"
    assert "line 1501" in bad_line.json()["error"]["message"]
    assert not_chat.status_code == 400
    assert fmt.status_code == 400 and fmt.json()["error"]["code"] == "unsupported_dataset_format"
    assert foreign_project.status_code == 404 and foreign_ds.status_code == 404
    counts = service.db.transact_sync(
        lambda c: (
            c.execute(select(func.count()).select_from(datasets)).scalar(),
            c.execute(select(func.count()).select_from(dataset_rows)).scalar(),
        )
    )
    assert counts == (1, 0)
