"""``/readyz`` names the check that fails: a limiter it cannot reach, a schema behind the code."""

from __future__ import annotations

from alembic.script import ScriptDirectory
from sqlalchemy import text

from batchyard.store.migrations import alembic_config
from tests.support.server import asgi_client, free_port


async def test_every_check_passes_on_a_migrated_store_with_the_sql_limiter(make_service):
    svc = make_service(postgres=True, limiter_url="sql")
    async with asgi_client(svc, worker=False) as http:
        r = await http.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["checks"] == {
        "store": {"ok": True},
        "migrations": {"ok": True},
        "limiter": {"ok": True},
    }


async def test_a_redis_limiter_on_a_closed_port_is_503_and_named(make_service):
    closed = free_port()  # nothing listens there
    svc = make_service(limiter_url=f"redis://127.0.0.1:{closed}/0")
    async with asgi_client(svc, worker=False) as http:
        r = await http.get("/readyz")
        alive = await http.get("/healthz")
    assert r.status_code == 503
    checks = r.json()["checks"]
    assert r.json()["status"] == "unready"
    assert checks["store"] == {"ok": True} and checks["migrations"] == {"ok": True}
    assert checks["limiter"]["ok"] is False
    assert "ConnectionError" in checks["limiter"]["reason"], checks["limiter"]
    assert alive.status_code == 200  # alive, only not ready


async def test_a_database_whose_revision_is_behind_the_code_is_503_and_named(make_service):
    svc = make_service(postgres=True)
    script = ScriptDirectory.from_config(alembic_config())
    (head,) = script.get_heads()
    previous = script.get_revision(head).down_revision
    assert isinstance(previous, str)

    def set_revision(rev: str) -> None:
        with svc.db.engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": rev})

    async with asgi_client(svc, worker=False) as http:
        set_revision(previous)  # as if older code had migrated it last
        behind = await http.get("/readyz")
        set_revision(head)
        current = await http.get("/readyz")
    assert behind.status_code == 503
    check = behind.json()["checks"]["migrations"]
    assert check["ok"] is False
    assert previous in check["reason"] and head in check["reason"]
    assert behind.json()["checks"]["store"] == {"ok": True}
    assert current.status_code == 200
