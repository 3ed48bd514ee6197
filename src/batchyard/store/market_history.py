"""What the market worker saw, kept so that a restart does not start blind.

``DeadlineAware`` decides from analogues in a market's recent past (see
``batchyard.core.outlook``); a worker that forgot that past at every deploy
would spend its first day dispatching on the cold-start schedule. One row per
market and 2-minute bin: the deepest discount on offer then (NULL: nothing
payable). A week of one market is about 5,000 small rows.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Connection, Float, String, Table, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from batchyard.store.tables import metadata

__all__ = ["load_history", "market_history", "save_history"]

market_history = Table(
    "market_history",
    metadata,
    Column("market", String(400), primary_key=True),
    Column("bin", BigInteger, primary_key=True),
    Column("best", Float, nullable=True),
)


def save_history(
    conn: Connection,
    markets: dict[str, list[tuple[int, float | None]]],
    *,
    keep_from: int | None = None,
) -> int:
    """Upsert each market's bins; drop bins older than ``keep_from``. Returns rows written."""
    rows = [
        {"market": market, "bin": index, "best": best}
        for market, bins in markets.items()
        for index, best in bins
    ]
    if rows:
        insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
        stmt = insert(market_history)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["market", "bin"], set_={"best": stmt.excluded.best}
            ),
            rows,
        )
    if keep_from is not None:
        conn.execute(delete(market_history).where(market_history.c.bin < keep_from))
    return len(rows)


def load_history(conn: Connection, since: int) -> dict[str, list[tuple[int, float | None]]]:
    """Every market's bins from ``since`` on, in order."""
    out: dict[str, list[tuple[int, float | None]]] = {}
    query = (
        select(market_history.c.market, market_history.c.bin, market_history.c.best)
        .where(market_history.c.bin >= since)
        .order_by(market_history.c.market, market_history.c.bin)
    )
    for market, index, best in conn.execute(query):
        out.setdefault(market, []).append((int(index), None if best is None else float(best)))
    return out
