"""The stuck-work watch: work that stopped moving is counted, told to its owner, and explained.

Every worker process runs it (a ``Periodic`` sweep, a quarter of
``stuck_after_s`` apart, at most a minute). Each sweep reads the work with
units left whose progress has not moved for ``stuck_after_s``
(``store.stuck.idle_work``), and for each standstill not yet noticed records
one ``work_stuck`` activity entry in its owner's ``GET /v1/activity`` and
counts it (``batchyard_work_stuck_total``), with the reason it waits:

- ``route_down``: the route of a model it waits for refuses connections (or
  the model has no route), as this process's last call to it found
  (``work.route_health``); its units wait for the route instead of failing;
- ``limits``: that route's upstream answered 429, and the calls wait out its
  penalty;
- ``market``: it waits for a discount no route's fresh price meets, or for a
  price its window lets it wait for (a file batch's window over 24 h);
- ``unknown``: none of these; the worker's log says more.

The sweep also rewrites one row of ``store_probes`` (``WATCH_PROBE``), so
``batchyard stuck`` can tell a standstill no worker is watching (``no_worker``)
from one a worker has explained.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog
from batchyard.core.clock import Clock, isoformat
from batchyard.core.telemetry import Recorder
from batchyard.errors import ModelUnavailable
from batchyard.store import activity, health, stuck
from batchyard.store.database import Database
from batchyard.work.file_batches.lines import plan_for
from batchyard.work.market_prices import MarketPrices
from batchyard.work.route_health import RouteHealth

__all__ = ["WATCH_PROBE", "StuckWatch", "Why", "listing", "watch_interval_s"]

log = logging.getLogger("batchyard.stuck")

#: The ``store_probes`` row each sweep rewrites: when a worker last watched.
WATCH_PROBE = "stuck_watch"


def watch_interval_s(stuck_after_s: float) -> float:
    """How often the watch sweeps: a quarter of the stuck time, between 1 s and a minute."""
    return max(1.0, min(stuck_after_s / 4, 60.0))


@dataclass(frozen=True, slots=True)
class Why:
    """Why a piece of work waits: a reason code and a sentence for its owner."""

    reason: str
    detail: str


class StuckWatch:
    """Finds work that stopped moving and says why, once a standstill (see the module docstring)."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        catalog: Catalog,
        health: RouteHealth,
        prices: MarketPrices,
        metrics: Recorder,
        stuck_after_s: float,
    ) -> None:
        self.db = db
        self.clock = clock
        self.catalog = catalog
        self.health = health
        self.prices = prices
        self.metrics = metrics
        self.stuck_after_s = stuck_after_s
        self.interval_s = watch_interval_s(stuck_after_s)

    def why(self, work: stuck.Idle, now: datetime) -> Why:
        """The first reason that holds, in the order the module docstring lists them."""
        routes = []
        for model in work.models:
            try:
                route = self.catalog.route_for(model)
            except ModelUnavailable:
                return Why("route_down", f"no route serves {model}")
            routes.append(route)
            trouble = self.health.trouble(route.id)
            if trouble is not None and trouble.kind == "route_down":
                return Why(
                    "route_down",
                    f"route {route.id} has refused connections since "
                    f"{isoformat(trouble.since)} ({trouble.detail})",
                )
        for route in routes:
            trouble = self.health.trouble(route.id)
            if trouble is not None and trouble.kind == "limits":
                return Why(
                    "limits",
                    f"route {route.id}'s upstream has answered 429 since "
                    f"{isoformat(trouble.since)}; its calls wait out the penalty",
                )
        if work.waits_until is not None and now < work.waits_until:
            return Why(
                "market",
                f"its window lets it wait for a price until {isoformat(work.waits_until)}",
            )
        if work.min_discount is not None:
            wanted = Decimal(work.min_discount)
            if all(
                plan_for(self.catalog, self.prices, m, wanted, now) is None for m in work.models
            ):
                return Why(
                    "market",
                    f"no route's fresh price meets its discount of {work.min_discount}",
                )
        return Why("unknown", "a worker is running but has not moved it; see the worker's log")

    async def sweep(self) -> int:
        """One look; how many standstills were newly noticed."""
        now = self.clock.now()
        before = now - timedelta(seconds=self.stuck_after_s)

        def tx(conn: Connection) -> list[tuple[stuck.Idle, Why]]:
            health.probe(conn, WATCH_PROBE, now)
            idle = stuck.idle_work(conn, before)
            seen = stuck.noticed(conn, idle)
            fresh = []
            for work in idle:
                if work.id in seen:
                    continue
                why = self.why(work, now)
                activity.record(
                    conn,
                    work.org_id,
                    stuck.STUCK_KIND,
                    now,
                    ref=work.id,
                    detail={
                        "work": work.kind,
                        "since": isoformat(work.since),
                        "left": work.left,
                        "reason": why.reason,
                        "action": why.detail,
                    },
                )
                fresh.append((work, why))
            return fresh

        fresh = await self.db.transact(tx)
        for work, why in fresh:
            self.metrics.work_stuck(work.kind, why.reason)
            log.warning(
                "work stuck",
                extra={
                    "event": "work_stuck",
                    "kind": work.kind,
                    "id": work.id,
                    "reason": why.reason,
                    "since": isoformat(work.since),
                },
            )
        return len(fresh)


def listing(conn: Connection, now: datetime, stuck_after_s: float) -> list[dict[str, Any]]:
    """Stuck work as ``batchyard stuck`` lists it: each piece with its reason and what to do.

    The reason is the one the watch recorded for this standstill; ``no_worker``
    where no worker has swept for two of its intervals (none is running, so
    nothing will move the work); ``checking`` where a worker is running but
    has not looked at this standstill yet.
    """
    interval = watch_interval_s(stuck_after_s)
    idle = stuck.idle_work(conn, now - timedelta(seconds=stuck_after_s))
    seen = stuck.noticed(conn, idle)
    watched = health.probed_at(conn, WATCH_PROBE)
    watching = watched is not None and watched >= now - timedelta(seconds=2 * interval + 5)
    found = []
    for work in idle:
        if not watching:
            last = f"since {isoformat(watched)}" if watched else "ever"
            why = Why("no_worker", f"no worker has watched {last}: start `batchyard worker`")
        elif work.id in seen:
            why = Why(seen[work.id]["reason"], seen[work.id]["action"])
        else:
            why = Why("checking", f"a worker will say why within {interval:g} s")
        found.append({**work.to_json(), "reason": why.reason, "detail": why.detail})
    return found
