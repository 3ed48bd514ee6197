"""Network identifiers: the ``user:password`` of a URL, MAC and IP addresses.

IP addresses are confirmed by the ``ipaddress`` parser, and only those that can
point at someone count: loopback, unspecified, multicast and reserved
addresses, CIDR network bases and version strings such as "1.2.3.4" after
"version" are left alone.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterator
from typing import Final

from batchyard.core.privacy.findings import Span

# --- credentials in URLs -----------------------------------------------------

_URL_CREDENTIALS_RE = re.compile(
    r"(?<![A-Za-z])(?i:[a-z][a-z0-9+.-]{1,20}://)(?P<cred>[^\s/:@\[\]]*:[^\s/\[\]]+)@"
)


def url_credentials(text: str) -> Iterator[Span]:
    if "://" not in text:
        return
    for m in _URL_CREDENTIALS_RE.finditer(text):
        yield m.span("cred")


# --- MAC and IP addresses ---------------------------------------------------

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


def macs(text: str) -> Iterator[Span]:
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


def ips(text: str) -> Iterator[Span]:
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


def _ipv6s(text: str) -> Iterator[Span]:
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
