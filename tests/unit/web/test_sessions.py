"""Workspace sessions: sealed cookies that name a key ID, expire on the injected clock,
open in any process that shares the batch key, and refuse any change."""

from __future__ import annotations

import base64
from datetime import timedelta

from batchyard.core.accounts import Principal, Scope
from batchyard.core.clock import ManualClock
from batchyard.core.sealing import Sealer, generate_key
from batchyard.web.sessions import Sessions, same_token

WHO = Principal("key.1", "org.1", "acme", Scope.FULL, 0, False)


def test_a_session_lives_until_it_expires():
    clock = ManualClock()
    sessions = Sessions(clock, Sealer(generate_key()), idle=timedelta(hours=1))
    token, opened = sessions.open(WHO)
    clock.advance(59 * 60)
    assert sessions.get(token) == opened
    clock.advance(60)
    assert sessions.get(token) is None


def test_another_process_with_the_same_key_opens_it_and_another_key_does_not():
    key, clock = generate_key(), ManualClock()
    token, opened = Sessions(clock, Sealer(key)).open(WHO)
    assert Sessions(clock, Sealer(key)).get(token) == opened  # a restart, a second process
    assert Sessions(clock, Sealer(generate_key())).get(token) is None


def test_an_altered_or_foreign_cookie_opens_as_nothing():
    sealer = Sealer(generate_key())
    sessions = Sessions(ManualClock(), sealer)
    token, _ = sessions.open(WHO)
    raw = bytearray(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    raw[-1] ^= 1
    altered = base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    other_use = base64.urlsafe_b64encode(sealer.seal(b'{"k":"key.1"}')).decode()
    for bad in (altered, other_use, "not-a-cookie", "", None, "x" * 5000):
        assert sessions.get(bad) is None


def test_the_cookie_holds_no_key_and_tokens_compare_strictly():
    sessions = Sessions(ManualClock(), Sealer(generate_key()))
    token, session = sessions.open(WHO)
    assert "key.1" not in token and "org.1" not in token and session.csrf not in token
    assert session.csrf != token and len(session.csrf) >= 32
    assert same_token(session.csrf, session.csrf)
    assert not same_token(session.csrf, None)
    assert not same_token(session.csrf, "")
    assert not same_token("", "")
    assert not same_token(session.csrf, session.csrf + "x")
