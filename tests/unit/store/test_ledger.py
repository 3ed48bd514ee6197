"""The ledger under random sequences of operations, checked by its own audit after every step.

The model is the TigerBeetle one: a reservation is a pending transfer that
resolves at most once (settle posts it, release voids it), a charge never
exceeds its hold, and balance = top-ups − settled − held, always.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)
from sqlalchemy import func, select

from batchyard.core.clock import ManualClock
from batchyard.core.money import to_ticks
from batchyard.core.tiers import DEFAULT_TIERS
from batchyard.errors import InsufficientCredit, InvalidRequest, InvalidState, NotFound
from batchyard.store import accounts, ledger
from batchyard.store.database import Database
from batchyard.store.tables import ledger_entries, reservations
from tests.support.memory_db import memory_copy

AMOUNT = st.integers(min_value=1, max_value=10**12)


def _counts(db: Database) -> tuple[int, int]:
    def q(c):
        return (
            c.execute(select(func.count()).select_from(ledger_entries)).scalar_one(),
            c.execute(select(func.count()).select_from(reservations)).scalar_one(),
        )

    return db.read_sync(q)


@dataclass
class Held:
    id: str
    org: str
    amount: int


class LedgerMachine(RuleBasedStateMachine):
    """Random top-ups, reservations, settlements and releases against a model."""

    held = Bundle("held")
    resolved = Bundle("resolved")

    @initialize()
    def open_store(self) -> None:
        self.db = memory_copy()
        self.clock = ManualClock()
        now = self.clock.now()
        self.orgs = [
            self.db.transact_sync(lambda c, n=name: accounts.ensure_org(c, n, now).id)
            for name in ("a", "b")
        ]
        self.topups = dict.fromkeys(self.orgs, 0)
        self.settled = dict.fromkeys(self.orgs, 0)
        self.reserved = dict.fromkeys(self.orgs, 0)

    def teardown(self) -> None:
        if hasattr(self, "db"):
            self.db.close()

    def _available(self, org: str) -> int:
        return self.topups[org] - self.settled[org] - self.reserved[org]

    @rule(i=st.integers(0, 1), amount=AMOUNT)
    def top_up(self, i: int, amount: int) -> None:
        org, now = self.orgs[i], self.clock.now()
        bal = self.db.transact_sync(lambda c: ledger.top_up(c, org, amount, now))
        self.topups[org] += amount
        assert bal.available == self._available(org)

    @rule(target=held, i=st.integers(0, 1), amount=st.integers(min_value=0, max_value=10**12))
    def reserve(self, i: int, amount: int):
        org, now = self.orgs[i], self.clock.now()
        before = _counts(self.db)
        if amount > self._available(org):
            with pytest.raises(InsufficientCredit) as exc:
                self.db.transact_sync(lambda c: ledger.reserve(c, org, amount, now, purpose="test"))
            assert exc.value.status == 402
            assert _counts(self.db) == before, "a refused reservation wrote something"
            return multiple()
        res = self.db.transact_sync(lambda c: ledger.reserve(c, org, amount, now, purpose="test"))
        assert (res.state, res.amount, res.org_id) == ("held", amount, org)
        self.reserved[org] += amount
        return Held(res.id, org, amount)

    @rule(
        target=resolved,
        h=consumes(held),
        where=st.sampled_from(["below", "at", "above", "zero", "negative"]),
        delta=st.integers(min_value=1, max_value=10**9),
    )
    def settle(self, h: Held, where: str, delta: int):
        charge = {
            "below": max(0, h.amount - delta),
            "at": h.amount,
            "above": h.amount + delta,
            "zero": 0,
            "negative": -delta,
        }[where]
        now = self.clock.now()
        res = self.db.transact_sync(lambda c: ledger.settle(c, h.id, charge, now))
        expected = max(0, min(charge, h.amount))  # never above the hold
        assert (res.state, res.charged) == ("settled", expected)
        self.reserved[h.org] -= h.amount
        self.settled[h.org] += expected
        return h

    @rule(target=resolved, h=consumes(held))
    def release(self, h: Held):
        now = self.clock.now()
        res = self.db.transact_sync(lambda c: ledger.release(c, h.id, now))
        assert (res.state, res.charged) == ("released", 0)
        self.reserved[h.org] -= h.amount
        return h

    @rule(h=resolved, how=st.sampled_from(["settle", "release"]))
    def resolve_again(self, h: Held, how: str) -> None:
        now = self.clock.now()
        before = _counts(self.db)
        with pytest.raises(InvalidState):
            if how == "settle":
                self.db.transact_sync(lambda c: ledger.settle(c, h.id, 1, now))
            else:
                self.db.transact_sync(lambda c: ledger.release(c, h.id, now))
        assert _counts(self.db) == before

    @rule(seconds=st.floats(min_value=0.001, max_value=3600))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def audit_is_clean_and_balances_match_the_model(self) -> None:
        if not hasattr(self, "db"):
            return
        assert self.db.read_sync(ledger.audit) == []
        for org in self.orgs:
            bal = self.db.read_sync(lambda c, o=org: ledger.balance(c, o))
            assert (bal.topups, bal.settled, bal.held) == (
                self.topups[org],
                self.settled[org],
                self.reserved[org],
            )
            assert bal.available == bal.topups - bal.settled - bal.held >= 0


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- rules that a random walk reaches rarely -----------------------------------------------


@pytest.fixture
def org(db: Database) -> str:
    now = ManualClock().now()
    return db.transact_sync(lambda c: accounts.ensure_org(c, "acme", now).id)


def test_insufficient_credit_says_how_much_and_writes_nothing(db, org):
    now = ManualClock().now()
    db.transact_sync(lambda c: ledger.top_up(c, org, to_ticks(Decimal("1")), now))
    before = _counts(db)
    with pytest.raises(InsufficientCredit) as exc:
        db.transact_sync(
            lambda c: ledger.reserve(c, org, to_ticks(Decimal("1.5")), now, purpose="t")
        )
    body = exc.value.to_body()["error"]
    assert body["code"] == "insufficient_credit" and body["retryable"] is True
    assert (body["required"], body["available"]) == ("1.5", "1")
    assert _counts(db) == before
    assert db.transact_sync(ledger.audit) == []


def test_auto_top_up_happens_before_the_402(db, org):
    now = ManualClock().now()
    db.transact_sync(lambda c: accounts.set_auto_topup(c, org, Decimal("2"), Decimal("5")))
    db.transact_sync(lambda c: ledger.top_up(c, org, to_ticks(Decimal("1")), now))
    # 1 available, 3 asked: the rule tops up 5 first, so the hold fits.
    res = db.transact_sync(
        lambda c: ledger.reserve(c, org, to_ticks(Decimal("3")), now, purpose="t")
    )
    bal = db.transact_sync(lambda c: ledger.balance(c, org))
    assert (bal.topups, bal.held) == (to_ticks(Decimal("6")), res.amount)
    memos = db.transact_sync(
        lambda c: (
            c.execute(select(ledger_entries.c.memo).where(ledger_entries.c.kind == "topup"))
            .scalars()
            .all()
        )
    )
    assert memos == ["operator", "auto top-up"]
    # Above the threshold after the hold: no second top-up.
    db.transact_sync(lambda c: ledger.reserve(c, org, to_ticks(Decimal("0.5")), now, purpose="t"))
    assert db.transact_sync(lambda c: ledger.balance(c, org)).topups == to_ticks(Decimal("6"))
    # Even a top-up cannot cover this one: 402, and the top-up is rolled back with it.
    before = _counts(db)
    with pytest.raises(InsufficientCredit):
        db.transact_sync(
            lambda c: ledger.reserve(c, org, to_ticks(Decimal("100")), now, purpose="t")
        )
    assert _counts(db) == before
    assert db.transact_sync(ledger.audit) == []


def test_buying_credit_moves_the_tier_up_and_never_down(db, org):
    now = ManualClock().now()

    def tier() -> int:
        return db.transact_sync(lambda c: accounts.get_org(c, org).tier)

    def buy(amount: str) -> None:
        db.transact_sync(
            lambda c: ledger.top_up(c, org, to_ticks(Decimal(amount)), now, tiers=DEFAULT_TIERS)
        )

    assert tier() == 0
    buy("49.99")
    assert tier() == 0
    buy("0.01")  # 50 bought in all: tier 1
    assert tier() == 1
    res = db.transact_sync(
        lambda c: ledger.reserve(c, org, to_ticks(Decimal("40")), now, purpose="t")
    )
    db.transact_sync(lambda c: ledger.settle(c, res.id, res.amount, now))
    assert tier() == 1  # spending does not demote
    buy("450")
    assert tier() == 2
    buy("10000")
    assert tier() == 3
    # An operator's manual tier above what purchases earn is kept.
    db.transact_sync(lambda c: accounts.set_tier(c, org, 3))
    buy("1")
    assert tier() == 3


def test_amounts_must_be_positive_and_reservations_must_exist(db, org):
    now = ManualClock().now()
    with pytest.raises(InvalidRequest):
        db.transact_sync(lambda c: ledger.top_up(c, org, 0, now))
    with pytest.raises(InvalidRequest):
        db.transact_sync(lambda c: ledger.reserve(c, org, -1, now, purpose="t"))
    with pytest.raises(NotFound):
        db.transact_sync(lambda c: ledger.settle(c, "res.nope", 1, now))
    with pytest.raises(NotFound):
        db.transact_sync(lambda c: ledger.balance(c, "org.nope"))


def test_the_audit_finds_a_tampered_balance_and_a_double_settle(db, org):
    from sqlalchemy import insert, update

    from batchyard.store.tables import balances

    now = ManualClock().now()
    db.transact_sync(lambda c: ledger.top_up(c, org, 1000, now))
    res = db.transact_sync(lambda c: ledger.reserve(c, org, 100, now, purpose="t"))
    db.transact_sync(lambda c: ledger.settle(c, res.id, 60, now))
    assert db.transact_sync(ledger.audit) == []
    db.transact_sync(
        lambda c: c.execute(update(balances).where(balances.c.org_id == org).values(topups=1))
    )
    assert any("cached balance" in p for p in db.transact_sync(ledger.audit))
    db.transact_sync(
        lambda c: c.execute(
            insert(ledger_entries).values(
                org_id=org, kind="settle", amount=5000, reservation_id=res.id, created_at=now
            )
        )
    )
    problems = db.transact_sync(ledger.audit)
    assert any("resolved more than once" in p for p in problems)
    assert any("!= hold" in p for p in problems)

    def overdraw(c):
        c.execute(
            insert(reservations).values(
                id="res.x", org_id=org, amount=9000, state="held", purpose="t", created_at=now
            )
        )
        c.execute(
            insert(ledger_entries).values(
                org_id=org, kind="reserve", amount=9000, reservation_id="res.x", created_at=now
            )
        )

    db.transact_sync(overdraw)
    assert any("available credit is negative" in p for p in db.transact_sync(ledger.audit))
