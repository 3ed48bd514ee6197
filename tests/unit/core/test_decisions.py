"""The decide rules on their own: validation codes, the prompt, and reading answers."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchyard.core import decisions as d
from batchyard.errors import BatchyardError, ModelOutputInvalid

SENTIMENT = {
    "id": "sentiment",
    "question": "How does the writer feel about the product?",
    "outcomes": [
        {"id": "positive", "description": "pleased"},
        {"id": "negative", "description": "unhappy"},
        {"id": "neutral", "description": "neither"},
    ],
}
TOPIC = {
    "id": "topic",
    "question": "What is the comment about?",
    "outcomes": [{"id": "battery"}, {"id": "screen"}],
}
BODY: dict[str, Any] = {
    "model": "kettei-core",
    "input": {"text": "The battery died after two days."},
    "decisions": [SENTIMENT, TOPIC],
}


def parsed(**changes: Any) -> d.DecideRequest:
    return d.parse_request({**BODY, **changes})


def code_of(body: dict[str, Any]) -> str:
    with pytest.raises(BatchyardError) as info:
        d.parse_request(body)
    assert info.value.status == 400 and info.value.retryable is False
    return info.value.code


def test_a_valid_body_keeps_order_and_defaults() -> None:
    req = parsed()
    assert [x.id for x in req.decisions] == ["sentiment", "topic"]
    assert req.decisions[0].outcome_ids == ("positive", "negative", "neutral")
    assert req.decisions[1].outcomes[0].description == ""
    assert req.fallback == "base" and req.max_output_tokens is None
    assert req.input == d.DecideInput(text="The battery died after two days.")


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"decisions": []}, "no_decisions"),
        ({"decisions": None}, "no_decisions"),
        ({"decisions": [{**TOPIC, "outcomes": [{"id": "only"}]}]}, "too_few_outcomes"),
        ({"decisions": [{**TOPIC, "outcomes": []}]}, "too_few_outcomes"),
        ({"decisions": [TOPIC, TOPIC]}, "duplicate_id"),
        ({"decisions": [{**TOPIC, "outcomes": [{"id": "a"}, {"id": "a"}]}]}, "duplicate_id"),
        ({"input": {"text": ""}}, "empty_text"),
        ({"input": {"text": "  \n "}}, "empty_text"),
        ({"input": {}}, "empty_text"),
        ({"input": "just a string"}, "invalid_request"),
        ({"input": {"text": "hi", "url": "x"}}, "invalid_request"),
        ({"input": {"image_url": "ftp://x"}}, "invalid_request"),
        ({"decisions": [{**TOPIC, "id": "a:b"}]}, "invalid_request"),
        ({"decisions": [{**TOPIC, "id": " padded"}]}, "invalid_request"),
        ({"decisions": [{**TOPIC, "question": ""}]}, "invalid_request"),
        ({"fallback": "sometimes"}, "invalid_request"),
        ({"max_output_tokens": "64"}, "max_output_tokens_out_of_range"),
        ({"max_output_tokens": True}, "max_output_tokens_out_of_range"),
        ({"model": ""}, "invalid_request"),
    ],
)
def test_each_bad_body_has_its_own_code(change: dict[str, Any], code: str) -> None:
    assert code_of({**BODY, **change}) == code


def test_an_image_alone_is_a_valid_input() -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    req = parsed(input={"image_url": url})
    assert req.input == d.DecideInput(text=None, image_url=url)
    messages = d.build_messages(req, "json")
    parts = messages[-1]["content"]
    assert parts[1] == {"type": "image_url", "image_url": {"url": url}}
    assert parts[0]["text"].endswith("The questions are about the image.")
    assert len(parts) == 2  # the image is last, after everything that is the same for every one


def test_the_prompt_holds_the_text_once_and_every_decision() -> None:
    req = parsed()
    messages = d.build_messages(req, "lines")
    user = messages[-1]["content"]
    assert user.count("The battery died after two days.") == 1
    for decision in req.decisions:
        assert decision.question in user
        for outcome in decision.outcome_ids:
            assert f"- {outcome}" in user
    assert "sentiment: <answer id>\ntopic: <answer id>" in user
    assert "JSON" in d.build_messages(req, "json")[-1]["content"]


@pytest.mark.parametrize("fmt", ["lines", "json"])
def test_the_text_is_last_and_everything_before_it_is_the_same_for_every_text(
    fmt: d.AnswerFormat,
) -> None:
    # The content-free texts too: calibration's prompts share the set's prefix.
    texts = ["The battery died after two days.", "Fine screen.", "N/A", "[MASK]", ""]
    heads = set()
    for text in texts:
        req = d.DecideRequest("m", d.DecideInput(text=text), parsed().decisions, None, "base")
        system, user = d.build_messages(req, fmt)
        assert system == {"role": "system", "content": d.SYSTEM_PROMPT}
        # The text closes the prompt: nothing of the questions or the format after it.
        assert user["content"].endswith("Text:\n" + text)
        heads.add(user["content"][: len(user["content"]) - len(text)])
    assert len(heads) == 1
    head = heads.pop()
    assert head.startswith("Questions:") and head.index("Reply with") < head.index("Text:")


def test_calibration_is_batch_unless_asked_and_checked() -> None:
    assert parsed().calibration == "batch"
    assert parsed(calibration="none").calibration == "none"
    assert parsed(calibration="content_free").calibration == "content_free"
    assert code_of({**BODY, "calibration": "always"}) == "invalid_request"


def test_raw_probabilities_go_beside_the_calibrated_ones() -> None:
    req = parsed()
    probs = [{"positive": 0.2, "negative": 0.7, "neutral": 0.1}, None]
    raw = [{"positive": 0.6, "negative": 0.3, "neutral": 0.1}, {"battery": 1.0}]
    out = d.answers_json(req.decisions[:1], ["negative"], probs[:1], raw[:1])
    assert out == [
        {
            "decision": "sentiment",
            "outcome": "negative",
            "probabilities": probs[0],
            "raw_probabilities": raw[0],
        }
    ]
    assert "raw_probabilities" not in d.answers_json(req.decisions[:1], ["negative"], probs[:1])[0]


def test_scoring_candidates_ask_each_decision_on_its_own() -> None:
    req = parsed()
    # Every decision's answer line opens the reply, whatever the others answer:
    # all of them are scored off the one prompt, together.
    assert d.scoring_candidates(req.decisions) == [
        ["sentiment: positive", "sentiment: negative", "sentiment: neutral"],
        ["topic: battery", "topic: screen"],
    ]


def test_softmax_is_a_distribution_that_ignores_a_shared_offset() -> None:
    p = d.softmax([-1.0, -2.0, -3.0])
    q = d.softmax([-101.0, -102.0, -103.0])
    assert math.isclose(sum(p), 1.0)
    assert all(math.isclose(a, b) for a, b in zip(p, q, strict=True))
    assert p[0] > p[1] > p[2]


def test_needed_output_tokens_bounds_the_longest_answer() -> None:
    req = parsed()

    def count(text: str) -> int:
        return len(text)

    lines = d.needed_output_tokens(req.decisions, "lines", count)
    longest = d.answer_text(req.decisions, ["negative", "battery"], "lines")
    assert lines >= len(longest)
    as_json = d.needed_output_tokens(req.decisions, "json", count)
    assert as_json == len(d.answer_text(req.decisions, ["positive", "battery"], "json"))


def test_response_format_is_one_enum_per_decision() -> None:
    fmt = d.response_format(parsed().decisions)
    schema = fmt["json_schema"]["schema"]
    assert fmt["type"] == "json_schema"
    assert schema["required"] == ["sentiment", "topic"]
    assert schema["properties"]["topic"] == {"type": "string", "enum": ["battery", "screen"]}
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize("fmt", ["lines", "json"])
def test_parse_output_reads_what_answer_text_writes(fmt: d.AnswerFormat) -> None:
    req = parsed()
    text = d.answer_text(req.decisions, ["neutral", "screen"], fmt)
    assert d.parse_output(text, req.decisions, fmt) == ["neutral", "screen"]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("json", "sentiment: negative"),
        ("json", '["negative", "battery"]'),
        ("json", '{"sentiment": "negative"}'),
        ("json", '{"sentiment": "negative", "topic": "battery", "extra": "x"}'),
        ("json", '{"sentiment": "furious", "topic": "battery"}'),
        ("json", '{"sentiment": 1, "topic": "battery"}'),
        ("lines", "sentiment: negative"),
        ("lines", "sentiment: negative\ntopic: battery\ntopic: screen"),
        ("lines", "The writer is unhappy."),
        ("lines", "sentiment: Negative\ntopic: battery"),
        ("lines", "echo: Text:\nsentiment: negative\ntopic: battery"),
    ],
)
def test_parse_output_is_strict(fmt: d.AnswerFormat, text: str) -> None:
    with pytest.raises(ModelOutputInvalid) as info:
        d.parse_output(text, parsed().decisions, fmt)
    assert info.value.code == "model_output_invalid"
    assert info.value.status == 502 and info.value.retryable is False


def lp(token: str, p: float, top: dict[str, float] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": token, "logprob": math.log(p)}
    if top is not None:
        entry["top_logprobs"] = [{"token": t, "logprob": math.log(q)} for t, q in top.items()]
    return entry


def test_probabilities_from_top_logprobs_in_json() -> None:
    req = parsed()
    tokens = [
        lp('{"', 1.0),
        lp("sentiment", 1.0),
        lp('":', 1.0),
        lp(' "', 1.0),
        lp("neg", 0.6, {"neg": 0.6, "pos": 0.2, "neutral": 0.1, "ne": 0.05}),
        lp("ative", 1.0),
        lp('",', 1.0),
        lp(' "topic": "', 1.0),
        lp('battery"}', 0.9, {'battery"}': 0.9, "scr": 0.05, "x": 0.05}),
    ]
    text = "".join(t["token"] for t in tokens)
    assert json.loads(text) == {"sentiment": "negative", "topic": "battery"}
    probs = d.logprob_probabilities(text, tokens, req.decisions, "json")
    # "ne" begins both neutral and negative, so it is not counted for either.
    assert probs[0] is not None
    assert math.isclose(probs[0]["negative"], 0.6 / 0.9)
    assert math.isclose(probs[0]["positive"], 0.2 / 0.9)
    assert math.isclose(probs[0]["neutral"], 0.1 / 0.9)
    assert probs[1] is not None
    assert math.isclose(probs[1]["battery"], 0.9 / 0.95)
    assert math.isclose(sum(probs[1].values()), 1.0)


def test_probabilities_from_top_logprobs_in_lines() -> None:
    req = parsed()
    tokens = [
        lp("sentiment:", 1.0),
        lp(" positive", 0.5, {" positive": 0.5, " negative": 0.3, " neutral": 0.2}),
        lp("\ntopic:", 1.0),
        lp(" screen", 0.7, {" screen": 0.7, " battery": 0.3}),
    ]
    text = "".join(t["token"] for t in tokens)
    probs = d.logprob_probabilities(text, tokens, req.decisions, "lines")
    assert probs[0] == pytest.approx({"positive": 0.5, "negative": 0.3, "neutral": 0.2})
    assert probs[1] == pytest.approx({"screen": 0.7, "battery": 0.3})


def test_probabilities_are_omitted_rather_than_invented() -> None:
    req = parsed()
    text = '{"sentiment": "negative", "topic": "battery"}'
    # No logprobs at all, or tokens without alternatives (FakeUpstream's shape).
    assert d.logprob_probabilities(text, None, req.decisions, "json") == [None, None]
    words = [{"token": w, "logprob": -0.25} for w in text.split()]
    assert d.logprob_probabilities(text, words, req.decisions, "json") == [None, None]
    # An outcome missing from the alternatives: its share is unknown.
    tokens = [
        lp('{"sentiment": "', 1.0),
        lp("negative", 0.9, {"negative": 0.9, "positive": 0.1}),
        lp('", "topic": "battery"}', 1.0),
    ]
    text = "".join(t["token"] for t in tokens)
    assert d.logprob_probabilities(text, tokens, req.decisions, "json") == [None, None]


def test_answers_json_leaves_out_unknown_probabilities() -> None:
    req = parsed()
    out = d.answers_json(
        req.decisions,
        ["negative", "battery"],
        [{"positive": 0.1, "negative": 0.8, "neutral": 0.1}, None],
    )
    assert out == [
        {
            "decision": "sentiment",
            "outcome": "negative",
            "probabilities": {"positive": 0.1, "negative": 0.8, "neutral": 0.1},
        },
        {"decision": "topic", "outcome": "battery"},
    ]


ids = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=':"\\'),
    min_size=1,
    max_size=12,
)


@given(
    st.lists(
        st.tuples(ids, st.lists(ids, min_size=2, max_size=4, unique=True)),
        min_size=1,
        max_size=4,
        unique_by=lambda t: t[0],
    ),
    st.data(),
)
def test_every_answer_round_trips_in_both_formats(
    spec: list[tuple[str, list[str]]], data: st.DataObject
) -> None:
    body = {
        **BODY,
        "decisions": [
            {"id": did, "question": "q?", "outcomes": [{"id": o} for o in outs]}
            for did, outs in spec
        ],
    }
    req = d.parse_request(body)
    chosen = [data.draw(st.sampled_from(outs)) for _, outs in spec]
    for fmt in ("lines", "json"):
        text = d.answer_text(req.decisions, chosen, fmt)  # type: ignore[arg-type]
        assert d.parse_output(text, req.decisions, fmt) == chosen  # type: ignore[arg-type]
