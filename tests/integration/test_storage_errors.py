"""A store that cannot write: 503 with ``retryable: true``, ``/readyz`` unready, no tracebacks.

SQLite's own ``PRAGMA query_only`` makes every write fail the way a
read-only file does ("attempt to write a readonly database"), whoever runs
the test (root writes through file modes). The operator commands meet a
database they cannot open at all, and say so in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import event

from tests.support.accounts import make_account
from tests.support.server import asgi_client
from tests.support.waits import HANG_S

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))


def read_only(svc, on: bool) -> None:
    """Every new connection of the service's store is read-only (or writable again)."""

    def set_mode(dbapi_conn, _record) -> None:
        dbapi_conn.execute(f"PRAGMA query_only={int(on)}")

    event.listen(svc.db.engine, "connect", set_mode)
    svc.db.engine.dispose()  # pooled connections are replaced by new ones


async def test_writes_answer_503_retryable_and_readyz_follows_the_store(service):
    acct = make_account(service)
    async with asgi_client(service, worker=False) as http:
        assert (await http.get("/readyz")).json() == {
            "status": "ready",
            "checks": {"store": {"ok": True}, "migrations": {"ok": True}, "limiter": {"ok": True}},
        }
        read_only(service, True)
        unready = await http.get("/readyz")
        alive = await http.get("/healthz")
        refused = await http.post("/v1/projects", json={"name": "p"}, headers=acct.headers)
        keyed = await http.post(
            "/v1/projects", json={"name": "p"}, headers={**acct.headers, "Idempotency-Key": "k"}
        )
        account = await http.get("/v1/account", headers=acct.headers)  # reads still work
        read_only(service, False)
        ready = await http.get("/readyz")
        again = await http.post(
            "/v1/projects", json={"name": "p"}, headers={**acct.headers, "Idempotency-Key": "k"}
        )

    assert unready.status_code == 503
    assert unready.json()["checks"]["store"]["ok"] is False
    assert "readonly" in unready.json()["checks"]["store"]["reason"]
    assert alive.status_code == 200
    for r in (refused, keyed):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "storage_unavailable"
        assert r.json()["error"]["retryable"] is True
        assert r.headers["retry-after"]
    assert account.status_code == 200
    assert ready.status_code == 200
    assert again.status_code == 201  # the refused claim left nothing behind


async def test_readyz_is_503_while_the_service_drains(service):
    async with asgi_client(service, worker=False) as http:
        service.begin_drain()
        r = await http.get("/readyz")
    assert (r.status_code, r.json()["status"]) == (503, "draining")


def _bad_databases(tmp_path: Path) -> dict[str, str]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    a_dir = tmp_path / "a-directory.db"
    a_dir.mkdir()
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(os.urandom(8192))
    return {
        "under a file": f"sqlite:///{a_file}/batchyard.db",
        "a directory": f"sqlite:///{a_dir}",
        "not a database": f"sqlite:///{garbage}",
        "nobody listening": "postgresql://postgres@127.0.0.1:1/nothing",
    }


@pytest.mark.parametrize("command", [["audit"], ["holds", "list"], ["keys", "list", "--org", "a"]])
def test_operator_commands_say_in_one_line_that_the_database_cannot_be_used(tmp_path, command):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHYARD_")}
    env["BATCHYARD_HOME"] = str(tmp_path / "home")
    for what, url in _bad_databases(tmp_path).items():
        out = subprocess.run(
            [BATCHYARD, *command, "--database", url],
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
        assert out.returncode == 1, (what, out.stderr)
        assert "Traceback" not in out.stderr, (what, out.stderr)
        assert "the database cannot be" in out.stderr, (what, out.stderr)


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_serve_and_worker_refuse_a_database_they_cannot_use_without_a_traceback(tmp_path, command):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHYARD_")}
    env["BATCHYARD_HOME"] = str(tmp_path / "home")
    url = _bad_databases(tmp_path)["not a database"]
    out = subprocess.run(
        [BATCHYARD, command, "--database", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "the database cannot be" in out.stderr
