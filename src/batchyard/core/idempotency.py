"""Idempotency keys: one mechanism for every POST that takes ``Idempotency-Key``.

Stripe's rules, with batchyard's codes: the first response for a key is saved
and returned again for the same body; another body under the same key is 409
``idempotency_conflict``; a saved response lasts 24 hours, then the key answers
409 ``idempotency_response_expired`` and never runs again. A retryable failure
is not saved (the same key may succeed later); a non-retryable one is.
Two concurrent requests with one key run once: the first claims the key
(``in_progress``), the second gets 409 ``idempotency_in_progress``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from batchyard.errors import InvalidIdempotencyKey

__all__ = ["SavedResponse", "fingerprint", "validate_key"]

_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def validate_key(key: str, *, min_len: int = 1, max_len: int = 128) -> str:
    if not (min_len <= len(key) <= max_len) or not _VISIBLE_ASCII.fullmatch(key):
        raise InvalidIdempotencyKey(
            f"Idempotency-Key must be {min_len}-{max_len} visible ASCII characters",
            param="Idempotency-Key",
        )
    return key


def fingerprint(method: str, path: str, body: Any) -> str:
    """A stable hash of what a request asks for; key order and spacing don't matter."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(f"{method} {path}\n{canonical}".encode())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class SavedResponse:
    status_code: int
    body: str
