"""Accuracy per model and decision: the counting itself, and a check over HTTP."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from batchyard.client import AsyncClient
from batchyard.client.check import check_models, score_model
from batchyard.client.inputs import LabelledText
from tests.support.fake_gateway import DECISIONS, FakeGateway

LABELLED = [
    LabelledText("a", "t", {"sentiment": "positive", "spam": "no"}),
    LabelledText("b", "t", {"sentiment": "negative"}),
    LabelledText("c", "t", {"sentiment": "neutral", "spam": "yes"}),
    LabelledText("d", "t", {"sentiment": "neutral"}),
]


def _answers(**picks: str) -> list[dict[str, str]]:
    return [{"decision": d, "outcome": o} for d, o in picks.items()]


def test_accuracy_counts_each_label_of_each_answered_text() -> None:
    answers = {
        "a": _answers(sentiment="positive", spam="yes"),
        "b": _answers(sentiment="negative", spam="no"),
        "c": _answers(sentiment="positive", spam="yes"),
        # "d" failed: it counts for neither accuracy
    }
    score = score_model("m", LABELLED, answers)  # type: ignore[arg-type]
    assert score.labelled == {"sentiment": 3, "spam": 2}
    assert score.correct == {"sentiment": 2, "spam": 1}
    assert score.accuracy("sentiment") == pytest.approx(2 / 3)
    assert score.accuracy("spam") == pytest.approx(0.5)
    assert score.overall == pytest.approx(3 / 5)
    assert score.accuracy("other") is None


def test_a_missing_answer_for_a_labelled_decision_is_wrong() -> None:
    score = score_model("m", LABELLED[:1], {"a": _answers(sentiment="positive")})  # type: ignore[arg-type]
    assert score.correct == {"sentiment": 1, "spam": 0}


async def test_check_compares_models_over_http(gateway: FakeGateway, tmp_path: Path) -> None:
    labelled = [
        LabelledText(
            "p1", "great sentiment=positive spam=no", {"sentiment": "positive", "spam": "no"}
        ),
        LabelledText(
            "p2", "awful sentiment=negative spam=no", {"sentiment": "negative", "spam": "no"}
        ),
        LabelledText(
            "p3", "buy now sentiment=neutral spam=yes", {"sentiment": "neutral", "spam": "yes"}
        ),
        LabelledText(
            "p4", "fine sentiment=positive spam=no", {"sentiment": "positive", "spam": "no"}
        ),
    ]
    async with AsyncClient(gateway.base_url, gateway.api_key) as client:
        report = await check_models(
            client,
            labelled,
            DECISIONS,
            ["kettei-core", "kettei-dumb"],  # type: ignore[arg-type]
        )
    core, dumb = report.models
    assert core.overall == 1.0 and core.answered == 4 and core.failed == 0
    # kettei-dumb always picks the first outcome: positive, yes.
    assert dumb.accuracy("sentiment") == 0.5 and dumb.accuracy("spam") == 0.25
    assert core.cost > 0 and dumb.cost > 0
    body = report.to_json()
    assert body["models"][1]["accuracy"] == {"sentiment": 0.5, "spam": 0.25}
    assert body["texts"][2]["answers"]["kettei-dumb"] == {"sentiment": "positive", "spam": "yes"}
    # Keys as in run: one per text and model; checking again costs nothing more.
    keys = [r.key for r in gateway.decide_requests()]
    assert len(set(keys)) == 8
    spent = gateway.credit
    async with AsyncClient(gateway.base_url, gateway.api_key) as client:
        await check_models(client, labelled, DECISIONS, ["kettei-core"])  # type: ignore[arg-type]
    assert gateway.credit == spent and isinstance(spent, Decimal)
