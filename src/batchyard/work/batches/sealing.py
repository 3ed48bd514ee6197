"""The batch encryption key: where it comes from, and what sealed blobs are bound to.

Deferred batches keep request bodies and results sealed at rest
(``core.sealing``). Without a key they cannot run at all, so the key is
resolved once when the service is built (the service owns it and hands it to
the door and the worker) and the reason for a missing one is kept, to be
shown as a 503 by the door and printed by ``serve``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchyard.core.sealing import Sealer, SealError, ensure_key_file, parse_key
from batchyard.errors import BatchUnavailable

if TYPE_CHECKING:
    from batchyard.core.config import Settings

__all__ = ["BatchKey", "resolve_key", "result_aad"]


def result_aad(item_id: str) -> bytes:
    """Associated data of an item's sealed result (its body uses the bare item ID)."""
    return f"{item_id}:result".encode()


@dataclass(frozen=True, slots=True)
class BatchKey:
    """The batch encryption key, or why deferred batches cannot run."""

    sealer: Sealer | None
    reason: str | None = None
    path: str | None = None
    created: bool = False

    @property
    def available(self) -> bool:
        return self.sealer is not None

    def require(self) -> Sealer:
        """The sealer, or 503 ``batches_unavailable`` saying why there is none."""
        if self.sealer is None:
            raise BatchUnavailable(self.reason or "deferred batches are not available")
        return self.sealer


def resolve_key(settings: Settings) -> BatchKey:
    """The configured key; on an SQLite file with none, ``<db dir>/batch.key`` (made once)."""
    if settings.batch_encryption_key:
        try:
            return BatchKey(Sealer(parse_key(settings.batch_encryption_key)))
        except SealError as exc:
            return BatchKey(None, f"deferred batches are off: {exc}")
    db_path = settings.sqlite_path
    if db_path is not None:
        path = db_path.parent / "batch.key"
        try:
            key, created = ensure_key_file(path)
        except (OSError, SealError) as exc:
            return BatchKey(None, f"deferred batches are off: the key file {path}: {exc}")
        return BatchKey(Sealer(key), path=str(path), created=created)
    return BatchKey(
        None,
        "deferred batches need a batch encryption key on this database: set "
        "BATCHYARD_BATCH_ENCRYPTION_KEY (or batch_encryption_key in the config file) "
        "to 32 random bytes in base64",
    )
