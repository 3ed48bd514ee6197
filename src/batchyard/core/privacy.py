"""Personal data out of deferred batches before anything is stored or logged.

A deferred batch sits encrypted in the store for up to a day and its text must
never reach a log line, so ``privacy.mode`` is applied at submission time, before
persistence. ``redact`` swaps each finding for a typed placeholder, ``reject``
refuses the whole submission, ``off`` leaves the text alone.

Off-the-shelf scrubbers (Presidio, scrubadub) weigh hundreds of megabytes and
download models, yet missed a spaced card number and left an e-mail's domain
behind; this module is regular expressions plus checksums, each candidate
confirmed by the rule its issuer uses (Luhn for cards, mod-97 for IBANs, the
``ipaddress`` parser, libphonenumber's metadata), because a redactor that
swallows order numbers and years gets switched off.

Kinds and their placeholders (``PLACEHOLDERS``):

==============  =================  ==============================================
kind            placeholder        what
==============  =================  ==============================================
``SECRET``      ``[SECRET]``       API keys and tokens (``sk-…``, AWS ``AKIA…``,
                                   GitHub, Slack, Stripe, Google, JWTs, PEM
                                   private keys, ``Bearer …``, ``password=…``)
``CREDENTIALS`` ``[CREDENTIALS]``  the ``user:password`` part of a URL
``IBAN``        ``[IBAN]``         IBANs, spaced or not, mod-97 checked
``CARD``        ``[CARD]``         13–19 digit card numbers, Luhn checked
``EMAIL``       ``[EMAIL]``        whole address including the domain, also
                                   ``alice [at] example [dot] com``
``SSN``         ``[SSN]``          US social security numbers
``NINO``        ``[NINO]``         UK National Insurance numbers
``MAC``         ``[MAC]``          MAC addresses
``IP``          ``[IP]``           IPv4 and IPv6 addresses
``DOB``         ``[DOB]``          dates after a birth label ("DOB:", "born on")
``PHONE``       ``[PHONE]``        phone numbers (US, GB, DE, FR, IN national
                                   formats and any ``+``/``00`` international one)
``ADDRESS``     ``[ADDRESS]``      "123 Main Street"-style street addresses
==============  =================  ==============================================

The table is in precedence order: a kind higher up is found first and its
findings are blanked out before the next kind looks, so the digits of a card
never also read as a phone number; overlapping matches of one kind merge. A
placeholder holds neither digits nor anything of the input, and redacted text
redacts to itself.
"""

from __future__ import annotations

import copy
import ipaddress
import logging
import re
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Final

import phonenumbers

from batchyard.errors import InvalidRequest

__all__ = [
    "PLACEHOLDERS",
    "Finding",
    "Kind",
    "PrivacyMode",
    "apply",
    "find_personal_data",
    "redact",
    "redact_messages",
]

logger = logging.getLogger(__name__)


class PrivacyMode(StrEnum):
    OFF = "off"
    REDACT = "redact"
    REJECT = "reject"


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
_RANK: Final[Mapping[str, int]] = {k.value: i for i, k in enumerate(Kind)}


@dataclass(frozen=True, slots=True)
class Finding:
    """Where personal data sits; deliberately without the text, so it can be logged."""

    kind: str
    start: int
    end: int


_Span = tuple[int, int]

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


def _secrets(text: str) -> Iterator[_Span]:
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


_URL_CREDENTIALS_RE = re.compile(
    r"(?<![A-Za-z])(?i:[a-z][a-z0-9+.-]{1,20}://)(?P<cred>[^\s/:@\[\]]*:[^\s/\[\]]+)@"
)


def _url_credentials(text: str) -> Iterator[_Span]:
    if "://" not in text:
        return
    for m in _URL_CREDENTIALS_RE.finditer(text):
        yield m.span("cred")


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


def _ibans(text: str) -> Iterator[_Span]:
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


