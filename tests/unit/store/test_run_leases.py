"""Claims and leases on runs: who may take a run, for how long, and who may keep it.

Every worker's write to a run is guarded by its lease, so these rules are
what keeps two workers from answering the same rows: a live lease belongs to
its owner alone, an expired one to whoever claims next, and only the owner
may renew or release it. Time is a ManualClock the test moves.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from batchyard.core.clock import ManualClock
from batchyard.core.leases import Lease
from batchyard.core.runs import BlockedReason, ItemState, RunStatus
from batchyard.store import work_items
from batchyard.store.database import Database
from batchyard.store.run_leases import blocked_runs, claim_run, release, renew, work_waiting
from batchyard.store.runs import Run, update_run
from tests.support.run_store import add_dataset, add_org, add_run, load

S = RunStatus
LEASE = timedelta(seconds=60)
WORK = (S.PREPARING, S.QUEUED)


class Runs:
    """Runs of one organisation's dataset, made in any status at the clock's time."""

    def __init__(self, db: Database, clock: ManualClock) -> None:
        self.db, self.clock = db, clock
        now = clock.now()
        self.org = add_org(db, now)
        self.project, self.dataset = add_dataset(db, now, self.org, [{"text": "hi"}])

    def add(self, status: str = S.PREPARING, **values: Any) -> str:
        return add_run(
            self.db,
            self.clock.now(),
            org_id=self.org,
            project_id=self.project,
            dataset_id=self.dataset,
            status=status,
            **values,
        )

    def claim(
        self,
        owner: str,
        statuses: tuple[str, ...] = WORK,
        *,
        exclude: tuple[str, ...] = (),
        blocked_reason: str | None = None,
    ) -> Run | None:
        now = self.clock.now()
        return self.db.transact_sync(
            lambda c: claim_run(
                c,
                owner,
                now,
                now + LEASE,
                statuses=statuses,
                exclude=exclude,
                blocked_reason=blocked_reason,
            )
        )

    def waiting(self, exclude: tuple[str, ...] = ()) -> tuple[bool, bool]:
        now = self.clock.now()
        return self.db.read_sync(lambda c: work_waiting(c, now, WORK, exclude))


@pytest.fixture
def runs(db: Database, clock: ManualClock) -> Runs:
    return Runs(db, clock)


def test_a_claim_takes_the_longest_waiting_run_in_the_statuses_and_leases_it(
    runs: Runs, clock: ManualClock
) -> None:
    older = runs.add()
    clock.advance(1)
    runs.add(S.AWAITING_CONFIRMATION)  # not work for a worker
    clock.advance(1)
    newer = runs.add(S.QUEUED)

    first = runs.claim("wkr.a")
    assert first is not None
    assert (first.id, first.lease_owner) == (older, "wkr.a")
    assert first.lease_expires_at == clock.now() + LEASE
    second = runs.claim("wkr.a")
    assert second is not None and second.id == newer
    assert runs.claim("wkr.a") is None


def test_a_live_lease_is_not_claimable_by_another_owner(runs: Runs, clock: ManualClock) -> None:
    run_id = runs.add()
    assert runs.claim("wkr.a") is not None

    clock.advance(LEASE.total_seconds())  # the very moment it expires: still held
    assert runs.claim("wkr.b") is None
    assert load(runs.db, run_id).lease_owner == "wkr.a"


def test_an_expired_lease_is_claimable_and_its_old_owner_keeps_nothing(
    runs: Runs, clock: ManualClock
) -> None:
    run_id = runs.add(S.RUNNING)
    first = runs.claim("wkr.a", (S.RUNNING,))
    assert first is not None

    clock.advance(LEASE.total_seconds() + 0.001)
    taken = runs.claim("wkr.b", (S.RUNNING,))
    assert taken is not None
    assert (taken.id, taken.lease_owner) == (run_id, "wkr.b")

    until = clock.now() + LEASE * 2
    old = first.lease
    assert runs.db.transact_sync(lambda c: renew(c, run_id, old, until)) is None
    runs.db.transact_sync(lambda c: release(c, run_id, old))
    run = load(runs.db, run_id)
    assert (run.lease_owner, run.lease_expires_at) == ("wkr.b", taken.lease_expires_at)


def test_the_owner_s_renewals_extend_its_lease(runs: Runs, clock: ManualClock) -> None:
    run_id = runs.add(S.QUEUED)
    claimed = runs.claim("wkr.a")
    assert claimed is not None
    lease = claimed.lease

    clock.advance(50)
    until = clock.now() + LEASE
    assert runs.db.transact_sync(lambda c: renew(c, run_id, lease, until)) == S.QUEUED
    assert load(runs.db, run_id).lease_expires_at == until

    clock.advance(50)  # past the first lease, within the renewed one
    assert runs.claim("wkr.b") is None
    later = clock.now() + LEASE
    assert runs.db.transact_sync(lambda c: renew(c, run_id, lease, later)) == S.QUEUED
    assert load(runs.db, run_id).lease_expires_at == later


def test_only_the_owner_releases_a_lease(runs: Runs) -> None:
    run_id = runs.add()
    claimed = runs.claim("wkr.a")
    assert claimed is not None

    other = Lease("wkr.b", claimed.lease_token)
    runs.db.transact_sync(lambda c: release(c, run_id, other))
    assert load(runs.db, run_id).lease_owner == "wkr.a"
    runs.db.transact_sync(lambda c: release(c, run_id, claimed.lease))
    run = load(runs.db, run_id)
    assert (run.lease_owner, run.lease_expires_at) == (None, None)
    assert runs.claim("wkr.b") is not None


def test_a_claim_skips_the_runs_the_worker_already_holds(runs: Runs) -> None:
    first, second = runs.add(), runs.add()
    taken = runs.claim("wkr.a", exclude=(first,))
    assert taken is not None and taken.id == second


def test_a_claim_of_blocked_runs_takes_only_the_reason_asked_for(
    runs: Runs, clock: ManualClock
) -> None:
    runs.add(S.BLOCKED, blocked_reason=BlockedReason.FUNDS)
    clock.advance(1)
    payment = runs.add(S.BLOCKED, blocked_reason=BlockedReason.PAYMENT)

    taken = runs.claim("wkr.a", (S.BLOCKED,), blocked_reason=BlockedReason.PAYMENT)
    assert taken is not None and taken.id == payment
    assert runs.claim("wkr.a", (S.BLOCKED,), blocked_reason=BlockedReason.PAYMENT) is None


def test_work_waiting_says_whether_a_claim_or_a_funds_retry_is_worth_a_write(runs: Runs) -> None:
    assert runs.waiting() == (False, False)

    runs.add(S.BLOCKED, blocked_reason=BlockedReason.FUNDS)
    assert runs.waiting() == (False, True)

    work = runs.add()
    assert runs.waiting() == (True, True)
    assert runs.waiting(exclude=(work,)) == (False, True)
    assert runs.claim("wkr.a") is not None
    assert runs.waiting() == (False, True)  # its only work is leased

    runs.add(S.BLOCKED, blocked_reason=BlockedReason.PAYMENT)  # a settlement to retry
    assert runs.waiting() == (True, True)


def test_work_waiting_sees_an_expired_lease_as_work(runs: Runs, clock: ManualClock) -> None:
    runs.add()
    assert runs.claim("wkr.a") is not None
    assert runs.waiting() == (False, False)
    clock.advance(LEASE.total_seconds() + 1)
    assert runs.waiting() == (True, False)


def test_blocked_runs_lists_one_reason_longest_waiting_first(
    runs: Runs, clock: ManualClock
) -> None:
    ids = []
    for _ in range(3):
        ids.append(runs.add(S.BLOCKED, blocked_reason=BlockedReason.FUNDS))
        clock.advance(1)
    runs.add(S.BLOCKED, blocked_reason=BlockedReason.BILLING_REVIEW)

    found = runs.db.read_sync(lambda c: blocked_runs(c, BlockedReason.FUNDS, limit=2))
    assert [r.id for r in found] == ids[:2]
    review = runs.db.read_sync(lambda c: blocked_runs(c, BlockedReason.BILLING_REVIEW))
    assert [r.blocked_reason for r in review] == [BlockedReason.BILLING_REVIEW]


def test_each_claim_hands_out_a_greater_token_and_a_stale_one_writes_nothing(
    runs: Runs, clock: ManualClock
) -> None:
    """Fencing: the same owner claiming again gets a new token; its old claim's writes miss."""
    run_id = runs.add(S.RUNNING)
    first = runs.claim("wkr.a", (S.RUNNING,))
    assert first is not None
    clock.advance(LEASE.total_seconds() + 1)
    second = runs.claim("wkr.a", (S.RUNNING,))
    assert second is not None
    assert second.lease_token == first.lease_token + 1
    assert (second.lease_owner, first.lease_owner) == ("wkr.a", "wkr.a")

    stale, until, now = first.lease, clock.now() + LEASE * 5, clock.now()
    assert runs.db.transact_sync(lambda c: renew(c, run_id, stale, until)) is None
    runs.db.transact_sync(lambda c: release(c, run_id, stale))
    changed = runs.db.transact_sync(
        lambda c: update_run(c, run_id, now, lease=stale, status=S.COMPLETED, charge=1)
    )
    assert changed is False
    run = load(runs.db, run_id)
    assert (run.status, run.charge, run.lease_token) == (S.RUNNING, None, second.lease_token)
    assert run.lease_expires_at == second.lease_expires_at

    # The current claim's writes land.
    current = second.lease
    assert runs.db.transact_sync(lambda c: renew(c, run_id, current, until)) == S.RUNNING
    assert load(runs.db, run_id).lease_expires_at == until


def test_a_stale_token_marks_no_row_sent(runs: Runs, clock: ManualClock) -> None:
    run_id = runs.add(S.RUNNING)

    def freeze(c: Any) -> None:
        work_items.add_items(c, run_id, [(1, 1, 3, ItemState.PENDING, None)])

    runs.db.transact_sync(freeze)
    first = runs.claim("wkr.a", (S.RUNNING,))
    assert first is not None
    now = clock.now()
    assert runs.db.transact_sync(lambda c: work_items.claim_items(c, run_id, runs.dataset, 1, now))
    clock.advance(LEASE.total_seconds() + 1)
    second = runs.claim("wkr.a", (S.RUNNING,))
    assert second is not None

    stale, current, now = first.lease, second.lease, clock.now()
    assert (
        runs.db.transact_sync(lambda c: work_items.mark_sent(c, run_id, [1], stale, now)) == set()
    )
    assert runs.db.transact_sync(lambda c: work_items.mark_sent(c, run_id, [1], current, now)) == {
        1
    }
