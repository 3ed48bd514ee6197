"""What a deferred batch submission may say, and the check of one (docs/reference/batches.md).

Every request is validated before privacy runs, and tokens are counted on the text that
will actually be stored and sent; nothing here writes (``service.deferred_batches``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from batchyard.core import privacy
from batchyard.core.inputs import AsDicts, Coded, Shape, strict
from batchyard.core.market import effective_min_discount
from batchyard.core.openai_bodies import ResponseFormat, TextPart
from batchyard.errors import InvalidRequest, InvalidType, UnsupportedInput
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
_ROLES = {"system", "developer", "user", "assistant"}
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


_TOP_KEYS = frozenset(BatchBody.model_fields)
_REQUEST_KEYS = frozenset(BatchRequestBody.model_fields)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """One request of a submission, checked; ``stored`` is what gets sealed."""

    custom_id: str
    model: str
    min_discount: Decimal
    input_tokens: int
    #: Once prepared, what the request says or the spec's default (0 until then: none given).
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
    try:
        d = Decimal(str(value))
    except InvalidOperation:
        raise _bad(
            f"{param} must be a number from 0 to 100", param, "invalid_min_discount"
        ) from None
    if not d.is_finite() or not Decimal(0) <= d <= Decimal(100):
        raise _bad(
            f"{param} is a percentage from 0 to 100, not {value}",
            param,
            "min_discount_out_of_range",
        )
    return d


def _check_messages(messages: Any, param: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad(f"{param} must be a non-empty list of chat messages", param, "invalid_request")
    for i, m in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where, "invalid_request")
        role = m.get("role")
        if role == "tool" or "tool_calls" in m or "function_call" in m:
            raise _bad("tools are not supported in deferred batches", where, "tools_unsupported")
        if not isinstance(role, str) or role not in _ROLES:
            raise _bad(f"{where}.role is not a chat role", f"{where}.role", "invalid_request")
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _bad(
                f"{where}.content must be a string or a list of text parts",
                f"{where}.content",
                "invalid_request",
            )
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise UnsupportedInput(
                    "deferred batches take text only; images, audio and files are not supported",
                    param=f"{where}.content",
                )
            if not isinstance(part.get("text"), str):
                raise _bad(
                    f"{where}.content has a text part without text", where, "invalid_request"
                )


def _parse_request(
    svc: Service, raw: Any, i: int, batch_min: Decimal, seen: set[str], org_id: str | None
) -> tuple[ParsedRequest, privacy.PrivacyMode]:
    where = f"requests[{i}]"
    if not isinstance(raw, dict):
        raise _bad(f"{where} must be an object", where, "invalid_request")
    for key in raw.keys() - _REQUEST_KEYS:
        raise _bad(
            f"{where}.{key} is not a request field", f"{where}.{key}", "unsupported_parameter"
        )
    cid = raw.get("custom_id")
    if not isinstance(cid, str) or not CUSTOM_ID.match(cid):
        raise _bad(
            f"{where}.custom_id must be 1-64 letters, digits, '_' or '-'",
            f"{where}.custom_id",
            "invalid_custom_id",
        )
    if cid in seen:
        raise _bad(
            f"custom_id {cid!r} appears more than once", f"{where}.custom_id", "duplicate_custom_id"
        )
    seen.add(cid)
    own = raw.get("min_discount")
    min_discount = batch_min
    if own is not None:
        own_d = _discount(own, f"{where}.min_discount")
        if own_d < batch_min:
            raise _bad(
                f"{where}.min_discount {own} is below the batch's {batch_min}; a request may "
                "raise the minimum discount, never lower it",
                f"{where}.min_discount",
                "min_discount_below_batch",
            )
        min_discount = effective_min_discount(batch_min, own_d)
    body = raw.get("body")
    bp = f"{where}.body"
    if not isinstance(body, dict):
        raise _bad(f"{bp} must be a chat completion request object", bp, "invalid_request")
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
    _check_messages(body.get("messages"), f"{bp}.messages")
    # The fields and their types, strictly (nothing coerced; an unknown one refused by name).
    req = strict(ChatRequestBody, body, prefix=bp)
    # Served here at all, before privacy reads any request; its limits are the preparation's.
    model = svc.catalog.model(req.model, org_id)
    svc.catalog.route_for(model.id)
    mt = req.max_completion_tokens or req.max_tokens
    options = req.model_dump(include=_OPTIONS, exclude_none=True)
    if isinstance(req.stop, str):
        options["stop"] = [req.stop]
    mode = privacy.PrivacyMode(req.privacy.mode if req.privacy is not None else "off")
    stored = {"messages": body["messages"], **options}
    return ParsedRequest(cid, model.id, min_discount, 0, mt or 0, stored), mode


def parse_submission(svc: Service, raw: dict[str, Any], org_id: str | None = None) -> Submission:
    """The whole submission checked, privacy applied and tokens counted; nothing is kept.

    ``org_id`` is the submitter's: only its own project model versions are found.
    """
    for key in raw.keys() - _TOP_KEYS:
        raise _bad(f"{key} is not a batch field", key, "unsupported_parameter")
    if raw.get("min_discount") is None:
        raise _bad(
            "min_discount is required (a percentage from 0 to 100)",
            "min_discount",
            "min_discount_required",
        )
    batch_min = _discount(raw["min_discount"], "min_discount")
    window = raw.get("completion_window")
    window = "24h" if window is None else window
    if not isinstance(window, str):
        raise InvalidType("completion_window must be a string", param="completion_window")
    if window not in WINDOWS:
        raise _bad(
            "completion_window is 1h, 6h or 24h", "completion_window", "invalid_completion_window"
        )
    reqs = raw.get("requests")
    if not isinstance(reqs, list):
        raise _bad("requests must be a list of 1 to 50 requests", "requests", "invalid_request")
    if not reqs:
        raise _bad("a batch needs at least one request", "requests", "no_requests")
    if len(reqs) > MAX_REQUESTS:
        raise _bad(
            f"a batch holds at most {MAX_REQUESTS} requests, not {len(reqs)}",
            "requests",
            "too_many_requests",
        )
    seen: set[str] = set()
    parsed = [_parse_request(svc, r, i, batch_min, seen, org_id) for i, r in enumerate(reqs)]
    # Everything is valid; only now does privacy run, then each request is prepared
    # (``service.preparation``: tokens counted on the text that will actually be stored
    # and sent, the spec's default max_tokens, the context window).
    out: list[ParsedRequest] = []
    redactions = 0
    for i, (req, mode) in enumerate(parsed):
        where, at = f"requests[{i}]: ", f"requests[{i}].body."
        messages, found = private_messages(req.stored["messages"], mode, f"{at}messages", where)
        redactions += found
        call = svc.preparer.deferred(
            req.model, messages, req.max_tokens or None, org_id=org_id, where=where, at=at
        )
        stored = {**req.stored, "messages": messages}
        tokens = call.input_tokens
        out.append(replace(req, input_tokens=tokens, max_tokens=call.max_tokens, stored=stored))
    return Submission(batch_min, window, out, redactions)