def _after_iban_head(text: str, pos: int) -> bool:
    """Whether digits at pos continue an IBAN that failed its own check: not a card, not a phone."""
    return _IBAN_HEAD_RE.search(text, max(0, pos - 5), pos) is not None


def _cards(text: str) -> Iterator[_Span]:
    # A manual scan: "2023 4111 1111 1111 1111" is a candidate that fails, and
    # the card starting at its second group must still be tried.
    pos = 0
    while (m := _CARD_RE.search(text, pos)) is not None:
        pos = m.end()
        sep = m.group(1)
        if _after_iban_head(text, m.start()):
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


def _emails(text: str) -> Iterator[_Span]:
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


def _ssns(text: str) -> Iterator[_Span]:
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


def _ninos(text: str) -> Iterator[_Span]:
    for m in _NINO_RE.finditer(text):
        yield m.span()


# --- network -----------------------------------------------------------------

# Anchored on the separators, which prose has far fewer of than hex letters
# or digits; what lies around them is checked in Python.
_MAC_RE = re.compile(
    r"([:-])(?:[0-9A-Fa-f]{2}\1){4}[0-9A-Fa-f]{2}(?![\w:-])"
    r"|\.[0-9A-Fa-f]{4}\.[0-9A-Fa-f]{4}(?![\w.])"
)
_HEX: Final = frozenset("0123456789abcdefABCDEF")
_IPV4_RE = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}")
_IPV6_SEED_RE = re.compile(r":[0-9A-Fa-f]{0,4}:")
_IPV6_CHARS: Final = frozenset("0123456789abcdefABCDEF:")
_IPV6_RE = re.compile(
    r"[0-9A-Fa-f:]*:[0-9A-Fa-f]*:[0-9A-Fa-f:]*"
    r"(?:(?<=:)[0-9]{1,3}(?:\.[0-9]{1,3}){3})?(?:%[0-9A-Za-z]+)?(?![\w:])"
)
_VERSION_BEFORE_RE = re.compile(
    r"(?i)(?:\b(?:version|ver\.?|release|build|v)|[<>~!=]=|[<>^])\s*$"
)  # "version 1.2.3.4", "typing-extensions>=4.10.0.0"


def _macs(text: str) -> Iterator[_Span]:
    for m in _MAC_RE.finditer(text):
        start = m.start() - (2 if m.group(1) else 4)
        if start < 0 or not all(c in _HEX for c in text[start : m.start()]):
            continue
        if start and (text[start - 1].isalnum() or text[start - 1] in "_:.-"):
            continue
        yield start, m.end()


def _personal_ip(
    parse: Callable[[str], ipaddress.IPv4Address | ipaddress.IPv6Address], candidate: str
) -> bool:
    """A valid address that can point at someone: not loopback, 0.0.0.0, multicast or reserved."""
    try:
        address = parse(candidate)
    except ValueError:
        return False
    return not (
        address.is_loopback or address.is_unspecified or address.is_multicast or address.is_reserved
    )


_CIDR_RE = re.compile(r"/([0-9]{1,3})(?![0-9])")


def _network(text: str, end: int) -> bool:
    """Whether the address is the base of a CIDR block wider than one host."""
    m = _CIDR_RE.match(text, end)
    return m is not None and m.group(1) not in ("32", "128")


def _ips(text: str) -> Iterator[_Span]:
    for m in _IPV4_RE.finditer(text):
        start, end = m.span()
        if start and (text[start - 1].isalnum() or text[start - 1] in "._"):
            continue
        after = text[end : end + 2]
        if after[:1].isalnum() or after[:1] == "_" or (after[:1] == "." and after[1:].isdigit()):
            continue  # "1.2.3.4.5", "10.0.0.1a"
        if _VERSION_BEFORE_RE.search(text, max(0, start - 10), start):
            continue
        if _personal_ip(ipaddress.IPv4Address, m.group()) and not _network(text, end):
            yield start, end
    if ":" in text:
        yield from _ipv6s(text)


