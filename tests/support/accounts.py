"""Make organisations, keys and credit straight in the store, as the operator CLI does."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from batchyard.core.accounts import Scope
from batchyard.core.money import to_ticks
from batchyard.service import Service
from batchyard.store import accounts, ledger


@dataclass
class Account:
    org_id: str
    key: str
    key_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def make_account(
    service: Service,
    name: str = "acme",
    *,
    credit: str | Decimal = "10",
    scope: Scope = Scope.FULL,
    tier: int | None = None,
) -> Account:
    now = service.clock.now()

    def tx(conn):  # type: ignore[no-untyped-def]
        org = accounts.ensure_org(conn, name, now)
        key, secret = accounts.create_key(conn, org.id, scope, now)
        if Decimal(str(credit)) > 0:
            ledger.top_up(conn, org.id, to_ticks(Decimal(str(credit))), now)
        if tier is not None:
            accounts.set_tier(conn, org.id, tier)
        return Account(org.id, secret, key.id)

    return service.db.transact_sync(tx)


def add_key(service: Service, org_name: str, scope: Scope) -> Account:
    return make_account(service, org_name, credit="0", scope=scope)
