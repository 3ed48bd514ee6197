"""Idempotency keys: replay, conflict, in progress, interrupted, and 24 hours, on a ManualClock."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from batchyard.core.clock import ManualClock
from batchyard.core.idempotency import SavedResponse, fingerprint, validate_key
from batchyard.errors import (
    Conflict,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyResponseExpired,
    InvalidIdempotencyKey,
)
from batchyard.store import idempotency as idem
from batchyard.store.tables import idempotency_keys

TTL = timedelta(hours=24)
TEN_YEARS = timedelta(days=3650)
FP = fingerprint("POST", "/v1/chat/completions", {"a": 1})
OTHER_FP = fingerprint("POST", "/v1/chat/completions", {"a": 2})


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def begin(db, clock, key="k", fp=FP, org="org.a"):
    now = clock.now()
    return db.transact_sync(lambda c: idem.begin(c, org, key, fp, now, TTL))


def finish(db, key="k", org="org.a", status=200, body='{"ok":true}'):
    db.transact_sync(lambda c: idem.finish(c, org, key, status, body))


def row(db, key="k", org="org.a"):
    return db.transact_sync(
        lambda c: c.execute(
            select(idempotency_keys).where(
                idempotency_keys.c.org_id == org, idempotency_keys.c.key == key
            )
        ).first()
    )


def test_first_use_claims_and_a_finished_key_replays(db, clock):
    assert begin(db, clock) is None
    assert row(db).state == "in_progress"
    finish(db, status=201, body='{"id":"x"}')
    clock.advance(3600)
    assert begin(db, clock) == SavedResponse(201, '{"id":"x"}')
    assert begin(db, clock) == SavedResponse(201, '{"id":"x"}')


def test_another_body_under_the_same_key_conflicts(db, clock):
    begin(db, clock)
    finish(db)
    with pytest.raises(IdempotencyConflict) as exc:
        begin(db, clock, fp=OTHER_FP)
    assert (exc.value.status, exc.value.code, exc.value.retryable) == (
        409,
        "idempotency_conflict",
        False,
    )
    # The conflict is checked before anything else, even while in progress.
    begin(db, clock, key="k2")
    with pytest.raises(IdempotencyConflict):
        begin(db, clock, key="k2", fp=OTHER_FP)


def test_a_key_in_progress_answers_409_in_progress_and_is_retryable(db, clock):
    begin(db, clock)
    clock.advance(30)
    with pytest.raises(IdempotencyInProgress) as exc:
        begin(db, clock)
    assert exc.value.code == "idempotency_in_progress"
    assert exc.value.retryable and exc.value.retry_after == 1


def test_an_interrupted_claim_is_never_run_again(db, clock):
    begin(db, clock)
    clock.advance(idem.STALE_CLAIM.total_seconds() + 1)
    with pytest.raises(Conflict) as exc:
        begin(db, clock)
    assert exc.value.code == "idempotency_interrupted"
    assert exc.value.status == 409 and not exc.value.retryable
    assert row(db).state == "in_progress"


def test_after_24_hours_the_key_answers_expired_and_never_runs_again(db, clock):
    begin(db, clock)
    finish(db)
    clock.advance(TTL.total_seconds() - 1)
    assert begin(db, clock) is not None
    clock.advance(1)
    with pytest.raises(IdempotencyResponseExpired) as exc:
        begin(db, clock)
    assert (exc.value.status, exc.value.code) == (409, "idempotency_response_expired")
    # A purge drops the saved body and keeps a tombstone that still answers expired.
    now = clock.now()
    assert db.transact_sync(lambda c: idem.purge(c, now)) == 1
    r = row(db)
    assert (r.state, r.response, r.status_code) == ("expired", None, None)
    clock.advance(TEN_YEARS.total_seconds())
    with pytest.raises(IdempotencyResponseExpired):
        begin(db, clock)


def test_a_tombstone_is_never_purged_so_an_expired_key_never_runs_again(db, clock):
    # Issue 22: "never runs the text again" used to lapse when tombstones were dropped
    # after 30 days; the tombstone (key, fingerprint, expiry, no text) now stays for good.
    begin(db, clock)
    finish(db)
    for _ in range(10):
        clock.advance(TEN_YEARS.total_seconds() / 10)
        now = clock.now()
        db.transact_sync(lambda c: idem.purge(c, now))
    assert row(db).state == "expired"
    with pytest.raises(IdempotencyResponseExpired):
        begin(db, clock)
    with pytest.raises(IdempotencyConflict):
        begin(db, clock, fp=OTHER_FP)


def test_purge_leaves_live_and_in_progress_keys(db, clock):
    begin(db, clock, key="running")
    begin(db, clock, key="done")
    finish(db, key="done")
    now = clock.now()
    assert db.transact_sync(lambda c: idem.purge(c, now)) == 0
    assert row(db, key="running").state == "in_progress"
    assert row(db, key="done").state == "done"


def test_forget_frees_the_key(db, clock):
    begin(db, clock)
    db.transact_sync(lambda c: idem.forget(c, "org.a", "k"))
    assert row(db) is None
    assert begin(db, clock, fp=OTHER_FP) is None


def test_keys_belong_to_one_organisation(db, clock):
    begin(db, clock, org="org.a")
    finish(db, org="org.a", body='{"a":1}')
    assert begin(db, clock, org="org.b", fp=OTHER_FP) is None
    finish(db, org="org.b", body='{"b":1}')
    assert begin(db, clock, org="org.a").body == '{"a":1}'
    assert begin(db, clock, org="org.b", fp=OTHER_FP).body == '{"b":1}'


@pytest.mark.parametrize("key", ["a", "x" * 128, "ABC-123_~!", "k:1/2"])
def test_valid_keys(key):
    assert validate_key(key) == key


@pytest.mark.parametrize("key", ["", "x" * 129, "has space", "tab\t", "é", "line\n"])
def test_invalid_keys(key):
    with pytest.raises(InvalidIdempotencyKey) as exc:
        validate_key(key)
    assert exc.value.status == 400 and exc.value.param == "Idempotency-Key"


def test_seed_003_minimum_length():
    with pytest.raises(InvalidIdempotencyKey):
        validate_key("short", min_len=8)
    assert validate_key("eight-ch", min_len=8) == "eight-ch"


def test_fingerprint_ignores_key_order_and_spacing_but_not_the_path():
    a = fingerprint("POST", "/v1/x", {"a": 1, "b": [1, 2]})
    assert a == fingerprint("POST", "/v1/x", {"b": [1, 2], "a": 1})
    assert a != fingerprint("POST", "/v1/y", {"a": 1, "b": [1, 2]})
    assert a != fingerprint("POST", "/v1/x", {"a": 1, "b": [2, 1]})
    assert len(a) == 64
