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


def test_raw_beside_calibrated_per_decision() -> None:
    """Balanced accuracy, the confusion matrix and ECE, for the answers and the raw argmax."""
    decisions = [
        {
            "id": "sentiment",
            "question": "?",
            "outcomes": [{"id": "positive"}, {"id": "negative"}, {"id": "neutral"}],
        }
    ]
    labelled = [
        LabelledText(str(i), "t", {"sentiment": label})
        for i, label in enumerate(["positive"] * 4 + ["negative"] * 4 + ["neutral"] * 2)
    ]

    def answer(outcome: str, confidence: float) -> list[dict[str, object]]:
        rest = (1 - confidence) / 2
        probs = {
            o: (confidence if o == outcome else rest) for o in ("positive", "negative", "neutral")
        }
        # The raw model says positive to everything.
        raw = {"positive": 0.8, "negative": 0.15, "neutral": 0.05}
        return [
            {
                "decision": "sentiment",
                "outcome": outcome,
                "probabilities": probs,
                "raw_probabilities": raw,
            }
        ]

    picks = ["positive"] * 4 + ["negative"] * 3 + ["positive"] + ["neutral", "negative"]
    answers = {str(i): answer(p, 0.9 if i < 8 else 0.5) for i, p in enumerate(picks)}
    score = score_model("m", labelled, answers, decisions)  # type: ignore[arg-type]
    q = score.quality["sentiment"]
    assert q.calibrated.outcomes == ["positive", "negative", "neutral"]
    assert q.calibrated.matrix == [[4, 0, 0], [1, 3, 0], [0, 1, 1]]
    assert q.calibrated.accuracy == pytest.approx(8 / 10)
    assert q.calibrated.balanced_accuracy == pytest.approx((1 + 3 / 4 + 1 / 2) / 3)
    # Raw: always positive: right on the positives only.
    assert q.raw.matrix == [[4, 0, 0], [4, 0, 0], [2, 0, 0]]
    assert q.raw.accuracy == pytest.approx(0.4)
    assert q.raw.balanced_accuracy == pytest.approx(1 / 3)
    # ECE: eight answers at 0.9 with 7 right, two at 0.5 with 1 right.
    assert q.calibrated.ece == pytest.approx(0.8 * abs(0.9 - 7 / 8) + 0.2 * abs(0.5 - 0.5))
    assert q.raw.ece == pytest.approx(abs(0.8 - 0.4))
    body = score.to_json()["quality"]["sentiment"]
    assert body["raw"]["confusion"]["negative"] == {"positive": 4, "negative": 0, "neutral": 0}
    assert body["calibrated"]["balanced_accuracy"] == pytest.approx(0.75)


def test_without_raw_probabilities_raw_is_the_answer_itself() -> None:
    labelled = [LabelledText("a", "t", {"spam": "yes"})]
    score = score_model("m", labelled, {"a": _answers(spam="no")})  # type: ignore[arg-type]
    q = score.quality["spam"]
    assert q.raw.matrix == q.calibrated.matrix
    # No probabilities were sent: no calibration error can be stated.
    assert q.calibrated.ece is None and q.calibrated.accuracy == 0.0


def test_expected_calibration_error_by_hand() -> None:
    from batchyard.client.accuracy import balanced_accuracy, expected_calibration_error

    assert expected_calibration_error([], []) is None
    assert expected_calibration_error([1.0, 1.0], [True, True]) == 0.0
    assert expected_calibration_error([0.95, 0.15], [False, True]) == pytest.approx(
        0.5 * 0.95 + 0.5 * 0.85
    )
    assert balanced_accuracy([[0, 0], [0, 0]]) is None
