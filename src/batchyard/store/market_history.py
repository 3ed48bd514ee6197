"""What the deferred-batch worker saw, per route, kept so that a restart does not start blind.

``DeadlineAware`` builds its scenarios from each route's own past (see
``batchyard.core.outlook``); a worker that forgot that past at every deploy
would bet no deadline for its first day. One row per route and 15-second slot
(a worker pass): the discount the route guaranteed then, NULL where it had no
fresh payable price. Slots nobody observed have no row. A week of one route is
about 40,000 small rows.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Connection, Float, String, Table, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from batchyard.store.tables import metadata

__all__ = ["load_history", "market_history", "save_history"]

market_history = Table(
    "market_history",
    metadata,
    Column("route", String(200), primary_key=True),
    Column("slot", BigInteger, primary_key=True),
    Column("discount", Float, nullable=True),
)


def save_history(
    conn: Connection,
    routes: dict[str, list[tuple[int, float | None]]],
    *,
    keep_from: int | None = None,
) -> int:
    """Upsert each route's slots; drop slots older than ``keep_from``. Returns rows written."""
    rows = [
        {"route": route, "slot": slot, "discount": discount}
        for route, slots in routes.items()
        for slot, discount in slots
    ]
    if rows:
        insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
        stmt = insert(market_history)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["route", "slot"], set_={"discount": stmt.excluded.discount}
            ),
            rows,
        )
    if keep_from is not None:
        conn.execute(delete(market_history).where(market_history.c.slot < keep_from))
    return len(rows)


def load_history(conn: Connection, since: int) -> dict[str, list[tuple[int, float | None]]]:
    """Every route's slots from ``since`` on, in order."""
    out: dict[str, list[tuple[int, float | None]]] = {}
    query = (
        select(market_history.c.route, market_history.c.slot, market_history.c.discount)
        .where(market_history.c.slot >= since)
        .order_by(market_history.c.route, market_history.c.slot)
    )
    for route, slot, discount in conn.execute(query):
        out.setdefault(route, []).append((int(slot), None if discount is None else float(discount)))
    return out
