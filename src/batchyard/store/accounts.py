"""Queries for organisations and API keys."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import Connection, bindparam, insert, select, update

from batchyard.core.accounts import (
    ApiKey,
    Organisation,
    Principal,
    Scope,
    display_of,
    generate_key,
    hash_key,
    keys_match,
)
from batchyard.core.ids import new_id
from batchyard.core.money import from_ticks, to_ticks
from batchyard.errors import InvalidRequest, NotFound
from batchyard.store.tables import api_keys, balances, organisations

__all__ = [
    "authenticate",
    "create_key",
    "ensure_org",
    "get_org",
    "get_org_by_name",
    "list_keys",
    "revoke_key",
    "set_auto_topup",
    "set_tier",
    "set_zero_data_retention",
]


def _org(row: object) -> Organisation:
    r = row._mapping  # type: ignore[attr-defined]
    return Organisation(
        id=r["id"],
        name=r["name"],
        tier=r["tier"],
        zero_data_retention=bool(r["zero_data_retention"]),
        created_at=r["created_at"],
        auto_topup_threshold=(
            from_ticks(r["auto_topup_threshold"]) if r["auto_topup_threshold"] is not None else None
        ),
        auto_topup_amount=(
            from_ticks(r["auto_topup_amount"]) if r["auto_topup_amount"] is not None else None
        ),
    )


def get_org(conn: Connection, org_id: str) -> Organisation:
    row = conn.execute(select(organisations).where(organisations.c.id == org_id)).first()
    if row is None:
        raise NotFound(f"organisation {org_id} not found")
    return _org(row)


def get_org_by_name(conn: Connection, name: str) -> Organisation | None:
    row = conn.execute(select(organisations).where(organisations.c.name == name)).first()
    return _org(row) if row is not None else None


def ensure_org(conn: Connection, name: str, now: datetime) -> Organisation:
    """The organisation called ``name``, created at tier 0 if it is new."""
    name = name.strip()
    if not name or len(name) > 200:
        raise InvalidRequest("an organisation name is 1-200 characters", param="org")
    existing = get_org_by_name(conn, name)
    if existing is not None:
        return existing
    org_id = new_id("org", now)
    conn.execute(
        insert(organisations).values(
            id=org_id, name=name, tier=0, zero_data_retention=False, created_at=now
        )
    )
    conn.execute(insert(balances).values(org_id=org_id, topups=0, settled=0, held=0))
    return get_org(conn, org_id)


def create_key(conn: Connection, org_id: str, scope: Scope, now: datetime) -> tuple[ApiKey, str]:
    """A new key; the secret is returned once and only its hash is stored."""
    secret = generate_key()
    key = ApiKey(
        id=new_id("key", now),
        org_id=org_id,
        scope=scope,
        display=display_of(secret),
        created_at=now,
    )
    conn.execute(
        insert(api_keys).values(
            id=key.id,
            org_id=org_id,
            scope=scope.value,
            key_hash=hash_key(secret),
            display=key.display,
            created_at=now,
        )
    )
    return key, secret


def list_keys(conn: Connection, org_id: str) -> list[ApiKey]:
    rows = conn.execute(
        select(api_keys).where(api_keys.c.org_id == org_id).order_by(api_keys.c.created_at)
    )
    return [
        ApiKey(
            id=r.id,
            org_id=r.org_id,
            scope=Scope(r.scope),
            display=r.display,
            created_at=r.created_at,
            revoked_at=r.revoked_at,
        )
        for r in rows
    ]


def revoke_key(conn: Connection, key_id: str, now: datetime) -> ApiKey:
    row = conn.execute(select(api_keys).where(api_keys.c.id == key_id)).first()
    if row is None:
        raise NotFound(f"key {key_id} not found")
    if row.revoked_at is None:
        conn.execute(update(api_keys).where(api_keys.c.id == key_id).values(revoked_at=now))
    return ApiKey(
        id=row.id,
        org_id=row.org_id,
        scope=Scope(row.scope),
        display=row.display,
        created_at=row.created_at,
        revoked_at=row.revoked_at or now,
    )


def key_is_active(conn: Connection, key_id: str) -> bool:
    row = conn.execute(select(api_keys.c.revoked_at).where(api_keys.c.id == key_id)).first()
    return row is not None and row.revoked_at is None


# Built once: every request authenticates.
_PRINCIPAL = (
    select(
        api_keys.c.id,
        api_keys.c.scope,
        api_keys.c.revoked_at,
        api_keys.c.key_hash,
        organisations.c.id.label("org_id"),
        organisations.c.name,
        organisations.c.tier,
        organisations.c.zero_data_retention,
    )
    .join(organisations, organisations.c.id == api_keys.c.org_id)
    .where(api_keys.c.key_hash == bindparam("k_hash"))
)


def authenticate(conn: Connection, secret: str) -> Principal | None:
    """The principal behind a presented key, or None (unknown or revoked)."""
    row = conn.execute(_PRINCIPAL, {"k_hash": hash_key(secret)}).first()
    if row is None or row.revoked_at is not None:
        return None
    if not keys_match(row.key_hash, secret):
        return None
    return Principal(
        key_id=row.id,
        org_id=row.org_id,
        org_name=row.name,
        scope=Scope(row.scope),
        tier=row.tier,
        zero_data_retention=bool(row.zero_data_retention),
    )


def set_tier(conn: Connection, org_id: str, tier: int) -> None:
    conn.execute(update(organisations).where(organisations.c.id == org_id).values(tier=tier))


def set_zero_data_retention(conn: Connection, org_id: str, on: bool) -> None:
    conn.execute(
        update(organisations).where(organisations.c.id == org_id).values(zero_data_retention=on)
    )


def set_auto_topup(
    conn: Connection, org_id: str, threshold: Decimal | None, amount: Decimal | None
) -> None:
    t = to_ticks(threshold) if threshold is not None else None
    a = to_ticks(amount) if amount is not None else None
    conn.execute(
        update(organisations)
        .where(organisations.c.id == org_id)
        .values(auto_topup_threshold=t, auto_topup_amount=a)
    )
