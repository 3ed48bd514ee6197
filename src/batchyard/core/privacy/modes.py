"""``privacy.mode`` applied to the chat messages of a submission."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping, Sequence
from enum import StrEnum
from typing import Any

from batchyard.core.privacy.findings import RANK
from batchyard.core.privacy.scan import find_personal_data, redact
from batchyard.errors import InvalidRequest

# The package's name, as the logger was named before the package was split.
logger = logging.getLogger("batchyard.core.privacy")


class PrivacyMode(StrEnum):
    """What a submission's ``privacy.mode`` does with the personal data in its messages."""

    OFF = "off"
    REDACT = "redact"
    REJECT = "reject"


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
                f"messages[{index}] ({', '.join(sorted(kinds, key=lambda k: RANK[k]))})"
            )
    if offenders:
        raise InvalidRequest(
            "personal data found in " + "; ".join(offenders) + "; remove it or use "
            "privacy mode 'redact'",
            code="privacy_rejected",
            param="messages",
        )
    return [dict(m) for m in messages]
