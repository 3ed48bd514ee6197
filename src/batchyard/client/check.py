"""``check``: score labelled texts with one or more models and compare accuracy.

The advice of docs/how-to/score-texts.md before a long run is to score a few hundred texts whose
answers you know. This sends them exactly as ``run`` would (same pace, same
per-text idempotency keys, so checking twice costs nothing the second time)
and counts, per model and decision, how often the answer matches the label.
A text that failed counts in ``failed``, not as a wrong answer: accuracy is
over the texts a model actually answered.

Beside accuracy, each model and decision gets balanced accuracy, the
confusion matrix and the expected calibration error (``client.accuracy``),
for the answers as given (calibrated, where the server calibrates) and for
the raw probabilities the server returns beside them (``raw_probabilities``):
the argmax of the model's own scores, before its bias was removed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from batchyard.client.accuracy import Quality
from batchyard.client.async_client import AsyncClient
from batchyard.client.fleet import TextJob, local_tokens, plan_pace, send_all
from batchyard.client.inputs import LabelledText
from batchyard.client.keys import request_hash, text_key
from batchyard.client.pacer import PaceClock
from batchyard.client.types import Answer, DecideResponse, Decision
from batchyard.errors import BatchyardError

__all__ = [
    "NO_ANSWER",
    "CheckReport",
    "DecisionQuality",
    "ModelScore",
    "check_models",
    "score_model",
]


@dataclass
class DecisionQuality:
    """One decision's answers against the labels, as given and from the raw probabilities."""

    calibrated: Quality
    raw: Quality

    def to_json(self) -> dict[str, Any]:
        return {
            "outcomes": self.calibrated.outcomes,
            "calibrated": self.calibrated.to_json(),
            "raw": self.raw.to_json(),
        }


@dataclass
class ModelScore:
    model: str
    correct: dict[str, int] = field(default_factory=dict)
    labelled: dict[str, int] = field(default_factory=dict)
    answered: int = 0
    failed: int = 0
    fallbacks: int = 0
    cost: Decimal = Decimal(0)
    errors: dict[str, int] = field(default_factory=dict)
    quality: dict[str, DecisionQuality] = field(default_factory=dict)

    def accuracy(self, decision: str) -> float | None:
        n = self.labelled.get(decision, 0)
        return self.correct.get(decision, 0) / n if n else None

    @property
    def overall(self) -> float | None:
        """Every label counted once, across decisions."""
        n = sum(self.labelled.values())
        return sum(self.correct.values()) / n if n else None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "accuracy": {d: self.accuracy(d) for d in self.labelled},
            "overall_accuracy": self.overall,
            "correct": self.correct,
            "labelled": self.labelled,
            "answered": self.answered,
            "failed": self.failed,
            "errors": self.errors,
            "fallbacks": self.fallbacks,
            "cost": str(self.cost),
            "quality": {d: q.to_json() for d, q in self.quality.items()},
        }


NO_ANSWER = "(none)"


def _raw_choice(answer: Answer) -> tuple[str, Mapping[str, float] | None]:
    """The outcome the raw probabilities pick; the answer itself where none were sent."""
    raw = answer.get("raw_probabilities")
    if raw:
        return max(raw, key=lambda o: raw[o]), raw
    return answer["outcome"], answer.get("probabilities")


def score_model(
    model: str,
    labelled: Sequence[LabelledText],
    answers: Mapping[str, Sequence[Answer]],
    decisions: Sequence[Decision] = (),
) -> ModelScore:
    """Accuracy and calibration of one model's ``answers`` (by text id) against the labels."""
    score = ModelScore(model)
    listed = {d["id"]: [o["id"] for o in d["outcomes"]] for d in decisions}

    def quality(decision: str) -> DecisionQuality:
        if decision not in score.quality:
            outcomes = listed.get(decision, [])
            score.quality[decision] = DecisionQuality(
                Quality(list(outcomes)), Quality(list(outcomes))
            )
        return score.quality[decision]

    for text in labelled:
        got = answers.get(text.id)
        if got is None:
            continue
        by_decision = {a["decision"]: a for a in got}
        for decision, expected in text.labels.items():
            score.labelled[decision] = score.labelled.get(decision, 0) + 1
            answer = by_decision.get(decision)
            hit = int(answer is not None and answer["outcome"] == expected)
            score.correct[decision] = score.correct.get(decision, 0) + hit
            q = quality(decision)
            if answer is None:
                q.calibrated.add(expected, NO_ANSWER, None)
                q.raw.add(expected, NO_ANSWER, None)
                continue
            q.calibrated.add(expected, answer["outcome"], answer.get("probabilities"))
            q.raw.add(expected, *_raw_choice(answer))
    return score


@dataclass
class CheckReport:
    decisions: list[str]
    models: list[ModelScore]
    texts: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "decisions": self.decisions,
            "models": [m.to_json() for m in self.models],
            "texts": self.texts,
        }


async def check_models(
    client: AsyncClient,
    labelled: Sequence[LabelledText],
    decisions: Sequence[Decision],
    models: Sequence[str],
    *,
    max_output_tokens: int = 64,
    fallback: str = "base",
    rpm: float | None = None,
    concurrency: int | None = None,
    key_suffix: str | None = None,
    on_result: Callable[[str, str, BatchyardError | None], None] | None = None,
    clock: PaceClock | None = None,
) -> CheckReport:
    """Score every labelled text with every model under one shared pace."""
    jobs: list[TextJob] = []
    for model in models:
        req_hash = request_hash(decisions, model, max_output_tokens, fallback)
        jobs.extend(
            TextJob(t.id, t.text, text_key(t.id, req_hash, key_suffix), model, local_tokens(t.text))
            for t in labelled
        )
    answers: dict[str, dict[str, list[Answer]]] = {m: {} for m in models}
    costs = {m: Decimal(0) for m in models}
    fallbacks = dict.fromkeys(models, 0)
    errors: dict[str, dict[str, str]] = {m: {} for m in models}

    def collect(job: TextJob, answer: DecideResponse | None, error: BatchyardError | None) -> None:
        if answer is not None:
            answers[job.model][job.id] = list(answer["answers"])
            costs[job.model] += Decimal(str(answer.get("charge") or "0"))
            if answer.get("fallback"):
                fallbacks[job.model] += 1
        elif error is not None:
            errors[job.model][job.id] = error.code
        if on_result is not None:
            on_result(job.model, job.id, error)

    pace = await plan_pace(client, rpm=rpm, concurrency=concurrency)
    await send_all(
        client,
        jobs,
        decisions=decisions,
        pace=pace,
        on_result=collect,
        max_output_tokens=max_output_tokens,
        fallback=fallback,
        clock=clock,
    )
    scores = []
    for model in models:
        score = score_model(model, labelled, answers[model], decisions)
        score.answered = len(answers[model])
        score.failed = len(errors[model])
        score.cost = costs[model]
        score.fallbacks = fallbacks[model]
        for code in errors[model].values():
            score.errors[code] = score.errors.get(code, 0) + 1
        scores.append(score)
    texts = [
        {
            "id": t.id,
            "labels": t.labels,
            "answers": {
                m: {a["decision"]: a["outcome"] for a in answers[m].get(t.id, [])} for m in models
            },
        }
        for t in labelled
    ]
    return CheckReport([d["id"] for d in decisions], scores, texts)
