"""Privacy redaction: a labelled corpus, leak checks, properties and the modes."""

from __future__ import annotations

import copy
import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchyard.core.privacy import (
    PLACEHOLDERS,
    Finding,
    Kind,
    PrivacyMode,
    apply,
    find_personal_data,
    redact,
    redact_messages,
)
from batchyard.errors import InvalidRequest

CORPUS_PATH = Path(__file__).with_name("privacy_corpus.jsonl")
CORPUS: list[dict[str, Any]] = [
    json.loads(line) for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines() if line
]
POSITIVES = [e for e in CORPUS if e["expect"]]
NEGATIVES = [e for e in CORPUS if not e["expect"]]

# One sample of every kind, for the properties and the modes.
SAMPLES: dict[str, str] = {
    "EMAIL": "alice.smith@mail.example.co.uk",
    "PHONE": "+44 20 7946 0958",
    "CARD": "4111 1111 1111 1111",
    "IBAN": "DE89 3704 0044 0532 0130 00",
    "IP": "2001:db8::8a2e:370:7334",
    "SSN": "536-22-8147",
    "NINO": "AB 12 34 56 C",
    "DOB": "DOB: 1990-01-02",
    "ADDRESS": "221B Baker Street",
    "SECRET": "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
    "MAC": "00:1A:2B:3C:4D:5E",
    "CREDENTIALS": "postgres://bob:hunter2x@db.internal/app",
}


def _counts(text: str) -> dict[str, int]:
    return dict(Counter(f.kind for f in find_personal_data(text)))


def _label(entry: dict[str, Any]) -> str:
    return entry["text"][:40]


# --- the corpus --------------------------------------------------------------


def test_corpus_is_large_and_covers_every_kind() -> None:
    assert len(CORPUS) >= 120
    assert len(NEGATIVES) >= 50
    covered = {kind for e in POSITIVES for kind in e["expect"]}
    assert covered == set(PLACEHOLDERS)


@pytest.mark.parametrize("entry", CORPUS, ids=_label)
def test_corpus_entry(entry: dict[str, Any]) -> None:
    assert _counts(entry["text"]) == entry["expect"]


def test_corpus_precision_and_recall_are_perfect() -> None:
    true_pos: Counter[str] = Counter()
    false_pos: Counter[str] = Counter()
    false_neg: Counter[str] = Counter()
    for entry in CORPUS:
        got = Counter(_counts(entry["text"]))
        want = Counter(entry["expect"])
        true_pos.update(got & want)
        false_pos.update(got - want)
        false_neg.update(want - got)
    assert not false_pos, f"false positives by kind: {dict(false_pos)}"
    assert not false_neg, f"false negatives by kind: {dict(false_neg)}"
    assert sum(true_pos.values()) >= 100


@pytest.mark.parametrize("entry", [e for e in POSITIVES if "pii" in e], ids=_label)
def test_redaction_leaves_nothing_of_the_personal_data(entry: dict[str, Any]) -> None:
    out, findings = redact(entry["text"])
    assert findings
    for secret in entry["pii"]:
        assert secret not in out
        if "@" in secret:
            # Every part of the domain is gone too, unless the text has it elsewhere.
            domain = secret.split("@", 1)[1]
            elsewhere = entry["text"].replace(secret, "")
            for part in [domain, *domain.split(".")[:-1]]:
                assert out.count(part) <= elsewhere.count(part), part


@pytest.mark.parametrize("entry", NEGATIVES, ids=_label)
def test_text_without_personal_data_is_returned_unchanged(entry: dict[str, Any]) -> None:
    assert redact(entry["text"]) == (entry["text"], [])


# --- findings and placeholders -----------------------------------------------


def test_findings_carry_position_and_kind_but_never_the_text() -> None:
    text = f"mail {SAMPLES['EMAIL']} now"
    (finding,) = find_personal_data(text)
    assert finding == Finding("EMAIL", 5, 5 + len(SAMPLES["EMAIL"]))
    assert SAMPLES["EMAIL"] not in repr(finding)
    assert set(Finding.__dataclass_fields__) == {"kind", "start", "end"}


