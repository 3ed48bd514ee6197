"""Organisations and keys: hashed at rest, shown once, revoked at once."""

from __future__ import annotations

from decimal import Decimal

import pytest
from sqlalchemy import select

from batchyard.core.accounts import KEY_PREFIX, Scope, hash_key, keys_match
from batchyard.core.clock import ManualClock
from batchyard.errors import InvalidRequest, NotFound
from batchyard.store import accounts
from batchyard.store.tables import api_keys, metadata


@pytest.fixture
def now():
    return ManualClock().now()


def _org(db, now, name="acme"):
    return db.transact_sync(lambda c: accounts.ensure_org(c, name, now))


def _key(db, now, org_id, scope=Scope.FULL):
    return db.transact_sync(lambda c: accounts.create_key(c, org_id, scope, now))


def test_a_new_organisation_starts_at_tier_0_and_is_found_by_name(db, now):
    org = _org(db, now)
    assert org.tier == 0 and not org.zero_data_retention
    assert org.id.startswith("org.")
    assert _org(db, now).id == org.id  # ensure is idempotent
    assert db.transact_sync(lambda c: accounts.get_org_by_name(c, "acme")).id == org.id
    assert db.transact_sync(lambda c: accounts.get_org_by_name(c, "nobody")) is None
    with pytest.raises(NotFound):
        db.transact_sync(lambda c: accounts.get_org(c, "org.nope"))
    for bad in ("", "   ", "x" * 201):
        with pytest.raises(InvalidRequest):
            _org(db, now, bad)


def test_the_key_is_never_stored_in_clear(db, now):
    org = _org(db, now)
    secrets = [_key(db, now, org.id, scope)[1] for scope in Scope]
    for secret in secrets:
        assert secret.startswith(KEY_PREFIX) and len(secret) > 40

    def dump(conn):
        out = []
        for table in metadata.sorted_tables:
            for r in conn.execute(select(table)):
                out.extend(str(v) for v in r)
        return "\n".join(out)

    everything = db.transact_sync(dump)
    for secret in secrets:
        assert secret not in everything
        assert secret[len(KEY_PREFIX) :] not in everything
        assert hash_key(secret) in everything
    # Lists show a short display form only.
    listed = db.transact_sync(lambda c: accounts.list_keys(c, org.id))
    assert [k.scope for k in listed] == list(Scope)
    for k, secret in zip(listed, secrets, strict=True):
        assert k.display.endswith(secret[-4:]) and len(k.display) < 16
        assert secret not in repr(k)


def test_authenticate_finds_the_principal_and_nothing_else(db, now):
    org = _org(db, now)
    key, secret = _key(db, now, org.id, Scope.INFERENCE)
    p = db.transact_sync(lambda c: accounts.authenticate(c, secret))
    assert (p.key_id, p.org_id, p.org_name, p.scope, p.tier) == (
        key.id,
        org.id,
        "acme",
        Scope.INFERENCE,
        0,
    )
    assert p.may(Scope.INFERENCE) and not p.may(Scope.FULL, Scope.READ)
    for wrong in ("", secret[:-1], secret + "x", KEY_PREFIX + "nope", hash_key(secret)):
        assert db.transact_sync(lambda c, w=wrong: accounts.authenticate(c, w)) is None
    assert keys_match(hash_key(secret), secret) and not keys_match(hash_key(secret), "x")


def test_revoking_takes_effect_at_once_and_only_for_that_key(db, now):
    org = _org(db, now)
    k1, s1 = _key(db, now, org.id)
    _, s2 = _key(db, now, org.id)
    revoked = db.transact_sync(lambda c: accounts.revoke_key(c, k1.id, now))
    assert revoked.revoked_at == now
    assert db.transact_sync(lambda c: accounts.authenticate(c, s1)) is None
    assert db.transact_sync(lambda c: accounts.authenticate(c, s2)) is not None
    assert not db.transact_sync(lambda c: accounts.key_is_active(c, k1.id))
    # Revoking twice keeps the first time.
    later = ManualClock(now).now()
    assert db.transact_sync(lambda c: accounts.revoke_key(c, k1.id, later)).revoked_at == now
    with pytest.raises(NotFound):
        db.transact_sync(lambda c: accounts.revoke_key(c, "key.nope", now))


def test_organisation_settings_reach_the_principal(db, now):
    org = _org(db, now)
    _, secret = _key(db, now, org.id)
    db.transact_sync(lambda c: accounts.set_tier(c, org.id, 2))
    db.transact_sync(lambda c: accounts.set_zero_data_retention(c, org.id, True))
    db.transact_sync(lambda c: accounts.set_auto_topup(c, org.id, Decimal("5"), Decimal("20.5")))
    p = db.transact_sync(lambda c: accounts.authenticate(c, secret))
    assert p.tier == 2 and p.zero_data_retention
    o = db.transact_sync(lambda c: accounts.get_org(c, org.id))
    assert (o.auto_topup_threshold, o.auto_topup_amount) == (Decimal(5), Decimal("20.5"))
    db.transact_sync(lambda c: accounts.set_auto_topup(c, org.id, None, None))
    o = db.transact_sync(lambda c: accounts.get_org(c, org.id))
    assert o.auto_topup_threshold is None and o.auto_topup_amount is None


def test_key_hash_column_is_unique(db, now):
    assert api_keys.c.key_hash.unique
