"""Fixtures shared by every tier of tests.

- ``clock``: a ManualClock; time-dependent rules are tested by moving it.
- ``sqlite_url`` / ``pg_url``: a database of the test's own, already migrated. Each is a
  copy of a template migrated once per session (a file copy on SQLite, ``CREATE DATABASE
  ... TEMPLATE`` on PostgreSQL), so a test pays for a copy, not for the migrations.
  ``pg_empty_url`` is an empty PostgreSQL database, for the migration tests.
- ``settings`` / ``make_service`` / ``service``: services built by the composition root on
  the test's clock and database (``tests.support.services``); each ends with the ledger
  audit.
- ``market``: makes deferred-batch services on a scripted market
  (``tests.support.deferred_batches``).
- Every test: each answer it got from an app started by ``tests.support.server`` is checked
  against that app's OpenAPI document (``tests.support.wire_check``); a mismatch fails the
  test, and the run ends by saying how many answers were checked.
- Hypothesis tests check properties, not speed: its wall-time checks (the 200 ms deadline,
  the "input generation is slow" health check) are off, since a loaded machine (two test
  processes beside other builds) made them fail tests whose code was right.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from sqlalchemy import Engine, create_engine, text

from batchyard.core.clock import ManualClock
from batchyard.core.config import Settings, load_settings
from batchyard.service import Service
from batchyard.store.database import Database
from tests.support.processes import Workers
from tests.support.services import ServiceFactory
from tests.support.wire_check import WIRE

PG_ADMIN = os.environ.get(
    "BATCHYARD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("BATCHYARD_TEST_REDIS", "redis://127.0.0.1:6379/0")

hypothesis_settings.register_profile(
    "batchyard", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
hypothesis_settings.load_profile("batchyard")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "batchyard.db"
    db = Database(f"sqlite:///{path}", pool_size=1)
    db.migrate()
    db.close()
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path, _sqlite_template: Path) -> str:
    """A migrated SQLite file of this test's own (a copy of the session's template)."""
    path = tmp_path / "batchyard.db"
    shutil.copyfile(_sqlite_template, path)
    return f"sqlite:///{path}"


def _pg_url(name: str) -> str:
    return PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(scope="session")
def _pg_admin() -> Iterator[Engine]:
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    yield admin
    admin.dispose()


@pytest.fixture(scope="session")
def _pg_template(_pg_admin: Engine) -> Iterator[str]:
    """A database migrated once per session; tests get copies of it."""
    name = f"by_template_{uuid.uuid4().hex[:12]}"
    with _pg_admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    db = Database(_pg_url(name), pool_size=1)
    db.migrate()
    db.close()  # a template must have no connections while it is copied
    try:
        yield name
    finally:
        with _pg_admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _pg_database(admin: Engine, template: str | None) -> Iterator[str]:
    name = f"by_test_{uuid.uuid4().hex[:12]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"{clause}'))
    try:
        yield _pg_url(name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_url(_pg_admin: Engine, _pg_template: str) -> Iterator[str]:
    """A migrated PostgreSQL database for one test, dropped afterwards."""
    yield from _pg_database(_pg_admin, _pg_template)


@pytest.fixture
def pg_empty_url(_pg_admin: Engine) -> Iterator[str]:
    """An empty PostgreSQL database for one test (what migrations start from)."""
    yield from _pg_database(_pg_admin, None)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    """Starts real ``batchyard`` processes (``tests.support.processes``); all reaped at the end."""
    started = Workers(tmp_path)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def settings(sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("BATCHYARD_HOME", str(tmp_path))
    monkeypatch.delenv("BATCHYARD_CONFIG", raising=False)
    monkeypatch.delenv("BATCHYARD_DATABASE_URL", raising=False)
    # The tests were written for the embedded route's two slots (its width sets how many
    # calls a run or a file batch has in flight); the product's default is 8.
    return load_settings(database_url=sqlite_url, embedded_slots=2)


@pytest.fixture
async def make_service(
    settings: Settings, clock: ManualClock, request: pytest.FixtureRequest
) -> AsyncIterator[ServiceFactory]:
    """Services on this test's settings and clock; each audited and stopped afterwards."""

    def pg_database() -> Iterator[str]:
        admin = request.getfixturevalue("_pg_admin")
        return _pg_database(admin, request.getfixturevalue("_pg_template"))

    factory = ServiceFactory(settings, clock, pg_database)
    try:
        yield factory
    finally:
        await factory.close()


@pytest.fixture
def service(make_service: ServiceFactory) -> Service:
    """A migrated service on SQLite with the manual clock (engines: the defaults)."""
    return make_service()


@pytest.fixture
def market(make_service: ServiceFactory) -> Callable[..., Service]:
    from tests.support.deferred_batches import market_factory

    return market_factory(make_service)


# The longest tests (the embedded model answering whole examples, a worker killed three
# times), started first: with two test processes (``-n 2 --dist worksteal``) a long test
# that starts last holds the whole run up by its own length.
LONGEST_FIRST = (
    "tests/integration/client/test_first_run.py",
    "tests/integration/client/test_analyse_comments_example.py",
    "tests/faults/test_file_batch_worker_killed.py",
    "tests/integration/api/test_decide_model.py",
    "tests/integration/api/test_runs.py::test_a_run_on_the_embedded_model_end_to_end",
    "tests/integration/api/test_openai_sdk_batches.py",
    "tests/integration/test_demo.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        for i, prefix in enumerate(LONGEST_FIRST):
            if item.nodeid.startswith(prefix):
                return i
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every other test keeps its order


@pytest.fixture(autouse=True)
def _answers_match_the_openapi_document() -> Iterator[None]:
    """Fails the test when an answer it got is not one the OpenAPI document promises."""
    seen = len(WIRE.mismatches)
    yield
    found = WIRE.mismatches[seen:]
    if found:
        shown = "\n".join(found[:20])
        more = f"\n... and {len(found) - 20} more" if len(found) > 20 else ""
        pytest.fail(f"{len(found)} answers disagree with the OpenAPI document:\n{shown}{more}")


_WIRE_KEY = "wire_checked"


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)  # an xdist worker
    if output is not None:
        output[_WIRE_KEY] = WIRE.checked


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the controller adds its workers' counts
def pytest_testnodedown(node: object, error: object) -> None:
    WIRE.checked += int(getattr(node, "workeroutput", {}).get(_WIRE_KEY, 0))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if WIRE.checked:
        terminalreporter.write_line(f"openapi: {WIRE.checked} answers checked against the document")