def test_placeholders_are_typed_and_free_of_digits() -> None:
    assert set(PLACEHOLDERS) == {k.value for k in Kind}
    for kind, placeholder in PLACEHOLDERS.items():
        assert placeholder == f"[{kind}]"
        assert not any(c.isdigit() for c in placeholder)


def test_email_is_replaced_whole_including_the_domain() -> None:
    out, _ = redact("Write to <carol+tag@sub.brightmail.io>.")
    assert out == "Write to <[EMAIL]>."


def test_url_credentials_win_over_the_email_look_alike_inside_them() -> None:
    out, findings = redact("https://svc-user:p@ss-w0rd@files.internal/path")
    assert out == "https://[CREDENTIALS]@files.internal/path"
    assert [f.kind for f in findings] == ["CREDENTIALS"]


def test_card_wins_over_a_phone_reading_of_the_same_digits() -> None:
    assert _counts("card 4111 1111 1111 1111") == {"CARD": 1}


def test_card_followed_by_an_expiry_is_cut_at_the_card() -> None:
    out, _ = redact("4111 1111 1111 1111 0927")
    assert out == "[CARD] 0927"


def test_labelled_dob_keeps_the_label() -> None:
    assert redact("DOB: 1990-01-02")[0] == "DOB: [DOB]"
    assert redact("born on 3 May 1985.")[0] == "born on [DOB]."


def test_each_kind_has_its_placeholder_in_the_output() -> None:
    for kind, sample in SAMPLES.items():
        out, findings = redact(f"x {sample} y")
        assert [f.kind for f in findings] == [kind], sample
        assert PLACEHOLDERS[kind] in out


# --- properties --------------------------------------------------------------

_FILLER = st.text(alphabet=st.sampled_from(list("abcxyz ABC019 .,:;-+@#()[]/\n\té")), max_size=30)
_PIECES = st.one_of(_FILLER, st.sampled_from(list(SAMPLES.values())))
_MIXED = st.lists(_PIECES, max_size=8).map(" ".join)
_SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("PRIVACY_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@_SETTINGS
@given(_MIXED)
def test_redaction_is_idempotent(text: str) -> None:
    once, _ = redact(text)
    twice, findings = redact(once)
    assert findings == []
    assert twice == once


@_SETTINGS
@given(st.lists(st.sampled_from(CORPUS), min_size=2, max_size=4), st.sampled_from(["\n", " | "]))
def test_corpus_entries_side_by_side_add_up(entries: list[dict[str, Any]], sep: str) -> None:
    want: Counter[str] = Counter()
    for entry in entries:
        want.update(entry["expect"])
    assert Counter(_counts(sep.join(e["text"] for e in entries))) == want


@_SETTINGS
@given(st.lists(st.sampled_from(CORPUS), min_size=2, max_size=4), st.sampled_from(["", ",", "."]))
def test_redaction_is_idempotent_on_glued_corpus_entries(
    entries: list[dict[str, Any]], glue: str
) -> None:
    once, _ = redact(glue.join(e["text"] for e in entries))
    assert find_personal_data(once) == []


@_SETTINGS
@given(st.text(max_size=200))
def test_redaction_is_idempotent_on_arbitrary_text(text: str) -> None:
    once, _ = redact(text)
    assert find_personal_data(once) == []


@_SETTINGS
@given(_MIXED)
def test_findings_are_sorted_disjoint_and_output_is_built_from_them(text: str) -> None:
    out, findings = redact(text)
    expected: list[str] = []
    pos = 0
    for f in findings:
        assert pos <= f.start < f.end <= len(text)
        expected += [text[pos : f.start], PLACEHOLDERS[f.kind]]
        pos = f.end
    expected.append(text[pos:])
    assert out == "".join(expected)


@_SETTINGS
@given(_MIXED)
def test_no_digit_of_a_finding_survives(text: str) -> None:
    out, findings = redact(text)
    kept = []
    pos = 0
    for f in findings:
        kept.append(text[pos : f.start])
        pos = f.end
    kept.append(text[pos:])
    assert re.findall(r"\d", out) == re.findall(r"\d", "".join(kept))


@_SETTINGS
@given(st.text(max_size=300))
def test_text_without_findings_is_unchanged(text: str) -> None:
    out, findings = redact(text)
    if not findings:
        assert out == text
    else:
        assert out != text


# --- chat messages and modes -------------------------------------------------


def _messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You summarise."},
        {"role": "user", "content": f"I am {SAMPLES['EMAIL']}, call {SAMPLES['PHONE']}."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"card {SAMPLES['CARD']}"},
                {"type": "image_url", "image_url": {"url": "https://img.example/a.png?u=4111"}},
                {"type": "text", "text": "nothing here"},
            ],
        },
        {"role": "assistant", "content": None},
    ]


