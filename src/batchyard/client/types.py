"""The wire shapes, as TypedDicts: answers are plain dicts, typed for the reader.

Plain dicts rather than classes so a field the server adds later reaches the
caller untouched, and so the client needs no validation library.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "Account",
    "Answer",
    "AutoTopUp",
    "Batch",
    "BatchRequest",
    "BatchResultLine",
    "Calibration",
    "ChatCompletion",
    "Credit",
    "DecideInput",
    "DecideResponse",
    "Decision",
    "EffectiveLimits",
    "EstimateResponse",
    "Fallback",
    "KeepWarm",
    "Model",
    "ModelList",
    "Organization",
    "Outcome",
    "Pricing",
    "Usage",
    "Warmth",
]


class Outcome(TypedDict):
    id: str
    description: NotRequired[str]


class Decision(TypedDict):
    id: str
    question: str
    outcomes: list[Outcome]


class DecideInput(TypedDict, total=False):
    text: str
    image_url: str


class Answer(TypedDict):
    decision: str
    outcome: str
    probabilities: NotRequired[dict[str, float]]
    # The model's own probabilities before calibration, where the server calibrated.
    raw_probabilities: NotRequired[dict[str, float]]


class Usage(TypedDict):
    input_tokens: int
    output_tokens: int
    #: Of ``input_tokens``, those the model read from its prompt cache.
    cached_input_tokens: NotRequired[int]
    calibration_input_tokens: NotRequired[int]


class Calibration(TypedDict):
    mode: str
    orders: int
    texts: int
    content_free_estimated: bool


class Fallback(TypedDict):
    reason: str
    model: str


class DecideResponse(TypedDict):
    id: str
    model: str
    answers: list[Answer]
    usage: Usage
    charge: str
    fallback: Fallback | None
    calibration: NotRequired[Calibration | None]


class EstimateResponse(TypedDict):
    input_tokens: int
    max_output_tokens: int
    max_cost: str
    calibration_input_tokens: NotRequired[int]


class Organization(TypedDict):
    id: str
    name: str


class Credit(TypedDict):
    balance: str
    held: str
    available: str


class EffectiveLimits(TypedDict, total=False):
    requests_per_minute: int
    tokens_per_minute: int
    estimate_tokens_per_minute: int
    #: Requests the organisation may have in flight at once (all keys together).
    concurrency: int


class AutoTopUp(TypedDict):
    threshold: str
    amount: str


class Account(TypedDict):
    organization: Organization
    tier: int
    credit: Credit
    effective_limits: EffectiveLimits
    zero_data_retention: bool
    auto_top_up: NotRequired[AutoTopUp | None]


class Pricing(TypedDict):
    input_per_mtok: str
    output_per_mtok: str


class Warmth(TypedDict):
    """A fine-tuned version's load state; ``until`` is when it goes cold if unused."""

    state: Literal["cold", "loading", "warm"]
    until: str | None
    last_load_seconds: float | None


class Model(TypedDict):
    id: str
    object: NotRequired[Literal["model"]]
    type: Literal["base", "version"]
    base_model: str | None
    modality: list[str]
    context_window: int
    max_output_tokens: NotRequired[int]
    pricing: Pricing
    available: bool
    #: None for base models, which are always served.
    warm: Warmth | None
    description: NotRequired[str | None]
    created: NotRequired[int]
    owned_by: NotRequired[str]
    #: What the model's route can do: chat, tools, vision, streaming, completions, ...
    capabilities: NotRequired[dict[str, bool]]
    #: Calls its route runs at once, where it has such a bound (the embedded model).
    concurrency: NotRequired[int | None]


class KeepWarm(TypedDict):
    id: str
    object: Literal["model"]
    warm: Warmth


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[Model]


class ChatCompletion(TypedDict, total=False):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]
    charge: str


class BatchRequest(TypedDict):
    custom_id: str
    body: dict[str, Any]
    min_discount: NotRequired[float]


class Batch(TypedDict, total=False):
    id: str
    status: str
    min_discount: float
    completion_window: str
    deadline: str
    requests: list[dict[str, Any]]
    results_url: str


class BatchResultLine(TypedDict, total=False):
    custom_id: str
    status: str
    result: dict[str, Any] | None
