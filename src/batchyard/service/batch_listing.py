"""Both dialects' batches as one collection: show any by ID, list them together.

Deferred and file batches live in their own tables but share the ``bat.``
prefix and its time order (UUIDv7), so one cursor pages through both: each
table gives its next ``limit + 1`` batches below the cursor, newest first,
and the merge keeps the newest ``limit``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.errors import NotFound
from batchyard.service import deferred_batches as deferred
from batchyard.service import file_batches
from batchyard.service.batch_views import file_batch_view
from batchyard.service.deployment import Service
from batchyard.store import deferred_batches as deferred_store
from batchyard.store import file_batches as file_store

__all__ = ["is_file_batch", "list_views", "load_view"]


def load_view(conn: Connection, principal: Principal, batch_id: str) -> dict[str, Any]:
    """The caller's batch of either dialect; another organisation's (or key's) is 404."""
    org, own = principal.org_id, principal.own_key
    if file_store.get_batch(conn, org, batch_id, key_id=own) is not None:
        return file_batches.load_view(conn, org, batch_id, key_id=own)
    if deferred_store.get_batch(conn, org, batch_id, key_id=own) is not None:
        return deferred.load_view(conn, principal, batch_id)
    raise NotFound(f"batch {batch_id} not found", param="batch_id")


async def is_file_batch(svc: Service, principal: Principal, batch_id: str) -> bool:
    org, own = principal.org_id, principal.own_key
    found = await svc.db.read(lambda c: file_store.get_batch(c, org, batch_id, key_id=own))
    return found is not None


async def list_views(
    svc: Service, principal: Principal, *, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """One page of the caller's batches of both dialects, newest first; and whether more follow."""

    def load(conn: Connection) -> list[tuple[str, dict[str, Any]]]:
        org, own = principal.org_id, principal.own_key
        seed_rows = deferred_store.list_batches(conn, org, after=after, limit=limit + 1, key_id=own)
        seed_counts = deferred_store.counts(conn, [b.id for b in seed_rows])
        file_rows = file_store.list_batches(conn, org, after=after, limit=limit + 1, key_id=own)
        file_totals = file_store.totals(conn, [b.id for b in file_rows])
        views = [(b.id, deferred.view_of(b, seed_counts[b.id], None)) for b in seed_rows]
        views += [(b.id, file_batch_view(b, file_totals[b.id])) for b in file_rows]
        return sorted(views, key=lambda v: v[0], reverse=True)

    merged = await svc.db.read(load)
    return [v for _, v in merged[:limit]], len(merged) > limit
