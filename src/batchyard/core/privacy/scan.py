"""Every detector over a text, in precedence order: the findings and the redaction.

The detectors only propose spans; this module decides which stand. Kinds run
in the order of ``Kind``, each over the text with the earlier findings blanked
out, overlapping spans of one kind merge, and the scan repeats until redacted
text would redact to itself.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator
from typing import Final

from batchyard.core.privacy import contact, identifiers, labelled, network
from batchyard.core.privacy.findings import PLACEHOLDERS, Finding, Kind, Span

_DIGITLESS_KINDS: Final = frozenset({Kind.SECRET, Kind.CREDENTIALS, Kind.EMAIL, Kind.MAC})
_DETECTORS: Final[tuple[tuple[Kind, Callable[[str], Iterator[Span]]], ...]] = (
    (Kind.SECRET, labelled.secrets),
    (Kind.CREDENTIALS, network.url_credentials),
    (Kind.IBAN, identifiers.ibans),
    (Kind.CARD, identifiers.cards),
    (Kind.EMAIL, contact.emails),
    (Kind.SSN, identifiers.ssns),
    (Kind.NINO, identifiers.ninos),
    (Kind.MAC, network.macs),
    (Kind.IP, network.ips),
    (Kind.DOB, labelled.dates_of_birth),
    (Kind.PHONE, contact.phones),
    (Kind.ADDRESS, labelled.addresses),
)


def _mask(text: str, spans: list[Span]) -> str:
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


def _overlaps(taken: list[Span], span: Span) -> bool:
    i = bisect_right(taken, span)
    return (i > 0 and taken[i - 1][1] > span[0]) or (i < len(taken) and taken[i][0] < span[1])


def _merged(candidates: Iterator[Span]) -> list[Span]:
    """Overlapping spans of one kind joined, in text order."""
    spans: list[Span] = []
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
