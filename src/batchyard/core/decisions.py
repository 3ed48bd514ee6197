"""Decisions about one text: the request's rules, the prompt, and reading the answers.

docs/reference/decide.md asks for one text per request with every question about it in the
same call, so the text is paid once and every question is read beside the
others (the prompt lists them all). Everything here is pure (no store, no
engine) so the rules can be tested on their own and the estimate counts
exactly the prompt that decide sends.

Answers are always one of a decision's outcome ids. Two ways get there:

- *scoring* (engines that implement ``ScoringEngine``): the model's own
  log-probability of each outcome's answer line as the reply's opening, every
  decision on its own branch off the one prompt (``scoring_candidates``); the
  best one wins and the probabilities are the softmax of those scores;
- *generation* (OpenAI-compatible routes): a JSON schema with one enum per
  decision where the route supports it, or answer lines otherwise, parsed
  strictly. Probabilities come from the route's ``top_logprobs`` where it sends
  them, and are left out otherwise: a number the model did not give is never
  made up.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from batchyard.core.calibration import CalibrationMode
from batchyard.core.inputs import SPACE
from batchyard.errors import (
    DuplicateId,
    EmptyText,
    InvalidRequest,
    ModelOutputInvalid,
    NoDecisions,
    TooFewOutcomes,
)

__all__ = [
    "IMAGE_URL",
    "AnswerFormat",
    "DecideInput",
    "DecideRequest",
    "Decision",
    "Outcome",
    "answer_text",
    "answers_json",
    "build_messages",
    "logprob_probabilities",
    "needed_output_tokens",
    "parse_output",
    "parse_request",
    "response_format",
    "scoring_candidates",
    "softmax",
]

AnswerFormat = Literal["lines", "json"]
Fallback = Literal["base", "none"]
CALIBRATIONS: tuple[CalibrationMode, ...] = ("batch", "content_free", "none")

MAX_ID_CHARS = 64
# Ids appear inside answer lines (``id: outcome``) and JSON keys, so the
# characters that delimit those are refused rather than escaped.
_FORBIDDEN_ID_CHARS = re.compile(r'[:"\\\x00-\x1f\x7f]')
#: An image decide reads: an http(s) URL, or a base64 data URL (the body's pattern too).
IMAGE_URL = rf"^(https?://[^{SPACE}]+|data:image/[a-zA-Z0-9.+-]+;base64,[A-Za-z0-9+/={SPACE}]+)$"
_IMAGE_URL = re.compile(IMAGE_URL)

SYSTEM_PROMPT = (
    "You answer questions about a text. For each question, choose exactly one of "
    "its answers and write its id exactly as given."
)


@dataclass(frozen=True, slots=True)
class Outcome:
    id: str
    description: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    id: str
    question: str
    outcomes: tuple[Outcome, ...]

    @property
    def outcome_ids(self) -> tuple[str, ...]:
        return tuple(o.id for o in self.outcomes)


@dataclass(frozen=True, slots=True)
class DecideInput:
    text: str | None = None
    image_url: str | None = None


@dataclass(frozen=True, slots=True)
class DecideRequest:
    model: str
    input: DecideInput
    decisions: tuple[Decision, ...]
    max_output_tokens: int | None
    fallback: Fallback
    # How the scoring engine's probabilities are calibrated (core.calibration).
    calibration: CalibrationMode = "batch"


# -- validation ---------------------------------------------------------------


def _check_id(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string", param=param)
    if (
        len(value) > MAX_ID_CHARS
        or value != value.strip()
        or _FORBIDDEN_ID_CHARS.search(value) is not None
    ):
        raise InvalidRequest(
            f"{param} must be 1-{MAX_ID_CHARS} characters without surrounding spaces, "
            'control characters, ":", quotes or backslashes',
            param=param,
        )
    return value


def _optional_str(value: Any, param: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"{param} must be a string", param=param)
    return value


def _parse_input(raw: Any) -> DecideInput:
    if not isinstance(raw, dict):
        raise InvalidRequest(
            'input must be an object: {"text": "..."} or {"image_url": "..."}', param="input"
        )
    unknown = sorted(set(raw) - {"text", "image_url"})
    if unknown:
        raise InvalidRequest(
            f"input takes text or image_url; unknown field {unknown[0]!r}", param="input"
        )
    text = raw.get("text")
    if text is not None and not isinstance(text, str):
        raise InvalidRequest("input.text must be a string", param="input.text")
    image = raw.get("image_url")
    if image is not None and (not isinstance(image, str) or not _IMAGE_URL.match(image)):
        raise InvalidRequest(
            "input.image_url must be an http(s) URL or a data:image/...;base64 URL",
            param="input.image_url",
        )
    if image is None and (text is None or not text.strip()):
        raise EmptyText("input.text is empty; send the text to decide about", param="input.text")
    return DecideInput(text=text if text and text.strip() else None, image_url=image)


def _parse_decision(raw: Any, i: int) -> Decision:
    where = f"decisions.{i}"
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    did = _check_id(raw.get("id"), f"{where}.id")
    question = raw.get("question")
    if not isinstance(question, str) or not question.strip():
        raise InvalidRequest(
            f"{where}.question must be a non-empty string", param=f"{where}.question"
        )
    outcomes_raw = raw.get("outcomes")
    if not isinstance(outcomes_raw, list):
        raise TooFewOutcomes(
            f"decision {did!r} needs a list of at least two outcomes", param=f"{where}.outcomes"
        )
    if len(outcomes_raw) < 2:
        raise TooFewOutcomes(
            f"decision {did!r} has {len(outcomes_raw)} outcome(s); it needs at least two",
            param=f"{where}.outcomes",
        )
    outcomes: list[Outcome] = []
    seen: set[str] = set()
    for j, o in enumerate(outcomes_raw):
        param = f"{where}.outcomes.{j}"
        if not isinstance(o, dict):
            raise InvalidRequest(f"{param} must be an object with an id", param=param)
        oid = _check_id(o.get("id"), f"{param}.id")
        if oid in seen:
            raise DuplicateId(f"decision {did!r} lists outcome {oid!r} twice", param=f"{param}.id")
        seen.add(oid)
        outcomes.append(Outcome(oid, _optional_str(o.get("description"), f"{param}.description")))
    return Decision(did, question.strip(), tuple(outcomes))


def parse_request(raw: Mapping[str, Any]) -> DecideRequest:
    """The decide body, checked; every rule a 400 with its own code, before anything runs."""
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string", param="model")
    if "input" not in raw:
        raise InvalidRequest('input is required: {"text": "..."}', param="input")
    inp = _parse_input(raw["input"])
    decisions_raw = raw.get("decisions")
    if decisions_raw is not None and not isinstance(decisions_raw, list):
        raise InvalidRequest("decisions must be a list", param="decisions")
    if not decisions_raw:
        raise NoDecisions("decisions is empty; ask at least one question", param="decisions")
    decisions: list[Decision] = []
    ids: set[str] = set()
    for i, d in enumerate(decisions_raw):
        decision = _parse_decision(d, i)
        if decision.id in ids:
            raise DuplicateId(
                f"decision id {decision.id!r} is used twice", param=f"decisions.{i}.id"
            )
        ids.add(decision.id)
        decisions.append(decision)
    max_out = raw.get("max_output_tokens")
    if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int)):
        raise InvalidRequest(
            "max_output_tokens must be an integer",
            param="max_output_tokens",
            code="max_output_tokens_out_of_range",
        )
    fallback = raw.get("fallback", "base")
    if fallback not in ("base", "none"):
        raise InvalidRequest('fallback must be "base" or "none"', param="fallback")
    calibration = raw.get("calibration", "batch")
    if calibration not in CALIBRATIONS:
        raise InvalidRequest(
            'calibration must be "batch", "content_free" or "none"', param="calibration"
        )
    return DecideRequest(model, inp, tuple(decisions), max_out, fallback, calibration)


# -- the prompt ---------------------------------------------------------------


def _questions(decisions: Sequence[Decision]) -> str:
    lines: list[str] = []
    for d in decisions:
        lines.append(f"{d.id}: {d.question}")
        for o in d.outcomes:
            lines.append(f"  - {o.id}: {o.description}" if o.description else f"  - {o.id}")
    return "\n".join(lines)


def _instructions(decisions: Sequence[Decision], fmt: AnswerFormat) -> str:
    if fmt == "json":
        return (
            "Reply with a JSON object that maps each question id to the id of its answer, "
            "and nothing else."
        )
    example = "\n".join(f"{d.id}: <answer id>" for d in decisions)
    return f"Reply with one line per question, in this order and nothing else:\n{example}"


def build_messages(request: DecideRequest, fmt: AnswerFormat) -> list[dict[str, Any]]:
    """The one prompt: everything that does not depend on the text, then the text, last.

    The system prompt, the questions with their outcomes and the answer format
    are the same for every text of a decision set (docs/reference/decide.md asks
    callers to keep them so), and nothing before the text varies per text: an
    engine that keeps the prompt prefix it has read (the embedded one, or
    llama.cpp's server with ``cache_prompt``) reads them once per set, and a
    provider's prompt cache serves them at its cached-input price. Each text then
    costs its own tokens and the few that close the user's turn, and the reply
    (or the scored candidates) follows the text directly. An image goes last for
    the same reason, after one fixed line that says the questions are about it.
    """
    parts: list[str] = [
        f"Questions:\n{_questions(request.decisions)}",
        _instructions(request.decisions, fmt),
    ]
    if request.input.text is not None:
        parts.append(f"Text:\n{request.input.text}")
    elif request.input.image_url is not None:
        parts.append("The questions are about the image.")
    prompt = "\n\n".join(parts)
    content: str | list[dict[str, Any]] = prompt
    if request.input.image_url is not None:
        content = [
            {"type": "text", "text": prompt},
            {"type": "image_url", "image_url": {"url": request.input.image_url}},
        ]
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": content},
    ]


def _line(decision: Decision, outcome_id: str) -> str:
    return f"{decision.id}: {outcome_id}"


def answer_text(decisions: Sequence[Decision], chosen: Sequence[str], fmt: AnswerFormat) -> str:
    """The reply that states ``chosen``, as the model would write it."""
    if fmt == "json":
        return json.dumps({d.id: c for d, c in zip(decisions, chosen, strict=True)})
    return "\n".join(_line(d, c) for d, c in zip(decisions, chosen, strict=True))


def needed_output_tokens(
    decisions: Sequence[Decision], fmt: AnswerFormat, count: Callable[[str], int]
) -> int:
    """Tokens of the longest possible answer: the least ``max_output_tokens`` that fits it."""
    if fmt == "json":
        worst = [max(d.outcome_ids, key=lambda o: count(json.dumps(o))) for d in decisions]
        return count(answer_text(decisions, worst, "json"))
    # One newline token between lines; counting lines apart bounds a joint count.
    return sum(max(count(_line(d, o)) for o in d.outcome_ids) + 1 for d in decisions)


def scoring_candidates(decisions: Sequence[Decision]) -> list[list[str]]:
    """Replies to score, per decision: each outcome's answer line, as the reply's opening.

    Every decision is asked on its own branch off the one prompt, independent
    of the other decisions' answers, so a scoring engine reads the prompt once
    and scores every candidate of every decision in one pass. The line's
    ``id: `` opening is shared by a decision's candidates and adds the same
    log-probability to each, so the softmax over them is the model's
    distribution over that decision's outcomes.
    """
    return [[_line(d, o) for o in d.outcome_ids] for d in decisions]


def softmax(scores: Sequence[float]) -> list[float]:
    peak = max(scores)
    weights = [math.exp(s - peak) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def response_format(decisions: Sequence[Decision]) -> dict[str, Any]:
    """OpenAI's ``json_schema`` format: one enum property per decision, all required."""
    schema = {
        "type": "object",
        "properties": {d.id: {"type": "string", "enum": list(d.outcome_ids)} for d in decisions},
        "required": [d.id for d in decisions],
        "additionalProperties": False,
    }
    return {
        "type": "json_schema",
        "json_schema": {"name": "decisions", "strict": True, "schema": schema},
    }


# -- reading the model's answer -------------------------------------------------


def _invalid(reason: str) -> ModelOutputInvalid:
    return ModelOutputInvalid(
        f"the model's answer could not be read ({reason}); nothing was charged"
    )


def parse_output(text: str, decisions: Sequence[Decision], fmt: AnswerFormat) -> list[str]:
    """The chosen outcome ids, in decision order; ``model_output_invalid`` otherwise."""
    found: dict[str, str] = {}
    if fmt == "json":
        try:
            data = json.loads(text)
        except ValueError:
            raise _invalid("not JSON") from None
        if not isinstance(data, dict):
            raise _invalid("not a JSON object")
        for key, value in data.items():
            if not isinstance(value, str):
                raise _invalid(f"the answer for {key!r} is not a string")
            found[str(key)] = value
    else:
        for raw_line in text.splitlines():
            line = raw_line.strip()
            if not line:
                continue
            key, sep, value = line.partition(":")
            if not sep:
                raise _invalid("a line is not `question_id: answer_id`")
            key = key.strip()
            if key in found:
                raise _invalid(f"{key!r} answered twice")
            found[key] = value.strip()
    expected = [d.id for d in decisions]
    unknown = sorted(set(found) - set(expected))
    if unknown:
        raise _invalid(f"unknown question {unknown[0]!r}")
    chosen: list[str] = []
    for d in decisions:
        if d.id not in found:
            raise _invalid(f"no answer for {d.id!r}")
        if found[d.id] not in d.outcome_ids:
            raise _invalid(f"the answer for {d.id!r} is not one of its outcomes")
        chosen.append(found[d.id])
    return chosen


def _value_offset(text: str, decision_id: str, fmt: AnswerFormat) -> int | None:
    if fmt == "json":
        key = re.escape(json.dumps(decision_id))
        m = re.search(key + r'\s*:\s*"', text)
    else:
        m = re.search(r"(?m)^[ \t]*" + re.escape(decision_id) + r"[ \t]*:[ \t]*", text)
    return m.end() if m else None


def _alternative_matches(outcome_id: str, rest: str, fmt: AnswerFormat) -> bool:
    """Whether a token that begins the answer, minus the lead, can begin ``outcome_id``."""
    end = '"' if fmt == "json" else "\n"
    if end in rest:
        return rest.split(end, 1)[0] == outcome_id
    return bool(rest) and outcome_id.startswith(rest)


def _decision_probabilities(
    text: str,
    tokens: Sequence[Mapping[str, Any]],
    starts: Sequence[int],
    decision: Decision,
    fmt: AnswerFormat,
) -> dict[str, float] | None:
    offset = _value_offset(text, decision.id, fmt)
    if offset is None:
        return None
    index = next(
        (i for i, s in enumerate(starts) if s <= offset < s + len(str(tokens[i]["token"]))), None
    )
    if index is None:
        return None
    alternatives = tokens[index].get("top_logprobs")
    if not isinstance(alternatives, list) or not alternatives:
        return None
    lead = text[starts[index] : offset]
    mass = dict.fromkeys(decision.outcome_ids, 0.0)
    for alt in alternatives:
        token, logprob = alt.get("token"), alt.get("logprob")
        if not isinstance(token, str) or not isinstance(logprob, int | float):
            return None
        if not token.startswith(lead):
            continue
        rest = token[len(lead) :]
        matches = [o for o in decision.outcome_ids if _alternative_matches(o, rest, fmt)]
        # A token that begins two outcomes says nothing about which one: skip it.
        if len(matches) == 1:
            mass[matches[0]] += math.exp(logprob)
    if any(m <= 0.0 for m in mass.values()):
        # An outcome outside the top alternatives: its share is unknown.
        return None
    total = sum(mass.values())
    return {o: m / total for o, m in mass.items()}


def logprob_probabilities(
    text: str,
    logprobs: Sequence[Mapping[str, Any]] | None,
    decisions: Sequence[Decision],
    fmt: AnswerFormat,
) -> list[dict[str, float] | None]:
    """Each decision's outcome probabilities from the answer token's ``top_logprobs``.

    The alternatives at the token where the answer begins are attributed to
    the outcomes they can begin and renormalised over the outcomes. Where the
    tokens don't spell the text, or an outcome is missing from the
    alternatives, that decision gets ``None``: its probabilities are omitted.
    """
    none: list[dict[str, float] | None] = [None] * len(decisions)
    if not logprobs:
        return none
    starts: list[int] = []
    pos = 0
    for tok in logprobs:
        piece = tok.get("token")
        if not isinstance(piece, str):
            return none
        starts.append(pos)
        pos += len(piece)
    if "".join(str(t["token"]) for t in logprobs) != text:
        return none
    return [_decision_probabilities(text, logprobs, starts, d, fmt) for d in decisions]


def answers_json(
    decisions: Sequence[Decision],
    chosen: Sequence[str],
    probabilities: Sequence[Mapping[str, float] | None],
    raw: Sequence[Mapping[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """Answers on the wire; ``raw`` (the uncalibrated probabilities) where calibration ran."""
    out: list[dict[str, Any]] = []
    raws: Sequence[Mapping[str, float] | None] = raw if raw is not None else [None] * len(chosen)
    for d, c, p, r in zip(decisions, chosen, probabilities, raws, strict=True):
        answer: dict[str, Any] = {"decision": d.id, "outcome": c}
        if p is not None:
            answer["probabilities"] = {o: round(p[o], 6) for o in d.outcome_ids}
        if r is not None:
            answer["raw_probabilities"] = {o: round(r[o], 6) for o in d.outcome_ids}
        out.append(answer)
    return out
