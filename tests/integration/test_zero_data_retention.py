"""Zero data retention, set by an operator with the real ``batchyard`` command (issue 22).

``batchyard orgs retention --org NAME zero`` turns it on; the account shows it
(``GET /v1/account``); and a deferred batch submitted there still keeps its
Idempotency-Key: the same key and body name the same batch, another body is a
409, while no answer text is saved anywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import select

from batchyard.store.tables import idempotency_keys
from tests.support.accounts import make_account
from tests.support.deferred_batches import batch_body, feed_route, submit
from tests.support.server import asgi_client
from tests.support.waits import HANG_S

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))


def batchyard(database_url: str, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATCHYARD_DATABASE_URL": database_url, "BATCHYARD_HOME": str(home)}
    env.pop("BATCHYARD_CONFIG", None)
    return subprocess.run(
        [BATCHYARD, *args], env=env, capture_output=True, text=True, timeout=HANG_S, check=False
    )


async def test_an_operator_turns_it_on_and_submissions_keep_their_keys(market, tmp_path):
    svc = market(feed_route("spot"))
    acct = make_account(svc, "private-co", credit="5")
    url = svc.settings.database_url

    shown = batchyard(url, tmp_path, "orgs", "show", "--org", "private-co")
    assert shown.returncode == 0, shown.stderr
    assert "zero data retention off" in shown.stdout
    turned = batchyard(url, tmp_path, "orgs", "retention", "--org", "private-co", "zero")
    assert turned.returncode == 0, turned.stderr
    assert "zero data retention on" in turned.stderr
    shown = batchyard(url, tmp_path, "orgs", "show", "--org", "private-co")
    assert "zero data retention on" in shown.stdout
    unknown = batchyard(url, tmp_path, "orgs", "retention", "--org", "nobody", "zero")
    assert unknown.returncode != 0 and "no organisation called 'nobody'" in unknown.stderr
    assert "Traceback" not in unknown.stderr

    body = batch_body(2)
    body["requests"][0]["body"]["messages"] = [{"role": "user", "content": "secret plans"}]
    async with asgi_client(svc, worker=False) as http:
        account = await http.get("/v1/account", headers=acct.headers)
        first = await submit(http, acct.headers, body, key="zdr-batch-0001")
        again = await submit(http, acct.headers, body, key="zdr-batch-0001")
        other = await submit(http, acct.headers, batch_body(3), key="zdr-batch-0001")
        listed = await http.get("/v1/batches", headers=acct.headers)
    assert account.json()["zero_data_retention"] is True
    assert first.status_code == 201, first.text
    assert again.status_code == 201 and again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
    assert [b["id"] for b in listed.json()["data"]] == [first.json()["id"]]  # one batch, not three
    # What the key keeps is the submission's answer: the batch's ID and status, no text.
    assert "secret plans" not in first.text

    rows = svc.db.read_sync(lambda c: c.execute(select(idempotency_keys)).all())
    assert [(r.key, r.state) for r in rows] == [("zdr-batch-0001", "done")]


async def test_turning_it_off_again(market, tmp_path):
    svc = market(feed_route("spot"))
    acct = make_account(svc, "flip-co")
    url = svc.settings.database_url
    assert batchyard(url, tmp_path, "orgs", "retention", "--org", "flip-co", "zero").returncode == 0
    off = batchyard(url, tmp_path, "orgs", "retention", "--org", "flip-co", "standard")
    assert off.returncode == 0 and "zero data retention off" in off.stderr
    async with asgi_client(svc, worker=False) as http:
        account = await http.get("/v1/account", headers=acct.headers)
    assert account.json()["zero_data_retention"] is False
