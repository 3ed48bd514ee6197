"""Fault-test fixtures: real worker processes, reaped after every test, shown when one fails."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import pytest

from tests.support.private_servers import PrivatePostgres, PrivateRedis
from tests.support.processes import Workers


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, sqlite_url: str) -> str:
    """The database the test and its worker processes share: a SQLite file, then PostgreSQL."""
    if request.param == "postgres":
        url: str = request.getfixturevalue("pg_url")
        return url
    return sqlite_url


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    """A failed test's report carries the output of every worker process it started."""
    report = yield
    started = getattr(item, "funcargs", {}).get("workers")
    if report.failed and isinstance(started, Workers) and started.started:
        report.sections.append(("batchyard worker processes", started.report()))
    return report


@pytest.fixture(scope="session")
def private_pg() -> Iterator[PrivatePostgres]:
    """A PostgreSQL cluster of this session's own (never the shared one): tests may stop it."""
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def private_pg_url(private_pg: PrivatePostgres) -> str:
    """An empty database on the private cluster, which is running when the test starts."""
    if not private_pg.running:
        private_pg.start()  # a test that failed while it was down
    return private_pg.new_database()


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A redis-server of this test's own (never the shared one): the test may stop it."""
    server = PrivateRedis()
    try:
        server.start()
        yield server
    finally:
        server.close()
