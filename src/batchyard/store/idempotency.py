"""Queries behind idempotency keys (rules in ``core.idempotency``).

A saved answer can carry a model's output (which can echo the prompt), so it
is sealed at rest like every other customer text (``store.at_rest``), bound to
its organisation and key.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Connection, and_, bindparam, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from batchyard.core.idempotency import SavedResponse
from batchyard.errors import (
    Conflict,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyResponseExpired,
)
from batchyard.store.at_rest import open_text, seal_text
from batchyard.store.holds import SYNC_HOLD_LIMIT
from batchyard.store.tables import idempotency_keys as ik

__all__ = ["answer_aad", "begin", "finish", "forget", "purge"]

# A claim older than this belongs to a request that died mid-way; by then the
# hold sweeper has put its hold (if it made one) in the activity log.
STALE_CLAIM = SYNC_HOLD_LIMIT

# Built once, as the ledger's are (``store.ledger``): a call under a key claims it and
# saves its answer, two writes on the hot path of every keyed call.
_THIS_KEY = and_(ik.c.org_id == bindparam("i_org"), ik.c.key == bindparam("i_key"))
_CLAIMED = select(ik).where(_THIS_KEY)
_CLAIM = insert(ik)
_FINISH = (
    update(ik)
    .where(_THIS_KEY)
    .values(state="done", status_code=bindparam("i_status"), response=bindparam("i_response"))
)
_FORGET = delete(ik).where(_THIS_KEY)


def begin(
    conn: Connection,
    org_id: str,
    key: str,
    fp: str,
    now: datetime,
    ttl: timedelta,
) -> SavedResponse | None:
    """Claim ``key`` for this request, or return the response saved under it.

    Raises the 409s of the rules. ``None`` means: run the request, then
    ``finish`` or ``forget``.
    """
    row = conn.execute(_CLAIMED, {"i_org": org_id, "i_key": key}).first()
    if row is None:
        try:
            with conn.begin_nested():
                conn.execute(
                    _CLAIM,
                    {
                        "org_id": org_id,
                        "key": key,
                        "fingerprint": fp,
                        "state": "in_progress",
                        "created_at": now,
                        "expires_at": now + ttl,
                    },
                )
        except IntegrityError:
            raise IdempotencyInProgress(
                "a request with this Idempotency-Key is in progress; retry shortly",
                retry_after=1,
            ) from None
        return None
    if row.fingerprint != fp:
        raise IdempotencyConflict(
            "this Idempotency-Key was used with a different request body; "
            "use a new key for a changed request",
            param="Idempotency-Key",
        )
    if row.state == "expired" or now >= row.expires_at:
        raise IdempotencyResponseExpired(
            "the response saved under this Idempotency-Key has expired (after 24 hours); "
            "it will not run again; use a new key",
            param="Idempotency-Key",
        )
    if row.state == "in_progress":
        if now - row.created_at > STALE_CLAIM:
            # The request that claimed the key died mid-way. It may have been
            # charged, so running it again could charge twice: never do that.
            raise Conflict(
                "the request under this Idempotency-Key was interrupted and its outcome is "
                f"uncertain; GET /v1/activity shows any hold it left (kind hold_unresolved, "
                f"held since about {row.created_at:%Y-%m-%dT%H:%M}Z) with what to do; check it "
                "before sending the request again with a new key",
                param="Idempotency-Key",
                code="idempotency_interrupted",
                details={"started_at": row.created_at.isoformat().replace("+00:00", "Z")},
            )
        raise IdempotencyInProgress(
            "a request with this Idempotency-Key is in progress; retry shortly", retry_after=1
        )
    body = open_text(conn, str(row.response), answer_aad(org_id, key))
    return SavedResponse(status_code=int(row.status_code), body=body)


def answer_aad(org_id: str, key: str) -> str:
    """What a saved answer's sealed text is bound to: its organisation and key."""
    return f"idempotency:{org_id}:{key}"


def finish(conn: Connection, org_id: str, key: str, status_code: int, body: str) -> None:
    """Save the answer (sealed) for replays until the key expires."""
    sealed = seal_text(conn, body, answer_aad(org_id, key))
    conn.execute(
        _FINISH, {"i_org": org_id, "i_key": key, "i_status": status_code, "i_response": sealed}
    )


def forget(conn: Connection, org_id: str, key: str) -> None:
    """Drop a claim: the request failed retryably, or nothing may be kept (ZDR)."""
    conn.execute(_FORGET, {"i_org": org_id, "i_key": key})


def purge(conn: Connection, now: datetime) -> int:
    """Drop saved bodies past their 24 hours, keeping each key's tombstone for good.

    docs/reference/http.md promises that an expired key "never runs the text again", with no
    end date, so the tombstone (organisation, key, body fingerprint, expiry:
    no customer text, a few hundred bytes) is never deleted: forgetting it
    would let the key run again. ``forget`` still frees a key whose request
    failed retryably or saved nothing.
    """
    n = conn.execute(
        update(ik)
        .where(ik.c.expires_at <= now, ik.c.state == "done")
        .values(state="expired", response=None, status_code=None)
    ).rowcount
    return int(n or 0)
