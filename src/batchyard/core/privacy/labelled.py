"""Personal data known by the words that go with it: secrets, dates of birth, addresses.

A key says what it is by its vendor prefix ("sk-", "AKIA") or by the label in
front of its value ("password="); a date is only a date of birth after a birth
label; a street address ends in a street type. None has a checksum, so the
label is what keeps ordinary prose and code out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final

from batchyard.core.privacy.findings import Span

# --- secrets -----------------------------------------------------------------

# Each pattern is gated by literals it cannot match without, so a megabyte
# of prose costs a few substring searches instead of a dozen regex scans.
_SECRET_PATTERNS: Final[tuple[tuple[tuple[str, ...], re.Pattern[str]], ...]] = (
    (("sk-",), re.compile(r"(?<![\w-])sk-(?:[A-Za-z]+-)*[A-Za-z0-9_-]{20,}")),
    (("_live_", "_test_"), re.compile(r"(?<![\w-])(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}")),
    (
        ("AKIA", "ASIA", "ABIA", "ACCA", "AGPA", "AIDA", "AIPA", "ANPA", "ANVA", "AROA", "APKA"),
        re.compile(
            r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|AROA|APKA)"
            r"[A-Z0-9]{16}(?![A-Za-z0-9])"
        ),
    ),
    (
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
        re.compile(r"(?<![\w-])gh[pousr]_[A-Za-z0-9]{36,255}"),
    ),
    (("github_pat_",), re.compile(r"(?<![\w-])github_pat_[A-Za-z0-9_]{22,255}")),
    (("xox",), re.compile(r"(?<![\w-])xox[abposr]-[A-Za-z0-9-]{10,}")),
    (("AIza",), re.compile(r"(?<![\w-])AIza[0-9A-Za-z_-]{35}")),
    (
        ("eyJ",),
        re.compile(r"(?<![\w-])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ),
    (
        ("PRIVATE KEY-----",),
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----[\s\S]*?"
            r"-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----"
        ),
    ),
)
_BEARER_RE = re.compile(r"(?<![A-Za-z])(?i:bearer)\s+([A-Za-z0-9._~+/-]{20,}=*)")
# Labelled values: the label stays, the value goes. Brackets are excluded from
# values so that "password: [SECRET]" is not a password again.
_LABELLED_SECRET_RE = re.compile(
    r"(?<![A-Za-z])(?i:(?:api[_ -]?key|secret(?:[_ -]?key)?|client[_ -]?secret|access[_ -]?token"
    r"|auth[_ -]?token|token|password|passwd)\b)[\"']?\s*[:=]\s*[\"']?"
    r"([^\s\"'`,;\[\]<>(){}]{6,})"
)
_SECRET_LABELS: Final = ("key", "secret", "token", "passw")
_DOTTED_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def _looks_like_secret_value(text: str, start: int, end: int) -> bool:
    """Whether a labelled value is a credential rather than code naming one.

    ``token = tokenizer.encode(x)`` and ``api_key = os.environ[...]`` are
    everyday prompt content; a real value carries a digit or a symbol.
    """
    value = text[start:end]
    if text[end : end + 1] in ("(", "[") or _DOTTED_NAME_RE.fullmatch(value):
        return False
    return any(not (c.isalpha() or c == "_") for c in value)


def secrets(text: str) -> Iterator[Span]:
    for markers, pattern in _SECRET_PATTERNS:
        if not any(marker in text for marker in markers):
            continue
        for m in pattern.finditer(text):
            token = m.group()
            if token.startswith("sk-") and not (
                any(c.isdigit() for c in token) and any(c.isalpha() for c in token[3:])
            ):
                continue  # "sk-" and a long hyphenated slug, not a key
            yield m.span()
    lower = text.lower()
    if "bearer" in lower:
        for m in _BEARER_RE.finditer(text):
            if any(c.isdigit() for c in m.group(1)):
                yield m.span(1)
    if any(label in lower for label in _SECRET_LABELS):
        for m in _LABELLED_SECRET_RE.finditer(text):
            if _looks_like_secret_value(text, *m.span(1)):
                yield m.span(1)


# --- dates of birth ----------------------------------------------------------

_MONTH = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"
)
_DOB_RE = re.compile(
    r"(?i)(?<![a-z])(?:d\.?o\.?b\b\.?|date\s+of\s+birth\b|birth\s*date\b|birthday\b"
    r"|born(?:\s+on)?\b|geburtsdatum\b)"
    r"(?:\s*[:=-]\s*|\s+(?:is|was|on)\s+|\s+)"
    r"(?P<date>[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}"
    r"|[0-9]{1,2}[/.-][0-9]{1,2}[/.-](?:[0-9]{4}|[0-9]{2})"
    rf"|[0-9]{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?{_MONTH},?\s+[0-9]{{4}}"
    rf"|{_MONTH}\s+[0-9]{{1,2}}(?:st|nd|rd|th)?,?\s+[0-9]{{4}})(?![0-9])"
)


_DOB_LABELS: Final = ("dob", "d.o.b", "birth", "born", "geburtsdatum")


def dates_of_birth(text: str) -> Iterator[Span]:
    lower = text.lower()
    if not any(label in lower for label in _DOB_LABELS):
        return
    for m in _DOB_RE.finditer(text):
        yield m.span("date")


# --- street addresses --------------------------------------------------------

_STREET_TYPES: Final = (
    "Street", "Avenue", "Road", "Boulevard", "Lane", "Drive", "Court", "Way", "Place",
    "Terrace", "Parkway", "Highway", "Square", "Crescent", "Close", "St", "Ave", "Rd", "Blvd",
    "Ln",
)  # fmt: skip
_ADDRESS_RE = re.compile(
    r"(?<![\w.,-])[0-9]{1,5}[A-Za-z]?,?\s+(?:[A-Z][a-z]+\.?\s+){1,3}"
    rf"(?:{'|'.join(_STREET_TYPES)})\b\.?"
)


def addresses(text: str) -> Iterator[Span]:
    if not any(street in text for street in _STREET_TYPES):
        return
    for m in _ADDRESS_RE.finditer(text):
        yield m.span()
