"""The order in which a batch's items end: what lets a reader follow a batch while it runs.

Items end out of input order (lines finish as their calls do), so a reader
who wants each finished item once, while the rest still run, needs a cursor
that only moves forward. Each batch row keeps a counter (``ended_seq``); a
transaction that ends items takes the next numbers from it and writes one
on each item. Taking them is an ``UPDATE`` of the batch row, which holds the
row's lock until the transaction commits: a second transaction that ends
items of the same batch waits for the first, so numbers become visible in
the order they were taken. A reader that has seen number ``n`` has seen
every number below it, and asking for "after ``n``" never skips an item
nor returns one twice. (A plain sequence could not promise that: a number
taken by a transaction that commits late would appear below the cursor.)

Numbers taken by a transaction whose items were not written after all (a
worker that lost its lease writes nothing) leave gaps, which a cursor
does not mind.
"""

from __future__ import annotations

from sqlalchemy import Column, Connection, Table, update

__all__ = ["take"]


def take(conn: Connection, table: Table, key: Column[str], key_value: str, count: int) -> int:
    """Reserve ``count`` numbers on the batch row; the first of them (1-based).

    ``table`` is the batch table, ``key`` its id column; the row's
    ``ended_seq`` counter moves by ``count``.
    """
    if count <= 0:
        return 0
    taken = conn.execute(
        update(table)
        .where(key == key_value)
        .values(ended_seq=table.c.ended_seq + count)
        .returning(table.c.ended_seq)
    ).scalar_one_or_none()
    if taken is None:
        return 0
    return int(taken) - count + 1
