"""Setting and reading spend caps on API keys and projects (``store.spend_caps`` enforces them).

A cap body is ``{"total": "10.00", "monthly": "2.50"}``: dollars, either one ``null`` for
no cap of that kind. Only a ``full`` key sets caps, on its own organisation's keys and
projects.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, select

from batchyard.core.accounts import Principal
from batchyard.core.money import parse_money, to_ticks
from batchyard.errors import InvalidRequest, NotFound, UnknownField
from batchyard.service.deployment import Service
from batchyard.store import projects
from batchyard.store import spend_caps as store
from batchyard.store.tables import api_keys

__all__ = ["cap_views", "parse_caps", "set_key_cap", "set_project_cap"]

#: The most a cap may be: a billion dollars.
MAX_CAP = Decimal(1_000_000_000)


def _amount(raw: Any, name: str) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise InvalidRequest(f'{name} is a dollar amount such as "10.00", or null', param=name)
    try:
        value = parse_money(str(raw))
    except ValueError as exc:
        raise InvalidRequest(f"{name}: {exc}", param=name) from None
    if value > MAX_CAP:
        raise InvalidRequest(f"{name} is at most {MAX_CAP}", param=name)
    return to_ticks(value)


def parse_caps(raw: Any) -> tuple[int | None, int | None]:
    """``(total, monthly)`` in ticks from a cap body; a coded 400 naming the field otherwise."""
    if not isinstance(raw, dict):
        raise InvalidRequest('the body is {"total": …, "monthly": …}', param="body")
    for key in sorted(raw.keys() - {"total", "monthly"}):
        raise UnknownField(f"unknown field {key!r} in a spend cap", param=key)
    return _amount(raw.get("total"), "total"), _amount(raw.get("monthly"), "monthly")


async def set_key_cap(
    svc: Service, principal: Principal, key_id: str, caps: tuple[int | None, int | None]
) -> dict[str, Any]:
    """Cap one of the organisation's keys; the caps and the spend they count."""
    now = svc.clock.now()

    def tx(conn: Connection) -> dict[str, Any]:
        owner = conn.execute(select(api_keys.c.org_id).where(api_keys.c.id == key_id)).scalar()
        if owner != principal.org_id:
            raise NotFound(f"key {key_id} not found", param="key_id")
        return _view(store.set_cap(conn, principal.org_id, f"key:{key_id}", **_kw(caps), now=now))

    return await svc.db.transact(tx)


async def set_project_cap(
    svc: Service, principal: Principal, project_id: str, caps: tuple[int | None, int | None]
) -> dict[str, Any]:
    """Cap one of the organisation's projects (its runs, whichever key starts them)."""
    now = svc.clock.now()

    def tx(conn: Connection) -> dict[str, Any]:
        projects.get_project(conn, principal.org_id, project_id)  # 404 when not its own
        holder = f"project:{project_id}"
        return _view(store.set_cap(conn, principal.org_id, holder, **_kw(caps), now=now))

    return await svc.db.transact(tx)


def _kw(caps: tuple[int | None, int | None]) -> dict[str, int | None]:
    return {"total": caps[0], "monthly": caps[1]}


def _view(row: store.CapRow | None) -> dict[str, Any]:
    if row is None:
        return {"object": "spend_cap", "removed": True}
    return {"object": "spend_cap", **row.view()}


def cap_views(conn: Connection, principal: Principal, now: Any) -> list[dict[str, Any]]:
    """The caps ``/v1/account`` shows: all of them, or an inference key's own only."""
    rows = store.caps_of_org(conn, principal.org_id, now)
    if principal.own_only:
        rows = [r for r in rows if r.holder == f"key:{principal.key_id}"]
    return [r.view() for r in rows]
