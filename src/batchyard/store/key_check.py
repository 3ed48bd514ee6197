"""Which batch key sealed this database's data, so a wrong or lost key is refused at start.

Sealed text (``store.at_rest``, deferred batches, file lines) opens only with
the key that sealed it. A process started with another key used to start
normally and answer 500 on every read of sealed data; one whose ``batch.key``
was lost made a new key over the old data. The database now keeps one row: the
fingerprint (``core.sealing.key_fingerprint``, an HMAC of a constant under the
key, which does not reveal it) of the key its data is sealed with, written
the first time a process with a key starts on it. ``verify`` compares it; a
database that has sealed data but no row (sealed before this check existed)
is tested by opening one sealed blob, and its key recorded once that works.

``sealed_data`` answers without a key, so a process can refuse to make a new
key file over data it could never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import (
    Column,
    Connection,
    Integer,
    String,
    Table,
    insert,
    inspect,
    or_,
    select,
    update,
)

from batchyard.core.sealing import Sealer, SealError
from batchyard.store.at_rest import PREFIX
from batchyard.store.deferred_batch_tables import batch_items
from batchyard.store.file_batches import file_batch_lines
from batchyard.store.files import file_lines, line_aad
from batchyard.store.projects import dataset_rows
from batchyard.store.runs import run_items
from batchyard.store.tables import UtcDateTime, idempotency_keys, metadata

__all__ = ["KeyVerdict", "batch_key_checks", "recorded", "sealed_data", "verify"]

# One row (id 1): the fingerprint of the key this database's data is sealed with.
batch_key_checks = Table(
    "batch_key_checks",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("fingerprint", String(64), nullable=False),
    Column("recorded_at", UtcDateTime(), nullable=False),
)


def recorded(conn: Connection) -> str | None:
    """The fingerprint on record, or None before any key was recorded."""
    return conn.execute(
        select(batch_key_checks.c.fingerprint).where(batch_key_checks.c.id == 1)
    ).scalar_one_or_none()


def sealed_data(conn: Connection) -> bool:
    """Whether anything in the store is sealed (one cheap look per place that seals).

    Tables an older schema lacks are skipped, so this answers before migrating.
    """
    present = set(inspect(conn).get_table_names())
    looks = (
        select(batch_items.c.id).where(
            or_(batch_items.c.body.is_not(None), batch_items.c.result.is_not(None))
        ),
        select(file_lines.c.file_id),
        select(file_batch_lines.c.batch_id).where(file_batch_lines.c.out.is_not(None)),
        select(dataset_rows.c.dataset_id).where(dataset_rows.c.data.startswith(PREFIX)),
        select(run_items.c.run_id).where(run_items.c.outputs.startswith(PREFIX)),
        select(idempotency_keys.c.key).where(idempotency_keys.c.response.startswith(PREFIX)),
    )
    return any(
        conn.execute(look.limit(1)).first() is not None
        for look in looks
        if {str(getattr(t, "name", "")) for t in look.get_final_froms()} <= present
    )


def _opens_a_sample(conn: Connection, sealer: Sealer) -> bool | None:
    """Whether one sealed blob opens with ``sealer``; None when there is none to try."""
    item = conn.execute(
        select(batch_items.c.id, batch_items.c.body).where(batch_items.c.body.is_not(None)).limit(1)
    ).first()
    if item is not None:
        return _opens(sealer, bytes(item.body), str(item.id).encode())
    line = conn.execute(
        select(file_lines.c.file_id, file_lines.c.line, file_lines.c.body).limit(1)
    ).first()
    if line is not None:
        return _opens(sealer, bytes(line.body), line_aad(str(line.file_id), int(line.line)))
    return None


def _opens(sealer: Sealer, blob: bytes, aad: bytes) -> bool:
    try:
        sealer.open(blob, aad)
    except SealError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class KeyVerdict:
    """What ``verify`` found: ``problem`` is None when the key may be used."""

    problem: str | None
    recorded: str | None
    #: The key's fingerprint was written (first start with a key on this database).
    adopted: bool = False


def verify(conn: Connection, sealer: Sealer | None, now: datetime, *, write: bool) -> KeyVerdict:
    """Check ``sealer`` against the database; with ``write``, record a key it may adopt."""
    on_record = recorded(conn)
    if sealer is None:
        if on_record is not None and sealed_data(conn):
            return KeyVerdict(
                f"the database holds data sealed with batch key {on_record[:12]}, and this "
                "process has no batch encryption key",
                on_record,
            )
        if on_record is None and sealed_data(conn):
            return KeyVerdict(
                "the database holds sealed data, and this process has no batch encryption key",
                None,
            )
        return KeyVerdict(None, on_record)
    mine = sealer.fingerprint
    if on_record == mine:
        return KeyVerdict(None, on_record)
    if on_record is not None:
        if sealed_data(conn):
            return KeyVerdict(
                f"the batch encryption key given (fingerprint {mine[:12]}) is not the one "
                f"this database's data is sealed with ({on_record[:12]})",
                on_record,
            )
        # Nothing sealed is left (every body and result purged): the new key may take over.
        if write:
            conn.execute(
                update(batch_key_checks)
                .where(batch_key_checks.c.id == 1)
                .values(fingerprint=mine, recorded_at=now)
            )
        return KeyVerdict(None, on_record, adopted=write)
    if _opens_a_sample(conn, sealer) is False:
        return KeyVerdict(
            f"the batch encryption key given (fingerprint {mine[:12]}) does not open the "
            "data already sealed in this database",
            None,
        )
    if write:
        conn.execute(insert(batch_key_checks).values(id=1, fingerprint=mine, recorded_at=now))
    return KeyVerdict(None, None, adopted=write)
