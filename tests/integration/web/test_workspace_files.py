"""File batches in the workspace: upload a file, follow it, read its answers, download its files."""

from __future__ import annotations

import re
from datetime import timedelta

from batchyard.core.clock import isoformat, parse_iso
from tests.support.accounts import make_account
from tests.support.deferred_batches import batch_body, worker
from tests.support.file_batches import chat_line, jsonl
from tests.support.file_batches import worker as file_worker
from tests.support.server import asgi_app
from tests.support.workspace import answer_with, csrf_of, signed_in, submit_form


async def test_upload_follow_read_answers_and_download(service):
    answer_with(service, "a short answer")
    acct = make_account(service, credit="1")
    content = jsonl([chat_line(f"row-{i}", f"Question {i}?") for i in range(3)])
    async with asgi_app(service, worker=False) as client, client() as http:
        page = await signed_in(http, acct.key)
        r = await http.post(
            "/workspace/files",
            data={"csrf": csrf_of(page), "completion_window": "6h"},
            files={"file": ("questions.jsonl", content, "application/jsonl")},
        )
        assert r.status_code == 303, r.text
        url = r.headers["location"]
        assert url.startswith("/workspace/file-batches/bat.")
        running = (await http.get(url)).text
        assert 'id="status">in_progress<' in running and "0 of 3" in running
        assert '<meta http-equiv="refresh"' in running
        await file_worker(service).run_until_idle()
        done = (await http.get(url)).text
        listing = (await http.get("/workspace/batches")).text
        (output,) = re.findall(r'id="download-output" href="([^"]+)"', done)
        downloaded = await http.get(output)
        forged = await http.post(
            "/workspace/files",
            data={"csrf": "forged"},
            files={"file": ("x.jsonl", content, "application/jsonl")},
        )
        bad = await http.post(
            "/workspace/files",
            data={"csrf": csrf_of(page)},
            files={"file": ("x.jsonl", b"{oops\n", "application/jsonl")},
        )
        # A line that is not JSON uploads, and the batch fails naming it (OpenAI's order).
        assert bad.status_code == 303, bad.text
        failed = (await http.get(bad.headers["location"])).text
    assert 'id="status">completed<' in done and "3 of 3" in done
    assert done.count("a short answer") == 3 and "row-2" in done
    assert 'id="charge">$0.' in done
    assert url.rsplit("/", 1)[1] in listing and 'id="file-batches"' in listing
    assert downloaded.headers["content-disposition"].startswith("attachment;")
    assert [ln for ln in downloaded.text.splitlines() if '"custom_id":"row-0"' in ln]
    assert forged.status_code == 403
    assert 'id="status">failed<' in failed
    assert "<code>invalid_json</code> line 1: the line is not valid JSON" in failed


async def test_a_deferred_batch_page_shows_its_answers(service):
    answer_with(service, "the release summary")
    acct = make_account(service, credit="1")
    async with asgi_app(service, worker=False) as client, client() as http:
        await signed_in(http, acct.key)
        import json

        r = await submit_form(http, json.dumps(batch_body(1)))
        assert r.status_code == 303, r.text
        await worker(service).run_pass()
        page = (await http.get(r.headers["location"])).text
    assert "the release summary" in page


async def test_the_file_batch_list_shows_when_each_batch_was_created_and_its_deadline(
    service, clock
):
    answer_with(service, "a short answer")
    acct = make_account(service, credit="1")
    created = isoformat(clock.now())
    content = jsonl([chat_line("row-0", "Question?")])
    async with asgi_app(service, worker=False) as client, client() as http:
        page = await signed_in(http, acct.key)
        r = await http.post(
            "/workspace/files",
            data={"csrf": csrf_of(page), "completion_window": "6h"},
            files={"file": ("questions.jsonl", content, "application/jsonl")},
        )
        assert r.status_code == 303, r.text
        clock.advance(90)  # the page is read later: it must show when the batch was made
        listing = (await http.get("/workspace/batches")).text
    table = listing.split('id="file-batches"', 1)[1].split("</table>", 1)[0]
    heads = re.findall(r"<th>([^<]+)</th>", table)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", table.split("<tbody>", 1)[1], re.S)
    column = dict(zip(heads, cells, strict=True))
    deadline = isoformat(parse_iso(created) + timedelta(hours=6))
    assert column["Created"] == created
    assert column["Deadline"] == deadline
