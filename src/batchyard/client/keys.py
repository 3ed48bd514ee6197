"""Idempotency keys for a run: one per text, changing whenever the request does.

A key is ``<id>-<hash of the decisions, model and settings>``: rerunning the
same file sends the same keys (answered from the server's saved responses,
not charged again), while a changed decision set gets new keys by itself
instead of a 409 ``idempotency_conflict``. ``suffix`` is the user's explicit
version (``v2``); a resend of a fallback answer adds ``rw<n>``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

from batchyard.client.types import Decision

__all__ = ["MAX_KEY", "decision_set_hash", "request_hash", "resend_key", "text_key"]

MAX_KEY = 128
_VISIBLE = re.compile(r"^[\x21-\x7e]+$")
_RESEND = re.compile(r"^(.*)-rw(\d+)$")


def _digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def decision_set_hash(decisions: Sequence[Decision]) -> str:
    """Names the questions themselves: what makes two answer files comparable."""
    return _digest(list(decisions))[:16]


def request_hash(
    decisions: Sequence[Decision], model: str, max_output_tokens: int, fallback: str = "base"
) -> str:
    """Everything but the text that shapes the request body."""
    return _digest(
        {
            "decisions": list(decisions),
            "model": model,
            "max_output_tokens": max_output_tokens,
            "fallback": fallback,
        }
    )[:12]


def text_key(item_id: str, req_hash: str, suffix: str | None = None) -> str:
    """The key for one text; ids that are long or not visible ASCII are hashed."""
    tail = f"-{req_hash}" + (f"-{suffix}" if suffix else "")
    if not _VISIBLE.match(tail):
        raise ValueError("a key suffix must be visible ASCII without spaces")
    room = MAX_KEY - len(tail)
    if room < 17:
        raise ValueError("the key suffix is too long")
    head = item_id
    if len(head) > room or not _VISIBLE.match(head):
        head = "h" + hashlib.sha256(item_id.encode()).hexdigest()[: min(32, room - 1)]
    return head + tail


def resend_key(key: str) -> str:
    """The next key for a text answered by a fallback: ``-rw1``, then ``-rw2`` ..."""
    match = _RESEND.match(key)
    base, n = (match.group(1), int(match.group(2))) if match else (key, 0)
    new = f"{base}-rw{n + 1}"
    if len(new) > MAX_KEY:
        # Only reachable with a very long suffix: keep the key unique, lose readability.
        new = base[: MAX_KEY - 40] + "-" + hashlib.sha256(new.encode()).hexdigest()[:39]
    return new
