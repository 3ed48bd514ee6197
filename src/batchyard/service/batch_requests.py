"""What a deferred batch submission may say, and the check of one (docs/reference/batches.md).

Every request is validated before privacy runs, and tokens are counted on the text that
will actually be stored and sent; nothing here writes (``service.deferred_batches``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from batchyard.core import privacy
from batchyard.core.inputs import AsDicts, Coded, Shape, field, strict
from batchyard.core.market import effective_min_discount
from batchyard.core.openai_bodies import ResponseFormat, TextPart
from batchyard.errors import BatchyardError, InvalidRequest, InvalidType, UnsupportedInput
from batchyard.service.deployment import Service
from batchyard.service.openai_requests import PrivacyBody, private_messages

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_REQUESTS",
    "WINDOWS",
    "BatchBody",
    "BatchRequestBody",
    "ChatRequestBody",
    "ParsedRequest",
    "Submission",
    "parse_submission",
]

MAX_BODY_BYTES = 1_000_000
MAX_REQUESTS = 50
MAX_OUTPUT_TOKENS = 4096
WINDOWS = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(hours=24)}
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

_TOOL_KEYS = {"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"}
#: The sampling options a deferred request keeps, as given.
_OPTIONS = {"temperature", "top_p", "stop", "seed", "response_format"}


class TextMessage(Shape):
    """A deferred request's message: text only, no tools."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


_MaxTokens = Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS), Coded("max_tokens_out_of_range")]
_Percent = Annotated[float, Field(ge=0, le=100), Coded("min_discount_out_of_range")]


class ChatRequestBody(Shape):
    """The ``body`` of one deferred request: the chat completion fields a batch may carry."""

    unknown_code: ClassVar[str] = "unsupported_parameter"

    model: str = Field(min_length=1)
    messages: Annotated[list[dict[str, Any]], AsDicts(list[TextMessage]), Field(min_length=1)]
    max_tokens: _MaxTokens | None = None
    max_completion_tokens: _MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    response_format: Annotated[dict[str, Any], AsDicts(ResponseFormat)] | None = None
    privacy: PrivacyBody | None = None
    n: (
        Annotated[Literal[1], Coded("unsupported_parameter", "deferred batches take n = 1")] | None
    ) = None
    stream: Literal[False] | None = None
    user: str | None = None


class BatchRequestBody(Shape):
    """One entry of ``requests``."""

    unknown_code: ClassVar[str] = "unsupported_parameter"

    custom_id: Annotated[str, Field(pattern=CUSTOM_ID.pattern), Coded("invalid_custom_id")]
    body: ChatRequestBody
    min_discount: _Percent | None = None


class BatchBody(Shape):
    """``POST /v1/batches``: the shape; what no shape says (one custom_id each, the
    model's own limits, privacy) is ``parse_submission``'s."""

    unknown_code: ClassVar[str] = "unsupported_parameter"

    min_discount: _Percent
    completion_window: (
        Annotated[Literal["1h", "6h", "24h"], Coded("invalid_completion_window")] | None
    ) = None
    requests: Annotated[list[BatchRequestBody], Field(min_length=1, max_length=MAX_REQUESTS)]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """One request of a submission, checked; ``stored`` is what gets sealed."""

    custom_id: str
    model: str
    min_discount: Decimal
    input_tokens: int
    #: What the request says, or the spec's default.
    max_tokens: int
    stored: dict[str, Any]  # what is sealed: redacted messages and sampling options


@dataclass(frozen=True, slots=True)
class Submission:
    """A whole submission that passed every check, ready to be sealed and kept."""

    min_discount: Decimal
    window: str
    requests: list[ParsedRequest]
    redactions: int


