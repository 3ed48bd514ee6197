"""The batch encryption key: where it comes from, and what sealed blobs are bound to.

Deferred batches keep request bodies and results sealed at rest
(``core.sealing``). Without a key they cannot run at all, so the key is
resolved once when the service is built (the service owns it and hands it to
the door and the worker) and the reason for a missing one is kept, to be
shown as a 503 by the door and printed by ``serve``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchyard.core.config_errors import ConfigError
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
    def fingerprint(self) -> str | None:
        """The key's fingerprint (``core.sealing.key_fingerprint``), shown instead of the key."""
        return self.sealer.fingerprint if self.sealer is not None else None

    @property
    def available(self) -> bool:
        return self.sealer is not None

    def require(self) -> Sealer:
        """The sealer, or 503 ``batches_unavailable`` saying why there is none."""
        if self.sealer is None:
            raise BatchUnavailable(self.reason or "deferred batches are not available")
        return self.sealer


def resolve_key(
    settings: Settings, *, sealed_data: Callable[[], bool] = lambda: False, create: bool = True
) -> BatchKey:
    """The configured key; on an SQLite file with none, ``<db dir>/batch.key`` (made once).

    A key that cannot be used is a ``ConfigError`` (naming the setting or the
    key file), never "deferred batches are off": the data sealed under it would
    read as 500s. A missing key file is made only when ``sealed_data()`` says
    the database holds nothing sealed; otherwise the key was lost, and a new
    one would lock the old data away for good. ``create=False`` (the audit)
    never makes one.
    """
    if settings.batch_encryption_key:
        try:
            return BatchKey(Sealer(parse_key(settings.batch_encryption_key)))
        except SealError as exc:
            raise ConfigError(
                "batch_encryption_key",
                str(exc).split(";")[0],
                "make one with `openssl rand -base64 32`",
                source=settings.config_file or "the settings",
            ) from None
    db_path = settings.sqlite_path
    if db_path is not None:
        path = db_path.parent / "batch.key"
        if not create and not path.exists():
            return BatchKey(None, f"no key file {path}", path=str(path))
        if not path.exists() and sealed_data():
            raise ConfigError(
                "",
                "the database holds sealed data, and its key file is missing",
                f"restore {path} from your backup (or set BATCHYARD_BATCH_ENCRYPTION_KEY to "
                "the key); a new key could never open that data",
                source=str(path),
            )
        try:
            key, created = ensure_key_file(path)
        except SealError as exc:
            raise ConfigError(
                "",
                f"the key file cannot be used: {str(exc).split(';')[0]}",
                "restore it from your backup (32 random bytes in base64)",
                source=str(path),
            ) from None
        except OSError as exc:
            raise ConfigError(
                "",
                f"the key file cannot be read or made: {exc.strerror or exc}",
                "make its folder writable by this user, or set BATCHYARD_BATCH_ENCRYPTION_KEY",
                source=str(path),
            ) from None
        return BatchKey(Sealer(key), path=str(path), created=created)
    return BatchKey(
        None,
        "deferred batches need a batch encryption key on this database: set "
        "BATCHYARD_BATCH_ENCRYPTION_KEY (or batch_encryption_key in the config file) "
        "to 32 random bytes in base64",
    )
