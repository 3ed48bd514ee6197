"""Workspace sessions: idle expiry on the injected clock, a memory bound, no stored cookie."""

from __future__ import annotations

from datetime import timedelta

from batchyard.core.accounts import Principal, Scope
from batchyard.core.clock import ManualClock
from batchyard.web.sessions import Sessions, same_token

WHO = Principal("key.1", "org.1", "acme", Scope.FULL, 0, False)


def test_a_session_lives_while_used_and_ends_when_idle():
    clock = ManualClock()
    sessions = Sessions(clock, idle=timedelta(hours=1))
    token, opened = sessions.open(WHO)
    clock.advance(50 * 60)
    assert sessions.get(token) is opened  # use restarts the idle timer
    clock.advance(50 * 60)
    assert sessions.get(token) is opened
    clock.advance(60 * 60)
    assert sessions.get(token) is None
    assert len(sessions) == 0


def test_the_oldest_unused_session_goes_past_the_limit_and_close_forgets():
    sessions = Sessions(ManualClock(), limit=2)
    first, _ = sessions.open(WHO)
    second, _ = sessions.open(WHO)
    assert sessions.get(first) is not None  # first is now the most recently used
    third, _ = sessions.open(WHO)
    assert sessions.get(second) is None
    assert sessions.get(first) is not None and sessions.get(third) is not None
    sessions.close(third)
    assert sessions.get(third) is None and sessions.get(None) is None


def test_memory_holds_digests_and_tokens_compare_strictly():
    sessions = Sessions(ManualClock())
    token, session = sessions.open(WHO)
    assert token not in repr(sessions.__dict__)
    assert session.csrf != token and len(session.csrf) >= 32
    assert same_token(session.csrf, session.csrf)
    assert not same_token(session.csrf, None)
    assert not same_token(session.csrf, "")
    assert not same_token("", "")
    assert not same_token(session.csrf, session.csrf + "x")
