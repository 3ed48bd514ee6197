"""Prefixed UUIDv7 identifiers (``pp.``, ``ds.``, ``bir.`` ...).

UUIDv7 sorts by creation time, so cursors and primary-key order agree, and the
prefix tells a human what an ID names before they look it up.
"""

from __future__ import annotations

import os
import re
import uuid
from datetime import datetime

__all__ = ["ID_PATTERN", "is_id", "new_id", "uuid7"]

_UUID7 = r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
ID_PATTERN = re.compile(rf"(?P<prefix>[a-z]+)\.(?P<uuid>{_UUID7})")


def uuid7(at: datetime) -> uuid.UUID:
    """RFC 9562 UUIDv7 for the instant ``at`` (callers pass ``clock.now()``)."""
    ms = int(at.timestamp() * 1000) & ((1 << 48) - 1)
    rand = int.from_bytes(os.urandom(10), "big")
    rand_a = rand >> 68 & 0xFFF
    rand_b = rand & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return uuid.UUID(int=value)


def new_id(prefix: str, at: datetime) -> str:
    return f"{prefix}.{uuid7(at)}"


def is_id(value: str, prefix: str) -> bool:
    m = ID_PATTERN.fullmatch(value)
    return m is not None and m.group("prefix") == prefix
