"""``batchyard batches``: submit a JSONL file and wait, then list, get, cancel, download."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

from click.testing import CliRunner

from batchyard.cli.main import cli
from batchyard.store import file_batches as file_store
from tests.support.accounts import make_account
from tests.support.file_batches import chat_line, jsonl
from tests.support.server import live_server
from tests.support.workspace import answer_with


async def test_submit_wait_output_then_list_get_cancel_download(service, tmp_path):
    answer_with(service, "fine, thanks")
    acct = make_account(service, credit="1")
    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl([chat_line(f"q{i}", f"How are you, {i}?") for i in range(4)]))
    out = tmp_path / "answers.jsonl"

    async with live_server(service) as base:
        env = {"BATCHYARD_BASE_URL": base, "BATCHYARD_API_KEY": acct.key, "COLUMNS": "200"}

        def run(*args: str) -> tuple[int, str]:
            result = CliRunner().invoke(cli, ["batches", *args], env=env)
            return result.exit_code, result.output

        code, text = await asyncio.to_thread(
            run, "submit", str(source), "--wait", "--output", str(out), "--poll", "0.1"
        )
        assert code == 0, text
        batch_id = text.split(":", 1)[0]
        assert "completed, 4/4 answered, 0 failed, charged $" in text
        listed = await asyncio.to_thread(run, "list")
        got = await asyncio.to_thread(run, "get", batch_id)
        refused = await asyncio.to_thread(run, "cancel", batch_id)
        again = tmp_path / "again.jsonl"
        downloaded = await asyncio.to_thread(run, "download", batch_id, "--output", str(again))

    answers = [json.loads(x) for x in out.read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["q0", "q1", "q2", "q3"]
    assert answers[0]["response"]["body"]["choices"][0]["message"]["content"] == "fine, thanks"
    assert listed[0] == 0 and batch_id in listed[1]
    assert got[0] == 0 and json.loads(got[1])["status"] == "completed"
    assert refused[0] != 0 and "batch_not_cancellable" in refused[1]
    assert downloaded[0] == 0 and again.read_bytes() == out.read_bytes()


async def test_submit_a_longer_window_that_waits_for_a_price(service, tmp_path):
    acct = make_account(service, credit="1")
    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl([chat_line("q0")]))

    async with live_server(service) as base:
        env = {"BATCHYARD_BASE_URL": base, "BATCHYARD_API_KEY": acct.key, "COLUMNS": "200"}

        def run(*args: str) -> tuple[int, str]:
            result = CliRunner().invoke(cli, ["batches", *args], env=env)
            return result.exit_code, result.output

        code, text = await asyncio.to_thread(run, "submit", str(source), "--window", "72h")
        assert code == 0, text
        bad = await asyncio.to_thread(run, "submit", str(source), "--window", "36h")
    row = service.db.read_sync(lambda c: file_store.load_batch(c, text.split(":", 1)[0]))
    assert row is not None and row.completion_window == "72h"
    assert row.expires_at - row.created_at == timedelta(hours=72)
    assert bad[0] != 0 and "36h" in bad[1]
