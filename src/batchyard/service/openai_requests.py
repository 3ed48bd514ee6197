"""Whether a request body is valid for an OpenAI endpoint, in a batch: the one seam.

A batch line's body is checked by the wire's own function (``core.openai_bodies``) and
prepared by the door's own preparation, so it is accepted exactly when the same body sent
to the endpoint would be; what a batch adds and takes away is batchyard's ``privacy``
field, no streaming, and the sampling penalties refused by name rather than dropped,
since a worker later sends only what is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from batchyard.core import privacy
from batchyard.core.anthropic_bodies import parse_messages, translate
from batchyard.core.catalog import ModelSpec
from batchyard.core.inputs import Coded, Shape, strict
from batchyard.core.openai_bodies import parse_chat, parse_completion, parse_embedding
from batchyard.engines.token_ids import as_texts
from batchyard.errors import InvalidRequest
from batchyard.service.preparation import Preparer
from batchyard.work.openai_wire import CHAT, COMPLETIONS, EMBEDDINGS, ENDPOINTS, MESSAGES

__all__ = [
    "ENDPOINTS",
    "MESSAGES",
    "VALIDATORS",
    "CheckedBody",
    "PrivacyBody",
    "Rules",
    "private_messages",
    "validate_line",
]


@dataclass(frozen=True, slots=True)
class Rules:
    """What the deployment decides about a line: how it prepares calls, and its privacy default."""

    preparer: Preparer
    privacy_default: privacy.PrivacyMode = privacy.PrivacyMode.OFF
    #: Whose project model versions a line may name (None: any, a worker re-reading).
    org_id: str | None = None


@dataclass(frozen=True, slots=True)
class CheckedBody:
    """A body that passed every check, as it will be stored and sent."""

    model: ModelSpec
    body: dict[str, Any]
    input_tokens: int
    max_output_tokens: int
    redactions: int


class PrivacyBody(Shape):
    """batchyard's ``privacy`` field of a request it keeps (a batch line, a deferred request)."""

    mode: Annotated[Literal["off", "redact", "reject"], Coded("invalid_privacy_mode")] = "off"


#: OpenAI fields the wire accepts that a batch line may not carry, and why.
_NOT_IN_BATCHES = {
    "stream": (
        "batch requests do not stream; send stream: false or leave it out",
        "streaming_unsupported",
    ),
    "stream_options": ("batch requests do not stream", "streaming_unsupported"),
    **{
        name: (f"{name} is not honoured in batch requests", "unsupported_parameter")
        for name in ("frequency_penalty", "presence_penalty", "logit_bias")
    },
}


def _split(body: dict[str, Any], rules: Rules) -> tuple[dict[str, Any], privacy.PrivacyMode]:
    """The body without batchyard's ``privacy`` field, and the privacy mode it asks for."""
    rest = dict(body)
    raw = rest.pop("privacy", None)
    if raw is None:
        return rest, rules.privacy_default
    return rest, privacy.PrivacyMode(strict(PrivacyBody, raw, prefix="privacy").mode)


def _batchable(body: dict[str, Any]) -> None:
    for name, (message, code) in _NOT_IN_BATCHES.items():
        if body.get(name) not in (None, False):
            raise InvalidRequest(message, param=name, code=code)


def private_messages(
    messages: list[dict[str, Any]],
    mode: privacy.PrivacyMode,
    param: str = "messages",
    where: str = "",
) -> tuple[list[dict[str, Any]], int]:
    """Messages as they may be stored under ``mode``, and how many findings were redacted.

    ``reject`` raises, naming ``param`` and the kinds found (never the text).
    """
    if mode is privacy.PrivacyMode.REDACT:
        return privacy.redact_messages(messages)
    if mode is privacy.PrivacyMode.REJECT:
        try:
            privacy.apply(privacy.PrivacyMode.REJECT, messages)
        except InvalidRequest as exc:
            raise InvalidRequest(where + exc.message, param=param, code=exc.code) from None
    return messages, 0


def _private_texts(
    rest: dict[str, Any], given: list[str | list[int]], mode: privacy.PrivacyMode, param: str
) -> tuple[list[str], int]:
    """A prompt's or an input's texts as they may be stored under ``mode`` (raises for a
    rejected one), stored in ``rest`` as given: one, or a list (token ids as their text)."""
    messages = [{"role": "user", "content": t} for t in as_texts(given, param)]
    kept, found = private_messages(messages, mode, param)
    texts = [str(m["content"]) for m in kept]
    one = isinstance(rest[param], str) or isinstance(rest[param][0], int)
    rest[param] = texts[0] if one else texts
    return texts, found


def _chat(body: dict[str, Any], rules: Rules) -> CheckedBody:
    rest, mode = _split(body, rules)
    req = parse_chat(rest)
    _batchable(rest)
    messages, found = private_messages(req.messages, mode)
    call = rules.preparer.chat(req.model_copy(update={"messages": messages}), org_id=rules.org_id)
    rest["messages"] = messages
    return CheckedBody(call.model, rest, call.input_tokens, call.output_tokens, found)


def _messages(body: dict[str, Any], rules: Rules) -> CheckedBody:
    """An Anthropic Messages body, stored as the translated request the door would send, so
    the worker answers it through the door's own request; privacy applies to what is stored."""
    rest, mode = _split(body, rules)
    req = parse_messages(rest)
    _batchable(rest)
    asked = translate(req)
    messages, found = private_messages(asked.messages, mode)
    stored = asked.model_copy(update={"messages": messages})
    call = rules.preparer.messages(stored, org_id=rules.org_id)
    body_out = stored.model_dump(exclude_none=True)
    return CheckedBody(call.model, body_out, call.input_tokens, call.output_tokens, found)


def _completions(body: dict[str, Any], rules: Rules) -> CheckedBody:
    rest, mode = _split(body, rules)
    req = parse_completion(rest)
    _batchable(rest)
    if len(req.prompts()) != 1:
        raise InvalidRequest("send one prompt per request line", param="prompt")
    prompts, found = _private_texts(rest, req.prompts(), mode, "prompt")
    call = rules.preparer.completion(req, prompts, org_id=rules.org_id)
    return CheckedBody(call.model, rest, call.input_tokens, call.output_tokens, found)


def _embeddings(body: dict[str, Any], rules: Rules) -> CheckedBody:
    rest, mode = _split(body, rules)
    req = parse_embedding(rest)
    inputs, found = _private_texts(rest, req.inputs(), mode, "input")
    call = rules.preparer.embeddings(req, inputs, org_id=rules.org_id)
    return CheckedBody(call.model, rest, call.input_tokens, 0, found)


#: One validator per endpoint.
VALIDATORS: dict[str, Callable[[dict[str, Any], Rules], CheckedBody]] = {
    CHAT: _chat,
    COMPLETIONS: _completions,
    EMBEDDINGS: _embeddings,
    MESSAGES: _messages,
}


def validate_line(endpoint: str, body: Any, rules: Rules) -> CheckedBody:
    """``body`` checked as a request to ``endpoint``; raises a coded ``InvalidRequest``."""
    validator = VALIDATORS.get(endpoint)
    if validator is None:
        raise InvalidRequest(
            f"{endpoint!r} is not a batch endpoint; use one of {', '.join(ENDPOINTS)}",
            param="url",
            code="unsupported_endpoint",
        )
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object", param="body")
    return validator(body, rules)
