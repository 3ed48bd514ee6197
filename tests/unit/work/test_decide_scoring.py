"""A decision set's name in the store: the same for every text, another for another prompt."""

from __future__ import annotations

from typing import Any

import pytest

from batchyard.core import calibration as cal
from batchyard.core import decisions as rules
from batchyard.work.decide_scoring import fingerprint

DECISIONS = [
    {
        "id": "sentiment",
        "question": "How does the writer feel?",
        "outcomes": [{"id": "positive", "description": "pleased"}, {"id": "negative"}],
    }
]


def request(text: str, **changes: Any) -> rules.DecideRequest:
    return rules.parse_request(
        {"model": "kettei-core", "input": {"text": text}, "decisions": DECISIONS, **changes}
    )


def test_every_text_and_mode_of_a_set_shares_its_name() -> None:
    fp = fingerprint("kettei-core", request("Great."))
    assert fp == fingerprint("kettei-core", request("Awful, and late.", calibration="none"))
    assert fp != fingerprint("kettei-fat", request("Great."))


def test_another_prompt_layout_is_another_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Estimates made under one layout never calibrate answers read under another."""
    req = request("Great.")
    fp = fingerprint("kettei-core", req)
    words = [(d.id, d.question, [(o.id, o.description) for o in d.outcomes]) for d in req.decisions]
    assert fp != cal.set_fingerprint("kettei-core", words)  # the layout is part of the name

    monkeypatch.setattr(rules, "SYSTEM_PROMPT", "Answer about the text.")
    assert fingerprint("kettei-core", req) != fp

    monkeypatch.undo()
    original = rules.build_messages

    def text_first(r: rules.DecideRequest, fmt: rules.AnswerFormat) -> list[dict[str, Any]]:
        system, user = original(r, fmt)
        head, _, text = user["content"].rpartition("\n\nText:\n")
        return [system, {"role": "user", "content": f"Text:\n{text}\n\n{head}"}]

    monkeypatch.setattr(rules, "build_messages", text_first)
    assert fingerprint("kettei-core", req) != fp