def _ipv6s(text: str) -> Iterator[_Span]:
    pos = 0
    while (seed := _IPV6_SEED_RE.search(text, pos)) is not None:
        pos = seed.end()
        start = seed.start()
        while start > 0 and text[start - 1] in _IPV6_CHARS:
            start -= 1
        if start and (text[start - 1].isalnum() or text[start - 1] in "_."):
            continue
        if (m := _IPV6_RE.match(text, start)) is None:
            continue
        pos = max(pos, m.end())
        start, end = m.span()
        if text[end - 1] == ":" and not text[start:end].endswith("::"):
            end -= 1  # "fe80::1: up" - the colon belongs to the sentence
        candidate = text[start:end]
        if not any(c.isdigit() for c in candidate):
            continue  # "dead::beef", "a::b" in prose or code
        if "::" in candidate and sum(c in _HEX for c in candidate.split("%")[0]) < 5:
            continue  # "x[1::2]" is a Python slice
        if _personal_ip(ipaddress.IPv6Address, candidate) and not _network(text, end):
            yield start, end


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


def _dobs(text: str) -> Iterator[_Span]:
    lower = text.lower()
    if not any(label in lower for label in _DOB_LABELS):
        return
    for m in _DOB_RE.finditer(text):
        yield m.span("date")


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


def _phone_at(text: str, tokens: list[tuple[int, int]], i: int, j: int) -> _Span | None:
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


def _phones(text: str) -> Iterator[_Span]:
    for w in _PHONE_WINDOW_RE.finditer(text):
        tokens = [m.span() for m in _DIGITS_RE.finditer(text, w.start(), w.end())]
        if len(tokens) > 1 and _after_iban_head(text, tokens[1][0]):
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


def _addresses(text: str) -> Iterator[_Span]:
    if not any(street in text for street in _STREET_TYPES):
        return
    for m in _ADDRESS_RE.finditer(text):
        yield m.span()


# --- putting it together -----------------------------------------------------

_DIGITLESS_KINDS: Final = frozenset({Kind.SECRET, Kind.CREDENTIALS, Kind.EMAIL, Kind.MAC})
_DETECTORS: Final[tuple[tuple[Kind, Callable[[str], Iterator[_Span]]], ...]] = (
    (Kind.SECRET, _secrets),
    (Kind.CREDENTIALS, _url_credentials),
    (Kind.IBAN, _ibans),
    (Kind.CARD, _cards),
    (Kind.EMAIL, _emails),
    (Kind.SSN, _ssns),
    (Kind.NINO, _ninos),
    (Kind.MAC, _macs),
    (Kind.IP, _ips),
    (Kind.DOB, _dobs),
    (Kind.PHONE, _phones),
    (Kind.ADDRESS, _addresses),
)


def _mask(text: str, spans: list[_Span]) -> str:
    """Spans blanked out like placeholders, offsets kept, for the detectors that come later."""
    parts: list[str] = []
    pos = 0
    for start, end in spans:
        parts += [text[pos:start], "[", "X" * (end - start - 2), "]"]
        pos = end
    parts.append(text[pos:])
    return "".join(parts)


def find_personal_data(text: str) -> list[Finding]:
    """Non-overlapping findings in text order.

    Kinds run in precedence order, each over the text with the earlier kinds'
    findings already blanked out, so a card's digits cannot also read as a
    phone number. Overlapping matches of one kind merge into one finding.
    Where a finding is glued to a letter or digit ("1976ES91…"), blanking it out
    can complete a boundary another pattern needed, so the scan repeats until
    nothing new appears: redacting the redacted text finds nothing.
    """
    findings: list[Finding] = []
    masked = text
    for _ in range(_MAX_PASSES):
        found, masked = _scan(masked, findings)
        findings += found
        if not any(_glued(text, f) for f in found):
            break
    findings.sort(key=lambda f: f.start)
    return findings


_MAX_PASSES: Final = 4


