"""One way for a test to get a wired service: ``ServiceFactory``, the ``make_service`` fixture.

Every service a test makes comes from the composition root (``batchyard.app.build_service``),
on the test's clock and database, with the settings it overrides; each ends with the ledger
audit and the check of every charge against its usage (``store.billing.audit_charges``), so no
test can leave money unaccounted for, or a charge that is not its usage, without failing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from batchyard.app import build_service
from batchyard.core.clock import Clock
from batchyard.core.config import Settings
from batchyard.engines.protocol import Engine
from batchyard.service import Service
from batchyard.store import billing, ledger

__all__ = ["ServiceFactory"]


class ServiceFactory:
    """``make(**settings_overrides, engines=..., clock=..., postgres=...)`` -> a ``Service``.

    Overrides replace fields of the test's ``Settings`` (``catalog``, ``tiers``,
    ``raw`` ...). The database is already migrated (copied from the session's
    template), so making a service costs no migration: the test's SQLite file, or
    with ``postgres=True`` a PostgreSQL database of its own that lives until the
    service has been audited and stopped.
    """

    def __init__(
        self,
        settings: Settings,
        clock: Clock,
        pg_database: Callable[[], Iterator[str]] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.made: list[Service] = []
        self._pg_database = pg_database
        self._databases: list[Iterator[str]] = []
        self._over_holds: dict[int, int] = {}

    def __call__(
        self,
        *,
        engines: dict[str, Engine] | None = None,
        clock: Clock | None = None,
        postgres: bool = False,
        **overrides: Any,
    ) -> Service:
        if postgres:
            assert self._pg_database is not None, "no PostgreSQL for this factory"
            database = self._pg_database()
            self._databases.append(database)
            overrides["database_url"] = next(database)
        settings = dataclasses.replace(self.settings, **overrides)
        svc = build_service(settings, clock=clock or self.clock, engines=engines)
        svc.db.migrate()
        self.made.append(svc)
        return svc

    def expect_over_hold(self, svc: Service, count: int) -> None:
        """The test charges ``count`` holds above what they held on purpose (an operator's
        settlement): the audit must list exactly those, and the ledger is otherwise sound."""
        self._over_holds[id(svc)] = count

    async def close(self) -> None:
        """Audit and stop every service made; an unsound ledger fails the test."""
        problems: list[tuple[str, list[str]]] = []
        for svc in self.made:
            found = svc.db.read_sync(ledger.audit) + svc.db.read_sync(billing.audit_charges)
            expected = self._over_holds.get(id(svc), 0)
            over = [f for f in found if "above its hold" in f]
            if expected and len(over) == expected:
                found = [f for f in found if f not in over]
            if found:
                problems.append((svc.settings.database_url, found))
            await svc.stop()
        self.made.clear()
        for database in self._databases:
            database.close()  # dropped only now, after its service stopped
        self._databases.clear()
        assert problems == [], problems
