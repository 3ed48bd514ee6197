"""Account and identity numbers, each confirmed by its issuer's own rule.

IBANs by the registry's length for their country and mod-97, cards by issuer
prefix, length, grouping and Luhn, US social security numbers by the ranges
never issued, UK National Insurance numbers by their letter rules. A digit run
that fails its rule is an order number, not personal data.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Final

from batchyard.core.privacy.findings import Span

# --- IBAN --------------------------------------------------------------------

# Country code and total length of its IBANs, from the SWIFT IBAN registry.
_IBAN_REGISTRY: Final = (
    "AD24 AE23 AL28 AT20 AZ28 BA20 BE16 BG22 BH22 BI27 BR29 BY28 CH21 CR22 CY28 CZ24 DE22 "
    "DJ27 DK18 DO28 EE20 EG29 ES24 FI18 FK18 FO18 FR27 GB22 GE22 GI23 GL18 GR27 GT28 HR21 "
    "HU28 IE22 IL23 IQ23 IS26 IT27 JO30 KW30 KZ20 LB28 LC32 LI21 LT20 LU20 LV21 LY25 MC27 "
    "MD24 ME22 MK19 MN20 MR27 MT31 MU30 NI28 NL18 NO15 OM23 PK24 PL28 PS29 PT25 QA29 RO24 "
    "RS22 RU33 SA24 SC31 SD18 SE24 SI19 SK24 SM27 SO23 ST25 SV28 TL23 TN24 TR26 UA29 VA22 "
    "VG24 XK20 YE30"
)
_IBAN_LENGTHS: Final[Mapping[str, int]] = {e[:2]: int(e[2:]) for e in _IBAN_REGISTRY.split()}
_IBAN_RE = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]){11,30}")


def _iban_checksum_ok(iban: str) -> bool:
    rearranged = iban[4:] + iban[:4]
    return int("".join(str(int(c, 36)) for c in rearranged)) % 97 == 1


def ibans(text: str) -> Iterator[Span]:
    # A manual scan, not finditer: the greedy candidate may run into a second
    # IBAN right behind the first, which must still be found after truncation.
    pos = 0
    while (m := _IBAN_RE.search(text, pos)) is not None:
        pos = m.start() + 1
        length = _IBAN_LENGTHS.get(m.group()[:2])
        if length is None:
            continue
        chars, end = [], m.start()
        for i in range(m.start(), m.end()):
            if text[i] != " ":
                chars.append(text[i])
                if len(chars) == length:
                    end = i + 1
                    break
        if len(chars) < length or (end < len(text) and text[end].isalnum()):
            continue
        if _iban_checksum_ok("".join(chars)):
            yield m.start(), end
            pos = end


# --- cards -------------------------------------------------------------------

_CARD_RE = re.compile(
    r"(?<![\w.,-])[2-6][0-9]{3}(?:[0-9]{9,15}|([ -])[0-9]{4,6}(?:\1[0-9]{1,5}){1,3})"
    r"(?![\w-]|[.,][0-9])"
)


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


# (prefix, allowed lengths): Visa, Mastercard, Amex, Diners, Discover, JCB,
# UnionPay, Maestro. A Luhn-valid number outside these is one in ten of any
# random digit run, not a card.
_ISSUERS: Final = (
    ("4", (13, 16)),
    *((str(p), (16,)) for p in range(51, 56)),
    *((str(p), (16,)) for p in range(2221, 2721)),
    ("34", (15,)),
    ("37", (15,)),
    *((p, (14, 16)) for p in ("300", "301", "302", "303", "304", "305", "309", "36", "38", "39")),
    *((p, (16, 17, 18, 19)) for p in ("6011", "644", "645", "646", "647", "648", "649", "65")),
    *((str(p), (16, 17, 18, 19)) for p in range(3528, 3590)),
    ("62", (16, 17, 18, 19)),
    *((p, tuple(range(13, 20))) for p in ("50", "56", "57", "58", "6")),
)


def _issuer_ok(digits: str) -> bool:
    return any(digits.startswith(p) and len(digits) in lengths for p, lengths in _ISSUERS)


def _card_groups_ok(sizes: list[int]) -> bool:
    if sizes[:2] == [4, 6]:  # Amex 4-6-5, Diners 4-6-4
        return len(sizes) == 3 and sizes[2] in (4, 5)
    return all(s == 4 for s in sizes[:-1]) and 1 <= sizes[-1] <= 4


_IBAN_HEAD_RE = re.compile(r"[A-Z]{2}[0-9]{2} ?$")


def after_iban_head(text: str, pos: int) -> bool:
    """Whether digits at pos continue an IBAN that failed its own check: not a card, not a phone."""
    return _IBAN_HEAD_RE.search(text, max(0, pos - 5), pos) is not None


def cards(text: str) -> Iterator[Span]:
    # A manual scan: "2023 4111 1111 1111 1111" is a candidate that fails, and
    # the card starting at its second group must still be tried.
    pos = 0
    while (m := _CARD_RE.search(text, pos)) is not None:
        pos = m.end()
        sep = m.group(1)
        if after_iban_head(text, m.start()):
            continue
        if sep is None:
            if _issuer_ok(m.group()) and _luhn_ok(m.group()):
                yield m.span()
            continue
        groups = m.group().split(sep)
        # "4111 1111 1111 1111 0925" is a card and an expiry: try shorter prefixes.
        for n in range(len(groups), 2, -1):
            digits = "".join(groups[:n])
            sizes = [len(g) for g in groups[:n]]
            if _issuer_ok(digits) and _card_groups_ok(sizes) and _luhn_ok(digits):
                pos = m.start() + len(sep.join(groups[:n]))
                yield m.start(), pos
                break
        else:
            pos = m.start() + len(groups[0]) + 1


# --- national identifiers ----------------------------------------------------

# Patterns below start with a plain character class rather than a lookbehind
# so that the regex engine can skip ahead; the boundaries are checked after.
_SSN_RE = re.compile(r"[0-9]{3}-[0-9]{2}-[0-9]{4}")
_LABELLED_SSN_RE = re.compile(
    r"(?<![A-Za-z])(?i:(?:ssn|social security(?: number| no\.?)?)\b)[\s:#]*"
    r"(?P<ssn>[0-9]{3} ?[0-9]{2} ?[0-9]{4})(?![\w-])"
)
_ADVERTISED_SSNS: Final = frozenset({"078051120", "219099999"})


def _ssn_ok(digits: str) -> bool:
    area, group, serial = digits[:3], digits[3:5], digits[5:]
    return (
        area not in ("000", "666")
        and area[0] != "9"
        and group != "00"
        and serial != "0000"
        and digits not in _ADVERTISED_SSNS
    )


def ssns(text: str) -> Iterator[Span]:
    for m in _SSN_RE.finditer(text):
        start, end = m.span()
        if start and (text[start - 1].isalnum() or text[start - 1] in "-_"):
            continue
        if end < len(text) and (text[end].isalnum() or text[end] in "-_"):
            continue
        if _ssn_ok(m.group().replace("-", "")):
            yield start, end
    lower = text.lower()
    if "ssn" in lower or "social security" in lower:
        for m in _LABELLED_SSN_RE.finditer(text):
            if _ssn_ok(m.group("ssn").replace(" ", "")):
                yield m.span("ssn")


_NINO_RE = re.compile(
    r"\b(?!BG|GB|NK|KN|TN|NT|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]"
    r" ?[0-9]{2} ?[0-9]{2} ?[0-9]{2} ?[A-D]\b"
)


def ninos(text: str) -> Iterator[Span]:
    for m in _NINO_RE.finditer(text):
        yield m.span()
