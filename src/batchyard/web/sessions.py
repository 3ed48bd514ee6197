"""Workspace sign-in sessions: a random cookie that maps to a key *id* in memory.

The browser never holds the API key after sign-in, and the server keeps no
copy of it either: the session remembers which key signed in (its ID), and
every page checks in the store that this key is still active, so revoking
the key ends its workspace sessions on the next click just as it ends its
API calls. The organisation (tier, zero data retention) is re-read each time
for the same reason.

Sessions live in this process's memory, keyed by a SHA-256 of the cookie so
a memory dump yields no usable cookie. A restart signs everyone out; several
server processes behind one address need sticky sessions for the workspace
(the API itself is stateless). Each session also holds the CSRF token its
forms must echo.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection

from batchyard.core.accounts import Principal, Scope
from batchyard.core.clock import Clock
from batchyard.errors import NotFound
from batchyard.store import accounts

__all__ = ["IDLE_TIMEOUT", "MAX_SESSIONS", "Session", "Sessions", "principal_of", "same_token"]

#: A session unused this long is gone; each page view extends it.
IDLE_TIMEOUT = timedelta(hours=12)
#: Memory bound: past this many, the least recently used session is dropped.
MAX_SESSIONS = 10_000


@dataclass(slots=True)
class Session:
    key_id: str
    org_id: str
    scope: Scope
    csrf: str
    expires_at: datetime


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def same_token(expected: str, presented: str | None) -> bool:
    """Constant-time comparison, false for a missing or empty token."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


class Sessions:
    """The signed-in browsers of one app; times come from the service's clock."""

    def __init__(
        self, clock: Clock, *, idle: timedelta = IDLE_TIMEOUT, limit: int = MAX_SESSIONS
    ) -> None:
        self._clock = clock
        self._idle = idle
        self._limit = limit
        self._by_digest: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_digest)

    def open(self, principal: Principal) -> tuple[str, Session]:
        """A new session for ``principal``: (cookie value, session)."""
        token = secrets.token_urlsafe(32)
        session = Session(
            key_id=principal.key_id,
            org_id=principal.org_id,
            scope=principal.scope,
            csrf=secrets.token_urlsafe(32),
            expires_at=self._clock.now() + self._idle,
        )
        self._by_digest[_digest(token)] = session
        while len(self._by_digest) > self._limit:
            self._by_digest.popitem(last=False)
        return token, session

    def get(self, token: str | None) -> Session | None:
        """The live session behind a cookie, its idle timer restarted; None when gone."""
        if not token:
            return None
        digest = _digest(token)
        session = self._by_digest.get(digest)
        if session is None:
            return None
        now = self._clock.now()
        if now >= session.expires_at:
            del self._by_digest[digest]
            return None
        session.expires_at = now + self._idle
        self._by_digest.move_to_end(digest)
        return session

    def close(self, token: str | None) -> None:
        if token:
            self._by_digest.pop(_digest(token), None)


def principal_of(conn: Connection, session: Session) -> Principal | None:
    """The session's caller as the store knows it now; None once the key is revoked."""
    if not accounts.key_is_active(conn, session.key_id):
        return None
    try:
        org = accounts.get_org(conn, session.org_id)
    except NotFound:
        return None
    return Principal(
        key_id=session.key_id,
        org_id=org.id,
        org_name=org.name,
        scope=session.scope,
        tier=org.tier,
        zero_data_retention=org.zero_data_retention,
    )