def _bad(message: str, param: str, code: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def _discount(value: Any, param: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{param} must be a number from 0 to 100", param, "invalid_min_discount")
    d = Decimal(str(value))  # any int's or float's text is a Decimal's (nan, inf included)
    if not d.is_finite() or not Decimal(0) <= d <= Decimal(100):
        raise _bad(
            f"{param} is a percentage from 0 to 100, not {value}",
            param,
            "min_discount_out_of_range",
        )
    return d


def _request(raw: Any, where: str, batch_min: Decimal, seen: set[str]) -> Decimal:
    """What a request's shape cannot say, or says with another code: its custom_id given
    once, a discount never below the batch's, and what deferred batches refuse by name
    (streaming, tools, anything but text). The request's least discount."""
    if not isinstance(raw, dict):
        return batch_min  # the shape says what is wrong
    cid = raw.get("custom_id")
    if isinstance(cid, str) and cid in seen:
        raise _bad(
            f"custom_id {cid!r} appears more than once", f"{where}.custom_id", "duplicate_custom_id"
        )
    if isinstance(cid, str):
        seen.add(cid)
    own, least = raw.get("min_discount"), batch_min
    if own is not None:
        least = _discount(own, f"{where}.min_discount")
        if least < batch_min:
            raise _bad(
                f"{where}.min_discount {own} is below the batch's {batch_min}; a request may "
                "raise the minimum discount, never lower it",
                f"{where}.min_discount",
                "min_discount_below_batch",
            )
    body, bp = raw.get("body"), f"{where}.body"
    if not isinstance(body, dict):
        return effective_min_discount(batch_min, least)
    if body.get("stream"):
        raise _bad(
            "deferred batches do not stream; send stream: false",
            f"{bp}.stream",
            "streaming_unsupported",
        )
    if _TOOL_KEYS & body.keys():
        raise _bad(
            "tools are not supported in deferred batches", f"{bp}.tools", "tools_unsupported"
        )
    if "modalities" in body or "audio" in body:
        raise UnsupportedInput("deferred batches take and give text only", param=f"{bp}.modalities")
    messages = body.get("messages")
    for j, m in enumerate(messages if isinstance(messages, list) else []):
        at, m = f"{bp}.messages[{j}]", m if isinstance(m, dict) else {}
        if m.get("role") == "tool" or "tool_calls" in m or "function_call" in m:
            raise _bad("tools are not supported in deferred batches", at, "tools_unsupported")
        content = m.get("content")
        if isinstance(content, list) and any(
            not (isinstance(part, dict) and part.get("type") == "text") for part in content
        ):
            raise UnsupportedInput(
                "deferred batches take text only; images, audio and files are not supported",
                param=f"{at}.content",
            )
    return effective_min_discount(batch_min, least)


def _shaped(raw: dict[str, Any]) -> BatchBody:
    """``raw`` as its shape, an error naming a request's fields as this door does
    (``requests[3].body.messages[0]``)."""
    try:
        return strict(BatchBody, raw)
    except BatchyardError as exc:
        param = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", exc.param or "") or None
        message = exc.message.replace(exc.param, param) if exc.param and param else exc.message
        raise type(exc)(
            message, param=param, code=exc.code, details=exc.details, status=exc.status
        ) from None


def parse_submission(svc: Service, raw: dict[str, Any], org_id: str | None = None) -> Submission:
    """The whole submission checked, privacy applied and tokens counted; nothing is kept.

    ``org_id`` is the submitter's: only its own project model versions are found.
    """
    if raw.get("min_discount") is None:
        raise _bad(
            "min_discount is required (a percentage from 0 to 100)",
            "min_discount",
            "min_discount_required",
        )
    batch_min = _discount(raw["min_discount"], "min_discount")
    window = raw.get("completion_window")
    if window is not None and not isinstance(window, str):
        raise InvalidType("completion_window must be a string", param="completion_window")
    reqs = raw.get("requests")
    if isinstance(reqs, list) and not reqs:
        raise _bad("a batch needs at least one request", "requests", "no_requests")
    if isinstance(reqs, list) and len(reqs) > MAX_REQUESTS:
        raise _bad(
            f"a batch holds at most {MAX_REQUESTS} requests, not {len(reqs)}",
            "requests",
            "too_many_requests",
        )
    seen: set[str] = set()
    reqs = reqs if isinstance(reqs, list) else []
    svc.preparer.served(
        ((f"requests[{i}].body", field(r, "body", "model")) for i, r in enumerate(reqs)), org_id
    )
    least = [_request(r, f"requests[{i}]", batch_min, seen) for i, r in enumerate(reqs)]
    shaped = _shaped(raw)
    # Each model served here, before privacy reads any request; its limits are the preparation's.
    models = [svc.catalog.model(r.body.model, org_id).id for r in shaped.requests]
    for model in models:
        svc.catalog.route_for(model)
    # Everything is valid; only now does privacy run, then each request is prepared
    # (``service.preparation``: tokens counted on the text that will actually be stored
    # and sent, the spec's default max_tokens, the context window).
    out: list[ParsedRequest] = []
    redactions = 0
    for i, (r, given, model) in enumerate(zip(shaped.requests, reqs, models, strict=True)):
        req, where, at = r.body, f"requests[{i}]: ", f"requests[{i}].body."
        mode = privacy.PrivacyMode(req.privacy.mode if req.privacy is not None else "off")
        messages, found = private_messages(given["body"]["messages"], mode, f"{at}messages", where)
        redactions += found
        asked = req.max_completion_tokens or req.max_tokens
        call = svc.preparer.deferred(model, messages, asked, org_id=org_id, where=where, at=at)
        options = req.model_dump(include=_OPTIONS, exclude_none=True)
        if isinstance(req.stop, str):
            options["stop"] = [req.stop]
        stored = {"messages": messages, **options}
        tokens = (call.input_tokens, call.max_tokens)
        out.append(ParsedRequest(r.custom_id, model, least[i], *tokens, stored))
    return Submission(batch_min, shaped.completion_window or "24h", out, redactions)