def test_redact_messages_redacts_text_and_leaves_input_untouched() -> None:
    messages = _messages()
    before = copy.deepcopy(messages)
    out, count = redact_messages(messages)
    assert messages == before
    assert count == 3
    assert out[0] == before[0]
    assert out[1]["content"] == "I am [EMAIL], call [PHONE]."
    assert out[2]["content"][0] == {"type": "text", "text": "card [CARD]"}
    assert out[2]["content"][1] == before[2]["content"][1]
    assert out[2]["content"][1] is not messages[2]["content"][1]
    assert out[2]["content"][2]["text"] == "nothing here"
    assert out[3] == {"role": "assistant", "content": None}


def test_apply_off_keeps_the_text() -> None:
    messages = _messages()
    assert apply(PrivacyMode.OFF, messages) == messages


def test_apply_redact_redacts() -> None:
    out = apply(PrivacyMode.REDACT, _messages())
    assert out == redact_messages(_messages())[0]


def test_apply_reject_refuses_and_names_kinds_and_indexes_only() -> None:
    with pytest.raises(InvalidRequest) as caught:
        apply("reject", _messages())
    err = caught.value
    assert err.code == "privacy_rejected"
    assert err.status == 400
    assert "messages[1] (EMAIL, PHONE)" in err.message
    assert "messages[2] (CARD)" in err.message
    body = json.dumps(err.to_body())
    for sample in (SAMPLES["EMAIL"], SAMPLES["PHONE"], SAMPLES["CARD"]):
        assert sample not in body
    assert "7946" not in body and "1111" not in body and "example" not in body


def test_apply_reject_passes_clean_messages() -> None:
    clean = [{"role": "user", "content": "Summarize this public release note."}]
    assert apply(PrivacyMode.REJECT, clean) == clean


def test_unknown_mode_is_refused_as_a_bad_request() -> None:
    with pytest.raises(InvalidRequest) as caught:
        apply("shred", _messages())
    assert caught.value.param == "privacy.mode"


# --- size --------------------------------------------------------------------


def test_a_megabyte_submission_is_redacted_completely() -> None:
    rng = random.Random(7)
    words = [
        "the",
        "order",
        "12345",
        "shipped",
        "in",
        "2023",
        "for",
        "$19.99",
        "at",
        "10:30",
        "version",
        "1.2.3",
        "via",
    ]
    pieces: list[str] = []
    planted = 0
    size = 0
    while size < 1_000_000:
        chunk = " ".join(rng.choice(words) for _ in range(40))
        if rng.random() < 0.3:
            kind = rng.choice(sorted(SAMPLES))
            chunk += f" {SAMPLES[kind]} ."
            planted += 1
        pieces.append(chunk)
        size += len(chunk) + 1
    text = "\n".join(pieces)
    out, findings = redact(text)
    assert len(findings) == planted
    for sample in SAMPLES.values():
        assert sample not in out
