"""The batch key's fingerprint in the store: recorded once, then every other key refused."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

from sqlalchemy import insert

from batchyard.core.sealing import Sealer, generate_key
from batchyard.store import key_check
from batchyard.store.tables import idempotency_keys

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _verify(db, sealer, *, write=True):
    return db.transact_sync(lambda c: key_check.verify(c, sealer, NOW, write=write))


def _seal_something(db, sealer):
    """An answer saved under an Idempotency-Key, sealed as the store seals it."""
    text = "sealed:1:" + base64.b64encode(sealer.seal(b"{}", b"x")).decode()
    db.transact_sync(
        lambda c: c.execute(
            insert(idempotency_keys).values(
                org_id="org",
                key="k",
                fingerprint="f",
                state="done",
                status_code=200,
                response=text,
                created_at=NOW,
                expires_at=NOW,
            )
        )
    )


def test_the_first_key_is_recorded_and_then_only_it_is_taken(db):
    first, other = Sealer(generate_key()), Sealer(generate_key())
    verdict = _verify(db, first)
    assert verdict.problem is None and verdict.adopted
    assert db.read_sync(key_check.recorded) == first.fingerprint
    assert _verify(db, first).problem is None
    _seal_something(db, first)
    refused = _verify(db, other)
    assert refused.problem is not None and first.fingerprint[:12] in refused.problem
    assert "no batch encryption key" in (_verify(db, None).problem or "")
    assert db.read_sync(key_check.recorded) == first.fingerprint  # never replaced


def test_a_new_key_may_take_over_once_nothing_sealed_is_left(db):
    first, other = Sealer(generate_key()), Sealer(generate_key())
    _verify(db, first)
    assert not db.read_sync(key_check.sealed_data)
    assert _verify(db, other).problem is None
    assert db.read_sync(key_check.recorded) == other.fingerprint


def test_sealed_data_without_a_record_refuses_no_key(db):
    _seal_something(db, Sealer(generate_key()))
    assert db.read_sync(key_check.sealed_data)
    assert "sealed data" in (_verify(db, None).problem or "")


def test_a_fingerprint_does_not_reveal_the_key():
    key = generate_key()
    assert key.hex() not in Sealer(key).fingerprint
    assert Sealer(key).fingerprint == Sealer(key).fingerprint