def _glued(text: str, finding: Finding) -> bool:
    before = text[finding.start - 1 : finding.start]
    after = text[finding.end : finding.end + 1]
    return before.isalnum() or before == "_" or after.isalnum() or after == "_"


def _scan(text: str, earlier: list[Finding]) -> tuple[list[Finding], str]:
    """One pass of every detector in precedence order, and the text masked after it."""
    findings: list[Finding] = []
    taken = sorted((f.start, f.end) for f in earlier)
    has_digit = any(c in text for c in "0123456789")
    for kind, detect in _DETECTORS:
        if not has_digit and kind not in _DIGITLESS_KINDS:
            continue
        # Masks keep patterns off earlier findings; this makes sure of it.
        spans = [span for span in _merged(detect(text)) if not _overlaps(taken, span)]
        if spans:
            taken = sorted(taken + spans)
            findings += [Finding(kind.value, start, end) for start, end in spans]
            text = _mask(text, spans)
    return findings, text


def _overlaps(taken: list[_Span], span: _Span) -> bool:
    i = bisect_right(taken, span)
    return (i > 0 and taken[i - 1][1] > span[0]) or (i < len(taken) and taken[i][0] < span[1])


def _merged(candidates: Iterator[_Span]) -> list[_Span]:
    """Overlapping spans of one kind joined, in text order."""
    spans: list[_Span] = []
    for start, end in sorted(candidates):
        if end - start < 2:
            continue
        if spans and start < spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((start, end))
    return spans


def redact(text: str) -> tuple[str, list[Finding]]:
    """The text with each finding swapped for its placeholder; offsets refer to the input."""
    findings = find_personal_data(text)
    if not findings:
        return text, findings
    parts: list[str] = []
    pos = 0
    for f in findings:
        parts.append(text[pos : f.start])
        parts.append(PLACEHOLDERS[f.kind])
        pos = f.end
    parts.append(text[pos:])
    return "".join(parts), findings


def _text_slots(message: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """(holder, key) pairs of every text a chat message carries: content or text parts."""
    content = message.get("content")
    if isinstance(content, str):
        yield message, "content"
    elif isinstance(content, list):
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                yield part, "text"


def redact_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """A redacted deep copy of chat messages and the number of findings.

    Only string content and ``text`` parts are touched: image, audio and file
    parts are not text this module can reason about.
    """
    out: list[dict[str, Any]] = [copy.deepcopy(dict(m)) for m in messages]
    count = 0
    for message in out:
        for holder, key in _text_slots(message):
            holder[key], findings = redact(holder[key])
            count += len(findings)
    return out, count


def apply(mode: PrivacyMode | str, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as they may be stored under ``mode``; raises for a rejected submission.

    The rejection names the kinds and message indexes only, since the error
    body is returned to the client and may be logged.
    """
    try:
        mode = PrivacyMode(mode)
    except ValueError:
        raise InvalidRequest(
            "privacy.mode must be one of: off, redact, reject", param="privacy.mode"
        ) from None
    if mode is PrivacyMode.OFF:
        return [dict(m) for m in messages]
    if mode is PrivacyMode.REDACT:
        redacted, count = redact_messages(messages)
        if count:
            logger.info("personal data redacted", extra={"privacy_findings": count})
        return redacted
    offenders: list[str] = []
    for index, message in enumerate(messages):
        kinds: set[str] = set()
        for holder, key in _text_slots(dict(message)):
            kinds.update(f.kind for f in find_personal_data(holder[key]))
        if kinds:
            offenders.append(
                f"messages[{index}] ({', '.join(sorted(kinds, key=lambda k: _RANK[k]))})"
            )
    if offenders:
        raise InvalidRequest(
            "personal data found in " + "; ".join(offenders) + "; remove it or use "
            "privacy mode 'redact'",
            code="privacy_rejected",
            param="messages",
        )
    return [dict(m) for m in messages]
