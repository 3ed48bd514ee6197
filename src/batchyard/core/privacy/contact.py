"""How to reach a person: e-mail addresses, also written out, and phone numbers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Final

import phonenumbers

from batchyard.core.privacy.findings import Span
from batchyard.core.privacy.identifiers import after_iban_head

# --- e-mail ------------------------------------------------------------------

_EMAIL_RE = re.compile(
    r"(?<![\w.%+-])\w[\w.%+-]{0,63}@(?:[^\W_](?:[\w-]{0,61}[^\W_])?\.)+[^\W\d_]{2,24}(?![\w-])"
)
_AT = r"(?:\s*(?:\[at\]|\(at\)|\{at\}|<at>)\s*|\s+at\s+)"
_DOT = r"(?:\s*(?:\[dot\]|\(dot\)|\{dot\}|<dot>)\s*|\s+dot\s+|\.)"
_TLDS = (  # the common generic ones and any country code
    r"(?:com|org|net|edu|gov|mil|io|ai|app|dev|info|biz"
    r"|[a-z]{2})"
)
_OBFUSCATED_EMAIL_RE = re.compile(
    rf"(?i)(?<![\w.+-])[a-z0-9][a-z0-9._+-]{{0,63}}{_AT}(?:[a-z0-9-]+{_DOT})+{_TLDS}\b"
)
_WORDED_RE = re.compile(r"(?i)[\[({<]\s*(?:at|dot)\s*[\])}>]|\sdot\s")


def emails(text: str) -> Iterator[Span]:
    if "@" in text:
        for m in _EMAIL_RE.finditer(text):
            yield m.span()
    lower = text.lower()
    if "dot" not in lower and not any(at in lower for at in ("[at]", "(at)", "{at}", "<at>")):
        return
    for m in _OBFUSCATED_EMAIL_RE.finditer(text):
        # "look at example.com" is prose; a bracketed or spelled-out dot is not.
        if _WORDED_RE.search(m.group()):
            yield m.span()


# --- phone numbers -----------------------------------------------------------

# libphonenumber's own matcher reads "030 12345678 030 12345679" as one invalid
# number and takes seconds over a megabyte, so the text is cut into runs of
# digit groups here, each plausible stretch of groups (leftmost, then longest)
# is checked against the written conventions of the default regions, and only
# the survivors are parsed and validated by libphonenumber.
_PHONE_WINDOW_RE = re.compile(r"[+(]*[0-9][0-9 ()\-./\u00a0+]{5,}[0-9]\)?")
_DIGITS_RE = re.compile(r"[0-9]+")
_PHONE_GAP_RE = re.compile(r"\)?[ \u00a0]?\(?|[ \u00a0]?[-./][ \u00a0]?")
_PHONE_KEYWORD_RE = re.compile(
    r"(?i)\b(?:phone|tel|telephone|mobile|mob|cell|call|fax|whatsapp|sms|text|ring)\b"
    r"[^0-9a-z]{0,3}(?:(?:me|us|him|her|them|at|on|no|number|nr)\b[^0-9a-z]{0,3}){0,3}$"
)
_DATE_LIKE_RE = re.compile(r"[0-9]{1,4}([./-])[0-9]{1,2}\1[0-9]{2,4}")
_PHONE_BAD_BEFORE: Final = frozenset("$€£¥#@/.-_+")
_TIGHT: Final = frozenset("-./")
_MAX_PHONE_GROUPS: Final = 6
_US_GROUPS: Final = ((3, 3, 4), (1, 3, 3, 4), (3, 7), (10,), (11,))
_IN_MOBILE_GROUPS: Final = ((5, 5), (10,), (3, 3, 4), (4, 3, 3))


@lru_cache(maxsize=8192)
def _valid_number(raw: str, region: str | None) -> bool:
    try:
        number = phonenumbers.parse(raw, region)
    except phonenumbers.NumberParseException:
        return False
    return bool(phonenumbers.is_valid_number(number))


def _national_regions(raw: str, groups: tuple[int, ...], digits: str) -> list[str]:
    """Regions whose way of writing numbers fits a number given without country code.

    libphonenumber accepts digits glued from neighbouring numbers ("12345 2023
    10" is a valid US number); the grouping rules that out.
    """
    regions = []
    if groups in _US_GROUPS and (len(digits) == 10 or digits[0] == "1"):
        regions.append("US")
    if min(groups) < 2:
        return regions
    if raw.lstrip("(").startswith("0"):
        regions += ["GB", "DE", "FR", "IN"]  # written with their trunk 0
    elif groups in _IN_MOBILE_GROUPS and digits[0] in "6789":
        regions.append("IN")
    return regions


def _phone_at(text: str, tokens: list[tuple[int, int]], i: int, j: int) -> Span | None:
    """The span of a valid number made of digit groups i..j, if they are one."""
    start, end = tokens[i][0], tokens[j][1]
    if start >= 2 and text[start - 1] in _TIGHT and text[start - 2].isdigit():
        return None  # the middle of a dotted or dashed run: an id, a date
    while start > 0 and text[start - 1] in "+(" and tokens[i][0] - start < 2:
        start -= 1
    raw = text[start:end]
    if raw.count("(") > raw.count(")") and text[end : end + 1] == ")":
        end += 1
        raw = text[start:end]
    before = text[start - 1] if start else " "
    after = text[end] if end < len(text) else " "
    if before.isalnum() or before in _PHONE_BAD_BEFORE or after.isalnum() or after == "%":
        return None
    if after in _TIGHT and text[end + 1 : end + 2].isdigit():
        return None
    if raw.count("(") != raw.count(")"):
        return None
    digits = "".join(text[a:b] for a, b in tokens[i : j + 1])
    bare = raw.lstrip("(")
    if bare.startswith("+") or bare.startswith("00"):
        ok = 8 <= len(digits.removeprefix("00")) <= 15 and _valid_number(
            raw, None if bare.startswith("+") else "DE"
        )
        return (start, end) if ok else None
    if not 7 <= len(digits) <= 12 or _DATE_LIKE_RE.fullmatch(raw):
        return None
    # A bare run of digits is an order number until something says phone.
    if raw.isdigit() and not _PHONE_KEYWORD_RE.search(text, max(0, start - 30), start):
        return None
    groups = tuple(b - a for a, b in tokens[i : j + 1])
    if any(_valid_number(raw, r) for r in _national_regions(raw, groups, digits)):
        return start, end
    return None


def phones(text: str) -> Iterator[Span]:
    for w in _PHONE_WINDOW_RE.finditer(text):
        tokens = [m.span() for m in _DIGITS_RE.finditer(text, w.start(), w.end())]
        if len(tokens) > 1 and after_iban_head(text, tokens[1][0]):
            continue
        sizes = [b - a for a, b in tokens]
        cum = [0]
        for size in sizes:
            cum.append(cum[-1] + size)
        if cum[-1] < 7:
            continue
        linked = [
            _PHONE_GAP_RE.fullmatch(text, tokens[k][1], tokens[k + 1][0]) is not None
            for k in range(len(tokens) - 1)
        ]
        i = 0
        while i < len(tokens):
            start = tokens[i][0]
            intl = "+" in text[max(0, start - 2) : start] or text.startswith("00", start)
            # Only the "1" of a US number stands alone at the start of a national one.
            last = i
            if intl or sizes[i] > 1 or text[start] == "1":
                while last + 1 < len(tokens) and last - i + 1 < _MAX_PHONE_GROUPS:
                    if not linked[last] or (sizes[last + 1] < 2 and not intl):
                        break
                    last += 1
            for j in range(last, i - 1, -1):
                if not 7 <= cum[j + 1] - cum[i] <= 17:
                    continue
                span = _phone_at(text, tokens, i, j)
                if span is not None:
                    yield span
                    i = j
                    break
            i += 1
