"""A run's rows in the order they end, and a retry's copy of the rows that failed.

Every path that ends a row (frozen as failed, answered, failed, left
uncertain, canceled) gives it an end number from the run's counter
(``store.end_order``), so a follower reading "after n" gets each row once;
a retry copies only the failed and canceled rows that fit, as they were
frozen, and counts what it left.
"""

from __future__ import annotations

from sqlalchemy import Connection, update

from batchyard.core.clock import ManualClock
from batchyard.core.runs import ItemState
from batchyard.store import work_items
from batchyard.store.database import Database
from batchyard.store.runs import run_items
from batchyard.store.work_items import ItemResult
from tests.support.run_store import add_dataset, add_org, add_run, items, load

S = ItemState


def a_run(db: Database, clock: ManualClock, rows: int) -> tuple[str, str]:
    now = clock.now()
    org = add_org(db, now)
    project, ds = add_dataset(db, now, org, [{"text": f"row {i}"} for i in range(rows)])
    return add_run(db, now, org_id=org, project_id=project, dataset_id=ds), ds


def ended(db: Database, run_id: str, after: int = 0, limit: int = 100) -> list[tuple[int, int]]:
    got = db.read_sync(lambda c: work_items.ended_rows(c, run_id, after=after, limit=limit))
    return [(seq, row["rowId"]) for seq, row in got]


def test_every_way_a_row_ends_numbers_it_once_in_the_order_it_ended(db: Database) -> None:
    clock = ManualClock()
    run_id, ds = a_run(db, clock, 8)
    now = clock.now()
    frozen = [(r, 1, 5, S.PENDING, None) for r in range(1, 8)] + [(8, 1, 9000, S.FAILED, "{}")]

    def freeze(c: Connection) -> None:
        work_items.add_items(c, run_id, frozen)

    db.transact_sync(freeze)
    assert ended(db, run_id) == [(1, 8)]  # frozen as failed: it has ended already

    def answer(c: Connection) -> None:
        work_items.claim_items(c, run_id, ds, 5, now)  # rows 1..5 dispatched
        work_items.record_results(
            c,
            run_id,
            [
                ItemResult(4, S.SUCCEEDED, outputs=["four"], usage_input=5, usage_output=1),
                ItemResult(2, S.FAILED, error={"code": "upstream_error", "message": "x"}),
            ],
            now,
        )
        # A result for a row that is not dispatched (6: still pending) writes nothing.
        work_items.record_results(c, run_id, [ItemResult(6, S.SUCCEEDED, outputs=["no"])], now)
        c.execute(
            update(run_items)
            .where(run_items.c.run_id == run_id, run_items.c.row_id == 1)
            .values(sent_at=now)
        )
        work_items.recover_dispatched(c, run_id, now)  # 1 sent: uncertain; 3, 5 wait again
        work_items.cancel_pending(c, run_id, now)  # 3, 5, 6, 7

    db.transact_sync(answer)

    order = ended(db, run_id)
    assert [row for _, row in order] == [8, 4, 2, 1, 3, 5, 6, 7]
    seqs = [seq for seq, _ in order]
    assert seqs == sorted(seqs) and len(set(seqs)) == 8
    assert load(db, run_id).ended_seq >= seqs[-1]
    # From any cursor, the rest, once each.
    cut = seqs[3]
    assert ended(db, run_id, after=cut) == order[4:]
    assert ended(db, run_id, after=0, limit=2) == order[:2]
    [(_, four)] = [
        x
        for x in db.read_sync(lambda c: work_items.ended_rows(c, run_id, after=0, limit=9))
        if x[1]["rowId"] == 4
    ]
    assert (four["state"], four["outputs"], four["written"]) == (S.SUCCEEDED, ["four"], False)

    def write(c: Connection) -> None:
        work_items.mark_written(c, run_id, [4], now)

    db.transact_sync(write)
    [(_, four)] = [
        x
        for x in db.read_sync(lambda c: work_items.ended_rows(c, run_id, after=0, limit=9))
        if x[1]["rowId"] == 4
    ]
    assert (four["outputs"], four["written"]) == (None, True)  # in the dataset now
    assert ended(db, run_id) == order  # writing ends nothing again


def test_a_retry_copies_the_failed_and_canceled_rows_that_fit_and_counts_the_rest(
    db: Database,
) -> None:
    clock = ManualClock()
    now = clock.now()
    first, ds = a_run(db, clock, 6)
    org = load(db, first).org_id
    project = load(db, first).project_id
    second = add_run(db, now, org_id=org, project_id=project, dataset_id=ds)
    states = {
        1: (S.SUCCEEDED, 5),
        2: (S.FAILED, 5),
        3: (S.FAILED, 900),  # does not fit: it would fail again
        4: (S.CANCELED, 7),
        5: (S.UNCERTAIN, 5),
        6: (S.FAILED, 6),
    }

    def copy(c: Connection) -> work_items.RetryCopy:
        work_items.add_items(
            c, first, [(r, 2 if r == 6 else 1, n, S.PENDING, None) for r, (_, n) in states.items()]
        )
        for row, (state, _) in states.items():
            c.execute(
                update(run_items)
                .where(run_items.c.run_id == first, run_items.c.row_id == row)
                .values(state=state, error='{"code": "x"}')
            )
        return work_items.copy_for_retry(c, first, second, fits=100, name_at_most=10)

    got = db.transact_sync(copy)

    assert got == work_items.RetryCopy(
        rows=3, input_tokens=5 + 7 + 6, succeeded=1, too_long=1, uncertain=1, uncertain_row_ids=[5]
    )
    copied = {r["row_id"]: r for r in items(db, second)}
    assert sorted(copied) == [2, 4, 6]
    assert {
        r: (x["version"], x["state"], x["error"], x["ended_seq"]) for r, x in copied.items()
    } == {
        2: (1, S.PENDING, None, None),
        4: (1, S.PENDING, None, None),
        6: (2, S.PENDING, None, None),  # the version the first run froze, not the current one
    }
