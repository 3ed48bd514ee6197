"""Running a call once per Idempotency-Key, whichever front door it came through.

The API and the workspace share these rules, so a key used in the workspace and then
with curl (same body) names the same answer. A streamed answer is kept when the stream
ends whole; one cut short keeps nothing and frees the key.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection

from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.errors import BatchyardError, StorageUnavailable, error_type
from batchyard.service.deployment import Service
from batchyard.store import idempotency as idem_store

__all__ = ["KeyedAnswer", "Stream", "Whole", "run_once", "unkeyed"]


@dataclass(frozen=True, slots=True)
class Whole:
    """The end of a streamed answer: the whole of it, to keep under the key (never sent)."""

    payload: Any


@dataclass(frozen=True, slots=True)
class Stream:
    """A 200 answer sent while it is made: its events, then one ``Whole`` if it ends whole."""

    events: AsyncGenerator[bytes | Whole, None]


@dataclass(frozen=True, slots=True)
class KeyedAnswer:
    """What a call under an Idempotency-Key answered: status and JSON text, perhaps replayed."""

    status: int
    text: str
    replayed: bool = False
    #: A live streamed answer's events (``text`` is then empty).
    stream: AsyncGenerator[bytes, None] | None = None


async def _forget(svc: Service, org: str, key: str) -> None:
    """Free the key for a retry; if the store is down, keep trying in the background.

    The caller hears of its failure at once; until the store is back, a retry
    of the key is told ``idempotency_in_progress`` (retryable), never run twice.
    """
    try:
        await svc.db.write(lambda c: idem_store.forget(c, org, key))
    except StorageUnavailable:
        svc.db.write_later(lambda c: idem_store.forget(c, org, key))


async def run_once(
    svc: Service,
    principal: Principal,
    key: str,
    fingerprint: str,
    handler: Callable[[], Awaitable[tuple[int, Any]]],
    *,
    answers_text: bool = True,
) -> KeyedAnswer:
    """Run ``handler`` once per (organisation, key), or replay the answer saved for it.

    The rules of every idempotent call, whichever door it came through: a
    key reused with another body, whose answer expired, or still running is
    a 409 (raised by ``store.idempotency.begin``); the handler's successes
    and non-retryable failures are saved until the key expires; retryable
    failures are not, so a retry runs again; and nothing is saved for an
    organisation with zero data retention when the answer carries text
    (``answers_text``: a model's answer). A submission's answer (a deferred
    batch's ID and status) carries none, so it is kept there too: docs/reference/privacy.md's
    exception is about answers, and a retried submission must still name the
    same batch and a changed body still be refused. ``handler`` returns
    (status, JSON body), or (200, ``Stream``): the answer is then kept when its
    events end with ``Whole``, and the key freed if they end without it.
    """
    now = svc.clock.now()
    ttl = timedelta(seconds=svc.settings.idempotency_ttl_s)
    org = principal.org_id

    def claim(conn: Connection) -> idem_rules.SavedResponse | None:
        return idem_store.begin(conn, org, key, fingerprint, now, ttl)

    saved = await svc.db.write(claim)
    if saved is not None:
        return KeyedAnswer(saved.status_code, _typed(saved.status_code, saved.body), replayed=True)
    keep = not (answers_text and principal.zero_data_retention)
    try:
        status, payload = await handler()
    except BatchyardError as exc:
        if exc.retryable or not keep:
            await _forget(svc, org, key)
        else:
            text, failed_status = json.dumps(exc.to_body()), exc.status
            await svc.db.write_through(
                lambda c: idem_store.finish(c, org, key, failed_status, text)
            )
        raise
    except BaseException:
        await _forget(svc, org, key)
        raise
    if isinstance(payload, Stream):

        async def keep_whole(whole: Any) -> None:
            await _keep(svc, org, key, keep, status, json.dumps(whole))

        events = _kept(payload.events, keep_whole, lambda: _forget(svc, org, key))
        return KeyedAnswer(status, "", stream=events)
    text = json.dumps(payload)
    await _keep(svc, org, key, keep, status, text)
    return KeyedAnswer(status, text)


async def _keep(svc: Service, org: str, key: str, keep: bool, status: int, text: str) -> None:
    """The call ran (and was charged): its answer must be kept, even across a short
    storage outage, or a retry of the key would find it "in progress"."""
    if keep:
        await svc.db.write_through(lambda c: idem_store.finish(c, org, key, status, text))
    else:
        await svc.db.write_through(lambda c: idem_store.forget(c, org, key))


async def _kept(
    events: AsyncGenerator[bytes | Whole, None],
    keep: Callable[[Any], Awaitable[None]],
    free: Callable[[], Awaitable[None]],
) -> AsyncGenerator[bytes, None]:
    """A stream's events as sent: its ``Whole`` kept (``keep``), or ``free`` if none comes.

    Closing this (the client hung up) closes ``events``, whose producer then
    stops the engine, so the dispatcher bills exactly what was produced.
    """
    whole = False
    try:
        async for event in events:
            if isinstance(event, Whole):
                whole = True
                await asyncio.shield(keep(event.payload))
            else:
                yield event
    finally:
        if not whole:
            await events.aclose()
            await asyncio.shield(free())


async def _nothing(*_: Any) -> None:
    return None


def unkeyed(stream: Stream) -> AsyncGenerator[bytes, None]:
    """A streamed answer sent without an Idempotency-Key: its events, nothing kept."""
    return _kept(stream.events, _nothing, _nothing)


def _typed(status: int, body: str) -> str:
    """A saved error as answered today: one saved before errors carried OpenAI's
    ``type`` gets it on replay, so a database from an older release still answers
    what the OpenAPI document promises."""
    if status < 400:
        return body
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or "type" in error:
        return body
    payload["error"] = {"code": error.get("code"), "type": error_type(status), **error}
    return json.dumps(payload)
