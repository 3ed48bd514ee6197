"""Customer text at rest: sealed with the deployment's key wherever the store keeps it.

Deferred batch bodies and results were sealed from the start (``work.deferred_batches``);
the same key now seals every other place customer text or model output lands
in the store: dataset rows, a run's answers waiting to be written, and the
answers saved under an Idempotency-Key (a chat completion can echo an e-mail
address from its prompt). A file copied off the disk, a backup or a WAL
segment then holds no readable text.

The sealer travels with each database connection (``Database(sealer=...)``
puts it in ``conn.info``), so the queries keep their signatures. A sealed
value is text: ``sealed:1:`` and the base64 of a ``core.sealing`` blob, bound
to where it belongs (its row, its key) by associated data, so a blob copied
into another row does not open. Plain JSON never starts with that prefix, so
values written before sealing existed (or by a deployment with no key: a
PostgreSQL one without ``batch_encryption_key``, which ``serve`` warns about)
still read.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from batchyard.core.sealing import Sealer, SealError
from batchyard.errors import InternalError

__all__ = ["PREFIX", "open_text", "opener", "seal_text", "sealer_of"]

PREFIX = "sealed:1:"


def sealer_of(conn: Connection) -> Sealer | None:
    """The deployment's sealer, or None where no key is configured."""
    sealer: Any = conn.info.get("sealer")
    return sealer if isinstance(sealer, Sealer) else None


def seal_text(conn: Connection, text: str, aad: str) -> str:
    """``text`` sealed for the store (as is where there is no key)."""
    sealer = sealer_of(conn)
    if sealer is None:
        return text
    blob = sealer.seal(text.encode("utf-8"), aad.encode("utf-8"))
    return PREFIX + base64.b64encode(blob).decode("ascii")


def opener(conn: Connection) -> Callable[[str, str], str]:
    """``open(stored, aad)`` for many values read on one connection (a scan of rows)."""
    sealer = sealer_of(conn)
    start = len(PREFIX)

    def open_one(stored: str, aad: str) -> str:
        if not stored.startswith(PREFIX):
            return stored
        if sealer is None:
            raise InternalError(
                "stored data is sealed and this process has no batch encryption key to open it",
                retryable=False,
            )
        try:
            blob = binascii.a2b_base64(stored[start:])
            return sealer.open(blob, aad.encode("utf-8")).decode("utf-8")
        except (SealError, ValueError) as exc:
            raise InternalError(f"stored data does not open: {exc}", retryable=False) from None

    return open_one


def open_text(conn: Connection, stored: str, aad: str) -> str:
    """What ``seal_text`` sealed (plain text passes through)."""
    return opener(conn)(stored, aad)
