"""``batchyard serve`` as an operator starts it: a real process, on SQLite and on PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from batchyard.core.accounts import Scope
from batchyard.core.clock import SystemClock
from batchyard.core.config import normalise_database_url
from batchyard.core.money import to_ticks
from batchyard.store import accounts, ledger
from batchyard.store.database import Database
from tests.support.processes import wait_healthy
from tests.support.server import free_port
from tests.support.waits import HANG_S

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))
PG_ADMIN = os.environ.get(
    "BATCHYARD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


class Served:
    def __init__(self, base_url: str, database_url: str, key: str, org_id: str) -> None:
        self.base_url = base_url
        self.database_url = database_url
        self.key = key
        self.org_id = org_id

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    pg_name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp / 'served.db'}"
    else:
        pg_name = f"by_test_serve_{uuid.uuid4().hex[:12]}"
        admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{pg_name}"'))
        # As an operator writes it: plain postgresql://, no driver name.
        url = f"postgresql://postgres@127.0.0.1:5432/{pg_name}"
    port = free_port()
    env = {**os.environ, "BATCHYARD_HOME": str(tmp / "home")}
    for name in ("BATCHYARD_CONFIG", "BATCHYARD_DATABASE_URL"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [BATCHYARD, "serve", "--port", str(port), "--database", url, "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, output=lambda: proc.stdout.read() if proc.stdout else "")
        # The server migrated the database; an operator's key and credit go into it.
        db = Database(normalise_database_url(url), pool_size=1)
        now = SystemClock().now()

        def setup(conn):
            org = accounts.ensure_org(conn, "served", now)
            _, secret = accounts.create_key(conn, org.id, Scope.FULL, now)
            ledger.top_up(conn, org.id, to_ticks(Decimal("5")), now)
            return org.id, secret

        org_id, key = db.transact_sync(setup)
        db.close()
        yield Served(base, normalise_database_url(url), key, org_id)
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        code = proc.wait(timeout=HANG_S)
        output = proc.stdout.read()
        assert code == 0, output  # a clean drain is a clean exit (issue 22)
        assert "Traceback" not in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pg_name is not None:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)'))
            admin.dispose()


def _audit(url: str) -> list[str]:
    db = Database(url, pool_size=1)
    try:
        return db.read_sync(ledger.audit)
    finally:
        db.close()


def test_serve_answers_health_and_account(served):
    assert httpx.get(f"{served.base_url}/healthz").json() == {"status": "ok"}
    r = httpx.get(f"{served.base_url}/v1/account", headers=served.headers)
    assert r.status_code == 200, r.text
    assert r.json()["credit"]["available"] == "5"
    models = httpx.get(f"{served.base_url}/v1/models", headers=served.headers).json()["data"]
    assert {m["id"] for m in models if m["available"]} == {"kettei-core"}


@pytest.mark.model
def test_a_real_completion_on_the_embedded_model_is_billed(served):
    r = httpx.post(
        f"{served.base_url}/v1/chat/completions",
        json={
            "model": "kettei-core",
            "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 12,
            "temperature": 0,
        },
        headers={**served.headers, "Idempotency-Key": "serve-1"},
        timeout=HANG_S,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].strip()
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 12
    assert Decimal(body["charge"]) > 0
    account = httpx.get(f"{served.base_url}/v1/account", headers=served.headers).json()
    assert Decimal(account["credit"]["available"]) == Decimal("5") - Decimal(body["charge"])
    assert account["credit"]["held"] == "0"
    assert _audit(served.database_url) == []
