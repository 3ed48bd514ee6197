"""What a finding is: its kind, its placeholder and where it sits.

Shared by every detector module and the scan, so it imports nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final


class Kind(StrEnum):
    """Finding kinds, in precedence order (earlier wins an overlap)."""

    SECRET = "SECRET"  # noqa: S105 - the name of a kind, not a password
    CREDENTIALS = "CREDENTIALS"
    IBAN = "IBAN"
    CARD = "CARD"
    EMAIL = "EMAIL"
    SSN = "SSN"
    NINO = "NINO"
    MAC = "MAC"
    IP = "IP"
    DOB = "DOB"
    PHONE = "PHONE"
    ADDRESS = "ADDRESS"


PLACEHOLDERS: Final[Mapping[str, str]] = MappingProxyType({k.value: f"[{k.value}]" for k in Kind})
RANK: Final[Mapping[str, int]] = {k.value: i for i, k in enumerate(Kind)}


@dataclass(frozen=True, slots=True)
class Finding:
    """Where personal data sits; deliberately without the text, so it can be logged."""

    kind: str
    start: int
    end: int


# A detector's candidate: start and end offsets into the text it was given.
Span = tuple[int, int]
