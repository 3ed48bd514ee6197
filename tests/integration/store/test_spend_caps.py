"""Spend caps in the ledger (``store.spend_caps``), on SQLite and on PostgreSQL.

The cap is checked where money is held, so these tests drive ``ledger.reserve``,
``settle`` and ``release`` directly: a hold that would cross a cap is refused
and writes nothing; 50 holds racing on one key with a cap of exactly ten
holds' worth leave exactly ten held (PostgreSQL, one connection a thread);
settlements move the sums, a hold's made before its cap too; a month turns; a cap
set later counts what was already spent.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Table, func, select

from batchyard.core.accounts import Scope
from batchyard.errors import SpendCapExceeded
from batchyard.store import accounts, ledger, spend_caps
from batchyard.store.database import Database
from batchyard.store.tables import ledger_entries, reservations

NOV = datetime(2026, 11, 30, 23, 0, tzinfo=UTC)
A = 1_000  # one hold, in ticks


@pytest.fixture
def db(fresh_db: Database) -> Database:
    fresh_db.migrate()
    return fresh_db


def _org_and_key(db: Database, credit: int = 10_000_000) -> tuple[str, str]:
    def tx(c):  # type: ignore[no-untyped-def]
        org = accounts.ensure_org(c, "acme", NOV)
        key, _ = accounts.create_key(c, org.id, Scope.INFERENCE, NOV)
        ledger.top_up(c, org.id, credit, NOV)
        return org.id, key.id

    return db.transact_sync(tx)


def _cap(db: Database, org: str, holder: str, total: int | None, monthly: int | None, now=NOV):  # type: ignore[no-untyped-def]
    return db.transact_sync(
        lambda c: spend_caps.set_cap(c, org, holder, total=total, monthly=monthly, now=now)
    )


def _reserve(db: Database, org: str, key: str, amount: int = A, now=NOV, project=None):  # type: ignore[no-untyped-def]
    return db.transact_sync(
        lambda c: ledger.reserve(
            c, org, amount, now, purpose="call", key_id=key, project_id=project
        )
    )


def _count(db: Database, table: Table) -> int:
    return int(db.read_sync(lambda c: c.execute(select(func.count()).select_from(table)).scalar()))


def test_a_hold_that_would_cross_the_cap_is_refused_and_writes_nothing(db: Database) -> None:
    org, key = _org_and_key(db)
    _cap(db, org, f"key:{key}", total=3 * A, monthly=None)
    for _ in range(3):
        _reserve(db, org, key)
    entries = db.read_sync(
        lambda c: c.execute(select(func.count()).select_from(ledger_entries)).scalar()
    )
    with pytest.raises(SpendCapExceeded) as refused:
        _reserve(db, org, key)
    assert refused.value.status == 402 and refused.value.code == "spend_cap_exceeded"
    assert refused.value.details["left"] == "0" and refused.value.details["cap"] == "total"
    assert str(key) in str(refused.value)
    after = db.read_sync(
        lambda c: c.execute(select(func.count()).select_from(ledger_entries)).scalar()
    )
    held = db.read_sync(
        lambda c: c.execute(select(func.count()).select_from(reservations)).scalar()
    )
    assert after == entries and held == 3
    assert db.read_sync(lambda c: ledger.balance(c, org)).held == 3 * A
    # Another key of the same organisation is not capped by it.
    other = db.transact_sync(lambda c: accounts.create_key(c, org, Scope.INFERENCE, NOV)[0].id)
    _reserve(db, org, other)


def test_settling_below_the_hold_frees_the_rest_and_a_release_frees_it_all(db: Database) -> None:
    org, key = _org_and_key(db)
    _cap(db, org, f"key:{key}", total=2 * A, monthly=None)
    first = _reserve(db, org, key)
    second = _reserve(db, org, key)
    db.transact_sync(lambda c: ledger.settle(c, first.id, A // 4, NOV))
    db.transact_sync(lambda c: ledger.release(c, second.id, NOV))
    (row,) = db.read_sync(lambda c: spend_caps.caps_of_org(c, org, NOV))
    assert (row.total_held, row.total_settled) == (0, A // 4)
    _reserve(db, org, key, amount=2 * A - A // 4)  # exactly what is left
    with pytest.raises(SpendCapExceeded):
        _reserve(db, org, key, amount=1)


def test_a_month_turns_and_a_hold_counts_against_the_month_it_was_made_in(db: Database) -> None:
    org, key = _org_and_key(db)
    _cap(db, org, f"key:{key}", total=None, monthly=2 * A)
    late_nov = _reserve(db, org, key, amount=2 * A)
    with pytest.raises(SpendCapExceeded) as refused:
        _reserve(db, org, key)
    assert refused.value.details["cap"] == "monthly"
    dec = NOV + timedelta(hours=2)  # 1 December, 01:00 UTC
    _reserve(db, org, key, now=dec)  # a new month starts from nothing
    db.transact_sync(lambda c: ledger.settle(c, late_nov.id, A, dec))  # November's, not December's
    (row,) = db.read_sync(lambda c: spend_caps.caps_of_org(c, org, dec))
    assert row.month == "2026-12" and (row.month_held, row.month_settled) == (A, 0)
    assert (row.total_held, row.total_settled) == (A, A)
    _reserve(db, org, key, now=dec)
    with pytest.raises(SpendCapExceeded):
        _reserve(db, org, key, now=dec)


def test_a_cap_set_later_counts_what_the_key_and_project_already_spent(db: Database) -> None:
    org, key = _org_and_key(db)
    spent = _reserve(db, org, key, project="pp.one")
    db.transact_sync(lambda c: ledger.settle(c, spent.id, A, NOV))
    _reserve(db, org, key, project="pp.one")
    key_row = _cap(db, org, f"key:{key}", total=3 * A, monthly=None)
    project_row = _cap(db, org, "project:pp.one", total=None, monthly=2 * A)
    assert (key_row.total_held, key_row.total_settled) == (A, A)
    assert (project_row.month_held, project_row.month_settled) == (A, A)
    with pytest.raises(SpendCapExceeded) as refused:
        _reserve(db, org, key, project="pp.one")  # the key has room, the project has none
    assert refused.value.details["holder"] == "project"
    assert _cap(db, org, "project:pp.one", total=None, monthly=None) is None  # removed
    _reserve(db, org, key, project="pp.one")


def test_a_hold_made_before_its_key_had_a_cap_is_settled_under_the_cap(db: Database) -> None:
    # The hold found no cap; the cap set while it was held counted it; its settlement
    # must move the cap's sums all the same (it asks for itself, not the hold).
    org, key = _org_and_key(db)
    first, second = _reserve(db, org, key), _reserve(db, org, key)
    _cap(db, org, f"key:{key}", total=3 * A, monthly=None)
    db.transact_sync(lambda c: ledger.settle(c, first.id, A // 2, NOV))
    db.transact_sync(lambda c: ledger.release(c, second.id, NOV))
    (row,) = db.read_sync(lambda c: spend_caps.caps_of_org(c, org, NOV))
    assert (row.total_held, row.total_settled) == (0, A // 2)
    assert (row.month_held, row.month_settled) == (0, A // 2)


@pytest.mark.postgres
def test_fifty_racing_holds_against_a_cap_of_exactly_ten_hold_ten(pg_empty_url: str) -> None:
    db = Database(pg_empty_url, pool_size=20)
    try:
        db.migrate()
        org, key = _org_and_key(db)
        _cap(db, org, f"key:{key}", total=10 * A, monthly=None)
        start = threading.Barrier(50)
        outcomes: list[str] = []

        def one() -> None:
            start.wait()
            try:
                _reserve(db, org, key)
                outcomes.append("held")
            except SpendCapExceeded:
                outcomes.append("refused")

        threads = [threading.Thread(target=one) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        (row,) = db.read_sync(lambda c: spend_caps.caps_of_org(c, org, NOV))
        bal = db.read_sync(lambda c: ledger.balance(c, org))
    finally:
        db.close()
    assert outcomes.count("held") == 10 and outcomes.count("refused") == 40
    assert row.total_held == bal.held == 10 * A
