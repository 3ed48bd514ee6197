"""Funding a confirmed run: its whole quote reserved and the run queued, or the run blocked.

``fund`` works on the caller's connection, so the reservation and the run's
new status are one transaction: the store never shows a queued run without
its money, nor money held for a run that is not queued.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from sqlalchemy import Connection, func, select

from batchyard.core.clock import ManualClock
from batchyard.core.money import to_ticks
from batchyard.core.runs import BlockedReason, RunStatus
from batchyard.core.tiers import DEFAULT_TIERS
from batchyard.errors import InvalidState
from batchyard.store import ledger
from batchyard.store.database import Database
from batchyard.store.runs import load_run
from batchyard.store.tables import ledger_entries, reservations
from batchyard.work.runs.funding import approve, fund
from tests.support.run_store import add_dataset, add_org, add_run, balance, load

S = RunStatus
QUOTE = to_ticks(Decimal("2.50"))


def confirmed_run(db: Database, clock: ManualClock, *, credit: str) -> tuple[str, str]:
    """A run awaiting confirmation with a quote of $2.50: (org, run)."""
    now = clock.now()
    org = add_org(db, now, credit=credit)
    project, ds = add_dataset(db, now, org, [{"text": "hi"}])
    run_id = add_run(
        db,
        now,
        org_id=org,
        project_id=project,
        dataset_id=ds,
        status=S.AWAITING_CONFIRMATION,
        quote_rows=1,
        quote_max_cost=QUOTE,
    )
    return org, run_id


def fund_now(
    db: Database, clock: ManualClock, run_id: str, *, threshold: Decimal | None = None
) -> str:
    now = clock.now()
    return db.transact_sync(
        lambda c: fund(c, load_run(c, run_id), now, threshold=threshold, tiers=DEFAULT_TIERS)
    )


def money_rows(db: Database) -> tuple[int, int]:
    def q(c: Connection) -> tuple[int, int]:
        return (
            c.execute(select(func.count()).select_from(reservations)).scalar_one(),
            c.execute(
                select(func.count())
                .select_from(ledger_entries)
                .where(ledger_entries.c.kind != "topup")
            ).scalar_one(),
        )

    return db.read_sync(q)


def test_a_funded_run_is_queued_with_its_whole_quote_held(db: Database, clock: ManualClock) -> None:
    org, run_id = confirmed_run(db, clock, credit="10")

    assert fund_now(db, clock, run_id) == S.QUEUED

    run = load(db, run_id)
    assert (run.status, run.blocked_reason) == (S.QUEUED, None)
    assert run.reservation_id is not None
    res = db.read_sync(lambda c: ledger.get_reservation(c, run.reservation_id or ""))
    assert (res.amount, res.state, res.purpose, res.ref) == (QUOTE, "held", "run", run_id)
    assert balance(db, org) == ledger.Balance(to_ticks(Decimal(10)), 0, QUOTE)


def test_the_hold_and_the_queued_status_are_written_in_one_transaction(
    db: Database, clock: ManualClock
) -> None:
    _, run_id = confirmed_run(db, clock, credit="10")
    now = clock.now()

    def confirm_then_fail(c: Connection) -> None:
        assert fund(c, load_run(c, run_id), now, threshold=None) == S.QUEUED
        raise RuntimeError("the confirming request died before it committed")

    with pytest.raises(RuntimeError):
        db.transact_sync(confirm_then_fail)

    run = load(db, run_id)
    assert (run.status, run.reservation_id) == (S.AWAITING_CONFIRMATION, None)
    assert money_rows(db) == (0, 0)


def test_a_quote_the_credit_cannot_cover_blocks_the_run_on_funds_and_holds_nothing(
    db: Database, clock: ManualClock
) -> None:
    org, run_id = confirmed_run(db, clock, credit="2.49")

    assert fund_now(db, clock, run_id) == S.BLOCKED

    run = load(db, run_id)
    assert (run.status, run.blocked_reason, run.reservation_id) == (
        S.BLOCKED,
        BlockedReason.FUNDS,
        None,
    )
    assert money_rows(db) == (0, 0)
    assert balance(db, org).held == 0


def test_a_run_blocked_on_funds_keeps_its_place_until_credit_arrives(
    db: Database, clock: ManualClock
) -> None:
    org, run_id = confirmed_run(db, clock, credit="1")
    assert fund_now(db, clock, run_id) == S.BLOCKED
    blocked_at = load(db, run_id).updated_at

    clock.advance(60)
    assert fund_now(db, clock, run_id) == S.BLOCKED  # still short: unchanged, same place
    assert load(db, run_id).updated_at == blocked_at

    now = clock.now()
    db.transact_sync(lambda c: ledger.top_up(c, org, to_ticks(Decimal(2)), now))
    assert fund_now(db, clock, run_id) == S.QUEUED
    assert balance(db, org).held == QUOTE


def test_a_quote_above_the_review_threshold_waits_for_an_operator(
    db: Database, clock: ManualClock
) -> None:
    org, run_id = confirmed_run(db, clock, credit="10")

    assert fund_now(db, clock, run_id, threshold=Decimal("2.49")) == S.BLOCKED
    run = load(db, run_id)
    assert (run.blocked_reason, run.reservation_id) == (BlockedReason.BILLING_REVIEW, None)
    assert money_rows(db) == (0, 0)

    now = clock.now()
    assert db.transact_sync(lambda c: approve(c, run_id, now, tiers=DEFAULT_TIERS)) == S.QUEUED
    run = load(db, run_id)
    assert (run.status, run.approved) == (S.QUEUED, True)
    assert balance(db, org).held == QUOTE


def test_a_quote_at_the_threshold_is_funded_without_review(
    db: Database, clock: ManualClock
) -> None:
    _, run_id = confirmed_run(db, clock, credit="10")
    assert fund_now(db, clock, run_id, threshold=Decimal("2.50")) == S.QUEUED


def test_an_approved_run_the_credit_cannot_cover_moves_on_to_blocked_on_funds(
    db: Database, clock: ManualClock
) -> None:
    org, run_id = confirmed_run(db, clock, credit="1")
    assert fund_now(db, clock, run_id, threshold=Decimal("1")) == S.BLOCKED

    now = clock.now()
    assert db.transact_sync(lambda c: approve(c, run_id, now)) == S.BLOCKED
    assert load(db, run_id).blocked_reason == BlockedReason.FUNDS
    assert money_rows(db) == (0, 0)

    # Once credit arrives, the worker's retry funds it without a second review.
    db.transact_sync(lambda c: ledger.top_up(c, org, to_ticks(Decimal(2)), now))
    assert fund_now(db, clock, run_id, threshold=Decimal("1")) == S.QUEUED


def test_only_a_run_held_for_review_can_be_approved(db: Database, clock: ManualClock) -> None:
    _, run_id = confirmed_run(db, clock, credit="10")
    now = clock.now()
    with pytest.raises(InvalidState):
        db.transact_sync(lambda c: approve(c, run_id, now))
    assert load(db, run_id).status == S.AWAITING_CONFIRMATION
