"""``batchyard serve``'s stderr is one JSON object a line, whatever a client sends.

A real process on SQLite: the operator's startup lines (``batchyard: …``) are
the CLI's own, and every other line is the log, which the docs promise is JSON.
A malformed multipart body made python-multipart write a plain-text warning
("Found invalid character 13 in header") to it; uvicorn wrote its own plain
lines. The same process answers a body over the limit to Python's ``urllib``
with the 413, and a wrong method with ``Allow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from batchyard.core.accounts import Scope
from batchyard.core.clock import SystemClock
from batchyard.core.money import to_ticks
from batchyard.store import accounts, ledger
from batchyard.store.database import Database
from tests.support.processes import wait_healthy
from tests.support.server import free_port
from tests.support.waits import HANG_S

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))

pytestmark = pytest.mark.model

#: A part whose header line has no colon: python-multipart stops at the CR.
BAD_MULTIPART = b"--b0undary\r\nContent-Disposition form-data\r\n\r\nbatch\r\n--b0undary--\r\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-logs")
    url = f"sqlite:///{tmp / 'served.db'}"
    port = free_port()
    # COLUMNS: rich does not wrap the CLI's own startup lines, so each is one line.
    env = {**os.environ, "BATCHYARD_HOME": str(tmp / "home"), "COLUMNS": "1000"}
    for name in ("BATCHYARD_CONFIG", "BATCHYARD_DATABASE_URL"):
        env.pop(name, None)
    stderr = (tmp / "stderr.log").open("w")
    proc = subprocess.Popen(
        [BATCHYARD, "serve", "--port", str(port), "--database", url],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, output=(tmp / "stderr.log").read_text)
        db = Database(url, pool_size=1)
        now = SystemClock().now()

        def setup(conn):
            org = accounts.ensure_org(conn, "served", now)
            _, secret = accounts.create_key(conn, org.id, Scope.FULL, now)
            ledger.top_up(conn, org.id, to_ticks(Decimal("5")), now)
            return secret

        key = db.transact_sync(setup)
        db.close()
        yield base, key, proc, tmp / "stderr.log"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()


def bad_multipart(base: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/files",
        content=BAD_MULTIPART,
        headers={
            "Authorization": f"Bearer {key}",
            "Content-Type": "multipart/form-data; boundary=b0undary",
        },
    )


def test_a_bad_multipart_body_is_a_coded_400(served):
    base, key, _, _ = served
    r = bad_multipart(base, key)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["type"]) == (
        "invalid_upload",
        "invalid_request_error",
    )


def test_urllib_reads_the_413_from_batchyard_serve(served):
    base, key, _, _ = served
    body = json.dumps({"model": "kettei-core", "input": "x" * (5 * 1024 * 1024)}).encode()
    request = urllib.request.Request(
        f"{base}/v1/embeddings",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=HANG_S)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["code"] == "request_too_large"


def test_a_405_from_batchyard_serve_says_allow(served):
    base, key, _, _ = served
    r = httpx.put(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_every_log_line_is_json_after_a_bad_multipart_body(served):
    base, key, proc, log = served
    assert bad_multipart(base, key).status_code == 400
    # A request that logs nothing more: once it is answered, every line before it is written.
    assert httpx.get(f"{base}/healthz").status_code == 200
    assert proc.poll() is None
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    logged = [line for line in lines if not line.startswith("batchyard")]
    not_json = []
    for line in logged:
        try:
            assert isinstance(json.loads(line), dict)
        except (ValueError, AssertionError):
            not_json.append(line)
    assert not_json == [], not_json
    # uvicorn's own lines are among them, as JSON.
    assert any(json.loads(line)["logger"].startswith("uvicorn") for line in logged), lines
