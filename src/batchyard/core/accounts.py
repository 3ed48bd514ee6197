"""Organisations, API keys and scopes.

Keys are 32 random bytes behind a recognisable prefix (``by_``) so a leaked
key is easy to find in a log scanner. Only a SHA-256 of the key is stored: a
high-entropy secret needs no slow hash, and a fast one keeps authentication
off the hot path's budget. The lookup is by hash, and the final comparison is
constant-time so a timing probe learns nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from enum import StrEnum

__all__ = [
    "KEY_PREFIX",
    "ApiKey",
    "Organisation",
    "Principal",
    "Scope",
    "generate_key",
    "hash_key",
    "keys_match",
]

KEY_PREFIX = "by_"


class Scope(StrEnum):
    """What a key may do: ``full`` everything, ``read`` look, ``inference`` call models."""

    FULL = "full"
    READ = "read"
    INFERENCE = "inference"


@dataclass(frozen=True, slots=True)
class Organisation:
    id: str
    name: str
    tier: int
    zero_data_retention: bool
    created_at: datetime
    auto_topup_threshold: Decimal | None = None
    auto_topup_amount: Decimal | None = None


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    org_id: str
    scope: Scope
    display: str
    created_at: datetime
    revoked_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key and its organisation, resolved once per request."""

    key_id: str
    org_id: str
    org_name: str
    scope: Scope
    tier: int
    zero_data_retention: bool
    #: Sees only what this key itself created (an inference key's own batches).
    own_only: bool = False

    def may(self, *scopes: Scope) -> bool:
        return self.scope in scopes

    @property
    def own_key(self) -> str | None:
        """The key whose work alone this caller sees (``own_only``), or None for all."""
        return self.key_id if self.own_only else None


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def keys_match(stored_hash: str, presented: str) -> bool:
    return hmac.compare_digest(stored_hash, hash_key(presented))


def display_of(key: str) -> str:
    """What lists may show of a key: its prefix and last four characters."""
    return f"{key[:7]}…{key[-4:]}"
