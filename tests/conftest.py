"""Fixtures shared by every tier of tests.

- ``clock``: a ManualClock; time-dependent rules are tested by moving it.
- ``settings`` / ``service``: a fresh SQLite file per test by default; tests
  marked ``postgres`` (or the ``pg_url`` fixture) get a fresh PostgreSQL
  database on 127.0.0.1:5432.
- ``audit_after``: every test that uses ``service`` ends with the ledger audit.
- ``market``: makes deferred-batch services on a scripted market
  (``tests.support.batches.market_factory``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from batchyard.app import build_service
from batchyard.core.clock import ManualClock
from batchyard.core.config import Settings, load_settings
from batchyard.service import Service
from batchyard.store import ledger

PG_ADMIN = os.environ.get(
    "BATCHYARD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("BATCHYARD_TEST_REDIS", "redis://127.0.0.1:6379/0")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'batchyard.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    name = f"by_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def settings(sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("BATCHYARD_HOME", str(tmp_path))
    monkeypatch.delenv("BATCHYARD_CONFIG", raising=False)
    monkeypatch.delenv("BATCHYARD_DATABASE_URL", raising=False)
    return load_settings(database_url=sqlite_url)


@pytest.fixture
async def service(settings: Settings, clock: ManualClock) -> AsyncIterator[Service]:
    """A migrated service on SQLite with the manual clock (engines: the defaults)."""
    svc = build_service(settings, clock=clock)
    svc.db.migrate()
    try:
        yield svc
    finally:
        problems = svc.db.read_sync(ledger.audit)
        await svc.stop()
        assert problems == [], problems


@pytest.fixture
async def market(settings: Settings, clock: ManualClock) -> AsyncIterator[Callable[..., Service]]:
    from tests.support.batches import market_factory

    async with market_factory(settings, clock) as make:
        yield make
