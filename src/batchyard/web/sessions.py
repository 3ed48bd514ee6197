"""Workspace sign-in sessions: a sealed, expiring cookie that names a key *id*, never a key.

The browser never holds the API key after sign-in, and the server keeps no
copy of it either. The cookie is the session: its key ID, organisation,
scope, CSRF token and expiry, sealed (AES-GCM, ``core.sealing``) under the
deployment's batch encryption key, bound by its associated data to this use
alone. Sealing signs it (a changed cookie does not open) and hides it (its
CSRF token cannot be read from it). Every process that shares the batch key opens every cookie, so a
sign-in survives a server restart and works across several API processes
with no shared session store and no sticky sessions.

Every page still checks in the store that the key is active, so revoking
the key ends its workspace sessions on the next click just as it ends its
API calls; the organisation (tier, zero data retention) is re-read each time
for the same reason. A session ends ``IDLE_TIMEOUT`` after sign-in; signing
out lists the session's ID in the store (``store.signouts``), so every
process refuses the cookie from then on, even a copy made before.
"""

from __future__ import annotations

import base64
import hmac
import json
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection

from batchyard.core.accounts import Principal, Scope
from batchyard.core.clock import Clock
from batchyard.core.sealing import Sealer, SealError
from batchyard.errors import NotFound
from batchyard.store import accounts, signouts

__all__ = [
    "IDLE_TIMEOUT",
    "Session",
    "Sessions",
    "principal_of",
    "same_token",
]

#: How long a sign-in lasts.
IDLE_TIMEOUT = timedelta(hours=12)
#: Associated data of a sealed cookie: it opens as nothing else, and nothing else opens as it.
_AAD = b"batchyard-workspace-session-v1"


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    key_id: str
    org_id: str
    scope: Scope
    csrf: str
    expires_at: datetime


def same_token(expected: str, presented: str | None) -> bool:
    """Constant-time comparison, false for a missing or empty token."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


class Sessions:
    """Opens and reads sealed session cookies; times come from the service's clock."""

    def __init__(self, clock: Clock, sealer: Sealer, *, idle: timedelta = IDLE_TIMEOUT) -> None:
        self._clock = clock
        self._sealer = sealer
        self._idle = idle

    def open(self, principal: Principal) -> tuple[str, Session]:
        """A new session for ``principal``: (cookie value, session)."""
        session = Session(
            id=secrets.token_urlsafe(16),
            key_id=principal.key_id,
            org_id=principal.org_id,
            scope=principal.scope,
            csrf=secrets.token_urlsafe(32),
            expires_at=self._clock.now() + self._idle,
        )
        payload = {
            "i": session.id,
            "k": session.key_id,
            "o": session.org_id,
            "s": session.scope.value,
            "c": session.csrf,
            "e": session.expires_at.timestamp(),
        }
        sealed = self._sealer.seal(json.dumps(payload, separators=(",", ":")).encode(), _AAD)
        return base64.urlsafe_b64encode(sealed).decode().rstrip("="), session

    def get(self, token: str | None) -> Session | None:
        """The live session a cookie holds; None when it is missing, altered or expired."""
        if not token or len(token) > 4096:
            return None
        try:
            sealed = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = json.loads(self._sealer.open(sealed, _AAD))
            expires_at = datetime.fromtimestamp(float(data["e"]), tz=self._clock.now().tzinfo)
            session = Session(
                id=str(data["i"]),
                key_id=str(data["k"]),
                org_id=str(data["o"]),
                scope=Scope(data["s"]),
                csrf=str(data["c"]),
                expires_at=expires_at,
            )
        except (SealError, ValueError, KeyError, TypeError):
            return None
        if self._clock.now() >= session.expires_at:
            return None
        return session

    def close(self, conn: Connection, session: Session) -> None:
        """Sign out: every process refuses the session from now on (``store.signouts``)."""
        signouts.record_sign_out(conn, session.id, session.expires_at, self._clock.now())


def principal_of(conn: Connection, session: Session) -> Principal | None:
    """The session's caller as the store knows it now; None once signed out or revoked."""
    if signouts.is_signed_out(conn, session.id):
        return None
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
