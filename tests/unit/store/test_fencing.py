"""Fencing tokens on file-batch lines and deferred items: a stale claim's writes change nothing.

Runs have their own tests (``test_run_leases``). Here a line (or item) is
claimed, its lease lapses, it is claimed again (by another worker or the same
one), and every write the first claim could make is tried with its stale
token: sent marks, renewals, results, unclaims, finishing. None lands; the
current claim's do. Time is a ManualClock the test moves.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Connection, insert, select

from batchyard.core.clock import ManualClock
from batchyard.core.ids import new_id
from batchyard.core.leases import Lease
from batchyard.store import deferred_batches as bstore
from batchyard.store import file_batches as fstore
from batchyard.store.database import Database
from batchyard.store.deferred_batch_tables import batch_items, batches
from batchyard.store.file_batches import BatchRow, LineEnd, file_batch_lines
from batchyard.store.files import file_lines, files
from tests.support.run_store import add_org

LEASE = timedelta(seconds=60)


def _file_batch(db: Database, clock: ManualClock, lines: int) -> BatchRow:
    now = clock.now()
    org = add_org(db, now)
    file_id, batch_id = new_id("file", now), new_id("bat", now)

    def tx(c: Connection) -> BatchRow:
        c.execute(
            insert(files).values(
                id=file_id,
                org_id=org,
                purpose="batch",
                filename="in.jsonl",
                bytes=1,
                line_count=lines,
                status="processed",
                endpoint="/v1/chat/completions",
                created_at=now,
            )
        )
        for n in range(1, lines + 1):
            c.execute(
                insert(file_lines).values(
                    file_id=file_id,
                    line=n,
                    custom_id=f"c{n}",
                    model="kettei-core",
                    input_tokens=3,
                    max_tokens=8,
                    body=b"sealed",
                )
            )
        batch = BatchRow(
            id=batch_id,
            org_id=org,
            key_id="key.x",
            status="in_progress",
            endpoint="/v1/chat/completions",
            input_file_id=file_id,
            completion_window="24h",
            metadata=None,
            min_discount=None,
            errors=None,
            request_count=lines,
            max_cost=100,
            reservation_id=None,
            charge=None,
            output_file_id=None,
            error_file_id=None,
            created_at=now,
            expires_at=now + timedelta(hours=24),
            in_progress_at=now,
            finalizing_at=None,
            completed_at=None,
            failed_at=None,
            expired_at=None,
            cancelling_at=None,
            cancelled_at=None,
        )
        fstore.create_batch(c, batch)
        return batch

    return db.transact_sync(tx)


def _line(db: Database, batch_id: str, line: int) -> dict[str, object]:
    fbl = file_batch_lines
    return dict(
        db.read_sync(
            lambda c: c.execute(
                select(fbl).where(fbl.c.batch_id == batch_id, fbl.c.line == line)
            ).one()
        )._mapping
    )


def _ended(line: int) -> LineEnd:
    return LineEnd(
        line, "succeeded", b"out", 3, route="fake", usage_input=3, usage_output=2, charge=7
    )


def test_a_line_claimed_again_fences_out_every_write_of_its_old_claim(
    db: Database, clock: ManualClock
) -> None:
    batch = _file_batch(db, clock, 1)
    now = clock.now()
    [first] = db.transact_sync(lambda c: fstore.claim_lines(c, batch, "wkr.a", 1, now, now + LEASE))
    # The lease lapses; the line was never sent, so it waits again and is claimed
    # again, here by the same worker name (a restarted process, or its own loop).
    clock.advance(LEASE.total_seconds() + 1)
    now = clock.now()
    assert db.transact_sync(lambda c: fstore.requeue_unsent(c, now)) == 1
    [second] = db.transact_sync(
        lambda c: fstore.claim_lines(c, batch, "wkr.a", 1, now, now + LEASE)
    )
    assert second.lease.token == first.lease.token + 1

    stale, current = {1: first.lease}, {1: second.lease}
    later = now + LEASE * 3
    assert db.transact_sync(lambda c: fstore.mark_sent(c, batch.id, stale, now)) == set()
    db.transact_sync(lambda c: fstore.renew(c, batch.id, stale, later))
    assert (
        db.transact_sync(lambda c: fstore.record_results(c, batch.id, stale, [_ended(1)], now)) == 0
    )
    db.transact_sync(lambda c: fstore.requeue_unsent(c, now, batch_id=batch.id, held=stale))
    row = _line(db, batch.id, 1)
    assert (row["state"], row["charge"], row["sent_at"]) == ("dispatched", None, None)
    assert (row["lease_token"], row["lease_expires_at"]) == (second.lease.token, now + LEASE)

    # The current claim's writes land: sent, then answered and charged once.
    assert db.transact_sync(lambda c: fstore.mark_sent(c, batch.id, current, now)) == {1}
    assert (
        db.transact_sync(lambda c: fstore.record_results(c, batch.id, current, [_ended(1)], now))
        == 1
    )
    row = _line(db, batch.id, 1)
    assert (row["state"], row["charge"]) == ("succeeded", 7)


def test_another_worker_s_claim_fences_out_the_first_even_with_its_own_token_number(
    db: Database, clock: ManualClock
) -> None:
    batch = _file_batch(db, clock, 2)
    now = clock.now()
    first = db.transact_sync(lambda c: fstore.claim_lines(c, batch, "wkr.a", 2, now, now + LEASE))
    clock.advance(LEASE.total_seconds() + 1)
    now = clock.now()
    db.transact_sync(lambda c: fstore.requeue_unsent(c, now))
    second = db.transact_sync(lambda c: fstore.claim_lines(c, batch, "wkr.b", 2, now, now + LEASE))
    # wkr.a names the current tokens, but not its own name: still nothing.
    current = {c.line: c.lease for c in second}
    assert {c.line: c.lease.token + 1 for c in first} == {k: v.token for k, v in current.items()}
    ended = [_ended(1), _ended(2)]
    as_a = {line: Lease("wkr.a", lease.token) for line, lease in current.items()}
    assert db.transact_sync(lambda c: fstore.record_results(c, batch.id, as_a, ended, now)) == 0
    assert db.transact_sync(lambda c: fstore.record_results(c, batch.id, current, ended, now)) == 2


def _deferred_item(db: Database, clock: ManualClock) -> str:
    now = clock.now()
    org = add_org(db, now)
    batch_id, item_id = new_id("bat", now), new_id("itm", now)

    def tx(c: Connection) -> None:
        c.execute(
            insert(batches).values(
                id=batch_id,
                org_id=org,
                key_id="key.x",
                status="in_progress",
                created_at=now,
                deadline=now + timedelta(hours=24),
                min_discount="0",
                completion_window="24h",
                request_count=1,
            )
        )
        c.execute(
            insert(batch_items).values(
                id=item_id,
                batch_id=batch_id,
                org_id=org,
                key_id="key.x",
                position=0,
                custom_id="a",
                status="waiting",
                model="kettei-core",
                min_discount="0",
                input_tokens=3,
                max_tokens=8,
                created_at=now,
                deadline=now + timedelta(hours=24),
                body=b"sealed",
            )
        )

    db.transact_sync(tx)
    return item_id


def _item(db: Database, item_id: str) -> dict[str, object]:
    return dict(
        db.read_sync(
            lambda c: c.execute(select(batch_items).where(batch_items.c.id == item_id)).one()
        )._mapping
    )


def test_a_deferred_item_dispatched_again_fences_out_its_old_dispatch(
    db: Database, clock: ManualClock
) -> None:
    item_id = _deferred_item(db, clock)
    now = clock.now()

    def dispatch(res: str) -> Lease:
        def tx(c: Connection) -> Lease:
            got = bstore.claim(c, item_id)
            assert got is not None
            return bstore.mark_dispatched(
                c, got[0], "wkr.a", now + LEASE, route="fake", reservation_id=res, now=now
            )

        return db.transact_sync(tx)

    first = dispatch("res.1")
    # Never sent, lease lapsed: back to waiting, then dispatched again under the same hold id
    # (the reservation alone would not tell the two dispatches apart; the token does).
    held = db.read_sync(lambda c: bstore.dispatched_item(c, item_id, first))
    assert held is not None
    assert db.transact_sync(lambda c: bstore.return_to_waiting(c, held, now))
    second = dispatch("res.1")
    assert (second.owner, second.token) == (first.owner, first.token + 1)

    later = now + LEASE * 3
    assert db.transact_sync(lambda c: bstore.renew(c, {item_id: first}, later)) == set()
    assert db.transact_sync(lambda c: bstore.mark_sent(c, {item_id: first}, now)) == set()
    assert db.read_sync(lambda c: bstore.dispatched_item(c, item_id, first)) is None
    item = db.read_sync(lambda c: bstore.dispatched_item(c, item_id, second))
    assert item is not None
    ended = db.transact_sync(
        lambda c: bstore.finish_item(c, item, status="succeeded", now=now, lease=first)
    )
    assert ended is False
    row = _item(db, item_id)
    assert (row["status"], row["sent_at"], row["lease_expires_at"]) == (
        "dispatched",
        None,
        now + LEASE,
    )

    assert db.transact_sync(lambda c: bstore.renew(c, {item_id: second}, later)) == {item_id}
    assert db.transact_sync(lambda c: bstore.mark_sent(c, {item_id: second}, now)) == {item_id}
    assert db.transact_sync(
        lambda c: bstore.finish_item(c, item, status="succeeded", now=now, lease=second)
    )
    assert _item(db, item_id)["status"] == "succeeded"
