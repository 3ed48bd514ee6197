"""A model stream under the Idempotency-Key rules, whatever its events look like.

Every streaming door (OpenAI's chunks in ``openai_door``, Anthropic's events in
``messages``) follows the same rules, written once here: the key is claimed
before the first byte; the caller's limits (``before``) and the dispatcher's
reservation (``start``) run before any status line is sent, so a refusal is an
ordinary error answer and a non-retryable one is saved under the key; the whole
answer is saved when the stream ends; a stream cut short (the client hung up)
saves nothing and frees the key, and the dispatcher has billed exactly the
tokens produced. A replay hands the door the saved answer to write back in its
own event shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fastapi import Request
from sqlalchemy import Connection

from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.engines.base import Delta
from batchyard.errors import BatchyardError
from batchyard.service import Service
from batchyard.store import idempotency as idem_store
from batchyard.work.dispatcher import DispatchResult

__all__ = ["OpenedStream", "Piece", "open_stream"]

Piece = Delta | DispatchResult


@dataclass
class OpenedStream:
    """A started stream: its first piece, the rest, and what to do with its key at the end."""

    first: Piece
    pieces: AsyncIterator[Piece]
    _svc: Service
    _org: str
    _key: str | None
    _keep: bool

    async def save(self, whole: dict[str, Any]) -> None:
        """Keep the whole answer under the key (where there is one, and retention allows)."""
        if self._keep and self._key is not None:
            org, key, text = self._org, self._key, json.dumps(whole)
            await self._svc.db.write(lambda c: idem_store.finish(c, org, key, 200, text))

    async def abandon(self) -> None:
        """The stream did not finish: stop the engine (billing what it made) and free the key."""
        await self.pieces.aclose()  # type: ignore[attr-defined]
        await _forget(self._svc, self._org, self._key)


async def _forget(svc: Service, org: str, key: str | None) -> None:
    if key is not None:
        await asyncio.shield(svc.db.write(lambda c: idem_store.forget(c, org, key)))


async def open_stream(
    request: Request,
    svc: Service,
    principal: Principal,
    raw: dict[str, Any],
    *,
    start: Callable[[], AsyncIterator[Piece]],
    before: Callable[[], Any],
) -> OpenedStream | idem_rules.SavedResponse:
    """Claim the key, run ``before``, start the stream and take its first piece.

    Returns the answer saved under the key instead when this is a replay.
    Raises what ``before`` or ``start`` raised, the key then saved (a
    non-retryable error) or freed (anything else).
    """
    key = request.headers.get("idempotency-key")
    org = principal.org_id
    keep = key is not None and not principal.zero_data_retention
    if key is not None:
        idem_rules.validate_key(key)
        fp = idem_rules.fingerprint(request.method, request.url.path, raw)
        now = svc.clock.now()
        ttl = timedelta(seconds=svc.settings.idempotency_ttl_s)

        def claim(conn: Connection) -> idem_rules.SavedResponse | None:
            return idem_store.begin(conn, org, key, fp, now, ttl)

        saved = await svc.db.write(claim)
        if saved is not None:
            return saved
    try:
        await before()
        pieces = start()
        first = await anext(pieces)
    except BatchyardError as exc:
        if key is not None and not exc.retryable and keep:
            text, status = json.dumps(exc.to_body()), exc.status
            await svc.db.write(lambda c: idem_store.finish(c, org, key, status, text))
        else:
            await _forget(svc, org, key)
        raise
    except BaseException:
        await _forget(svc, org, key)
        raise
    return OpenedStream(first, pieces, svc, org, key, keep)
