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


async def test_a_database_at_another_revision_than_the_code_is_503_and_named(make_service):
    svc = make_service(postgres=True)
    (head,) = ScriptDirectory.from_config(alembic_config()).get_heads()

    def set_revision(rev: str | None) -> None:
        with svc.db.engine.begin() as conn:
            conn.execute(text("DELETE FROM alembic_version"))
            if rev is not None:
                conn.execute(text("INSERT INTO alembic_version VALUES (:v)"), {"v": rev})

    async with asgi_client(svc, worker=False) as http:
        set_revision(None)  # as if no migration had run
        behind = await http.get("/readyz")
        set_revision("f00dfeed")  # as if newer code had migrated it last
        ahead = await http.get("/readyz")
        set_revision(head)
        current = await http.get("/readyz")
    for answer, at in ((behind, "none"), (ahead, "f00dfeed")):
        assert answer.status_code == 503
        check = answer.json()["checks"]["migrations"]
        assert check["ok"] is False
        assert f"at revision {at};" in check["reason"] and head in check["reason"]
        assert answer.json()["checks"]["store"] == {"ok": True}
    assert current.status_code == 200
