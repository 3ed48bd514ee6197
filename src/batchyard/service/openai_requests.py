"""The one seam that says whether a request body is valid for an OpenAI endpoint.

A batch input line (``{custom_id, method, url, body}``) is checked here,
body and all, before the file it belongs to is kept: ``validate_line`` takes
the endpoint and the body and returns the body as it will be stored and sent
(privacy applied), its model, its prompt tokens counted with the model's own
tokenizer, and the most output tokens it may be billed for. Anything wrong
is a coded ``InvalidRequest`` whose ``param`` names the field.

LEAD: the per-endpoint validators below (``_chat``, ``_completions``,
``_embeddings``) are this module's own, strict and small, written to the
rules ``api/chat.py``'s ``ChatBody`` applies today (the service layer may not
import the API). When issue 12's per-endpoint validation functions land, point
``VALIDATORS`` at them (keeping the privacy step and the token counting here)
and delete the three pydantic models. ``EXECUTABLE`` lists the endpoints
whose lines the dispatcher can answer today: chat completions only; issue 12
adds the engine calls for ``/v1/completions`` and ``/v1/embeddings``, and
``work.file_batches.lines`` is where their calls get wired.

Strictness, as issue 11 asks of every endpoint: no coercion (``"5"`` is not
a number), unknown fields refused, and OpenAI's documented fields that this
gateway cannot honour (penalties, logit bias, tools until issue 12) refused
by name rather than silently ignored; ``user``, ``metadata``, ``store`` and
``service_tier`` change nothing about an answer and are accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batchyard.core import privacy
from batchyard.core.catalog import Catalog, ModelSpec
from batchyard.core.tokens import TokenizerSource
from batchyard.errors import ContextWindowExceeded, InvalidRequest, UnsupportedInput

__all__ = [
    "ENDPOINTS",
    "EXECUTABLE",
    "VALIDATORS",
    "CheckedBody",
    "Rules",
    "validate_line",
]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
#: Endpoints a batch line may name.
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)
#: Endpoints whose lines the dispatcher answers today (see the module docstring).
EXECUTABLE = (CHAT,)

_TOOLS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")
_UNHONOURED = (
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "verbosity",
    "prompt_cache_key",
    "safety_identifier",
)


@dataclass(frozen=True, slots=True)
class Rules:
    """What the deployment decides about a line: its catalog, tokenizers and defaults."""

    catalog: Catalog
    tokenizers: TokenizerSource
    default_max_tokens: int = 256
    privacy_default: privacy.PrivacyMode = privacy.PrivacyMode.OFF


@dataclass(frozen=True, slots=True)
class CheckedBody:
    """A body that passed every check, as it will be stored and sent."""

    model: ModelSpec
    body: dict[str, Any]
    input_tokens: int
    max_output_tokens: int
    redactions: int


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Privacy(_Strict):
    mode: Literal["off", "redact", "reject"] = "off"


class _ChatLine(_Strict):
    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    privacy: _Privacy | None = None


class _CompletionLine(_Strict):
    model: str = Field(min_length=1)
    prompt: str | list[str]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    echo: Literal[False] = False
    best_of: Literal[1] = 1
    user: str | None = None
    privacy: _Privacy | None = None


class _EmbeddingLine(_Strict):
    model: str = Field(min_length=1)
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    privacy: _Privacy | None = None


def _invalid(exc: ValidationError) -> InvalidRequest:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return InvalidRequest(
            f"{loc} is not a field of this request", param=loc, code="unsupported_parameter"
        )
    return InvalidRequest(f"{loc}: {first.get('msg')}", param=loc or None)


def _refuse_unhonoured(body: dict[str, Any]) -> None:
    if body.get("stream") is True:
        raise InvalidRequest(
            "batch requests do not stream; send stream: false or leave it out",
            param="stream",
            code="streaming_unsupported",
        )
    for key in _TOOLS:
        if key in body:
            raise InvalidRequest(
                "tools are not supported in batch requests", param=key, code="tools_unsupported"
            )
    for key in _UNHONOURED:
        if key in body:
            raise InvalidRequest(
                f"{key} is an OpenAI field this gateway does not honour; leave it out",
                param=key,
                code="unsupported_parameter",
            )


def _model(rules: Rules, model_id: str) -> ModelSpec:
    model = rules.catalog.model(model_id)
    rules.catalog.route_for(model.id)
    return model


def _mode(given: _Privacy | None, rules: Rules) -> privacy.PrivacyMode:
    return privacy.PrivacyMode(given.mode) if given is not None else rules.privacy_default


def _private_texts(
    texts: list[str], mode: privacy.PrivacyMode, param: str
) -> tuple[list[str], int]:
    """Texts as they may be stored under ``mode`` (raises for a rejected one)."""
    messages = [{"role": "user", "content": t} for t in texts]
    if mode is privacy.PrivacyMode.REDACT:
        redacted, found = privacy.redact_messages(messages)
        return [str(m["content"]) for m in redacted], found
    if mode is privacy.PrivacyMode.REJECT:
        try:
            privacy.apply(privacy.PrivacyMode.REJECT, messages)
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, param=param, code=exc.code) from None
    return texts, 0


def _check_messages(messages: list[dict[str, Any]], model: ModelSpec) -> None:
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool" or "tool_calls" in m or "function_call" in m:
            raise InvalidRequest(
                "tools are not supported in batch requests",
                param=f"messages.{i}",
                code="tools_unsupported",
            )
        if role not in ("system", "developer", "user", "assistant"):
            raise InvalidRequest(
                f"messages[{i}].role is not a chat role", param=f"messages.{i}.role"
            )
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of parts",
                param=f"messages.{i}.content",
            )
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and model.reads_images:
                continue
            if kind != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedInput(
                    f"messages[{i}] has a content part this model cannot read ({kind!r})",
                    param=f"messages.{i}.content",
                )


def _max_tokens(given: int | None, rules: Rules, model: ModelSpec) -> int:
    mt = given if given is not None else min(rules.default_max_tokens, model.max_output_tokens)
    if mt > model.max_output_tokens:
        raise InvalidRequest(
            f"max_tokens is from 1 to {model.max_output_tokens} for {model.id}",
            param="max_tokens",
            code="max_tokens_out_of_range",
        )
    return mt


def _fits(model: ModelSpec, prompt_tokens: int, max_tokens: int, param: str) -> None:
    if prompt_tokens + max_tokens > model.context_window:
        raise ContextWindowExceeded(
            f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed the "
            f"{model.context_window}-token context window of {model.id}",
            param=param,
        )


def _chat(body: dict[str, Any], rules: Rules) -> CheckedBody:
    _refuse_unhonoured(body)
    try:
        req = _ChatLine.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    model = _model(rules, req.model)
    _check_messages(req.messages, model)
    mt = _max_tokens(req.max_completion_tokens or req.max_tokens, rules, model)
    mode = _mode(req.privacy, rules)
    messages, found = req.messages, 0
    if mode is privacy.PrivacyMode.REDACT:
        messages, found = privacy.redact_messages(messages)
    elif mode is privacy.PrivacyMode.REJECT:
        try:
            privacy.apply(privacy.PrivacyMode.REJECT, messages)
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, param="messages", code=exc.code) from None
    tokens = rules.tokenizers.for_model(model).count_messages(messages)
    _fits(model, tokens, mt, "messages")
    stored = {k: v for k, v in body.items() if k != "privacy"}
    stored["messages"] = messages
    return CheckedBody(model, stored, tokens, mt * req.n, found)


def _completions(body: dict[str, Any], rules: Rules) -> CheckedBody:
    _refuse_unhonoured(body)
    try:
        req = _CompletionLine.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    model = _model(rules, req.model)
    mt = _max_tokens(req.max_tokens, rules, model)
    prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    if not prompts:
        raise InvalidRequest("prompt must not be an empty list", param="prompt")
    prompts, found = _private_texts(prompts, _mode(req.privacy, rules), "prompt")
    tok = rules.tokenizers.for_model(model)
    counts = tok.count_batch(prompts)
    _fits(model, max(counts), mt, "prompt")
    stored = {k: v for k, v in body.items() if k != "privacy"}
    stored["prompt"] = prompts[0] if isinstance(req.prompt, str) else prompts
    return CheckedBody(model, stored, sum(counts), mt * req.n * len(prompts), found)


def _embeddings(body: dict[str, Any], rules: Rules) -> CheckedBody:
    try:
        req = _EmbeddingLine.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    model = _model(rules, req.model)
    inputs = [req.input] if isinstance(req.input, str) else list(req.input)
    if not inputs or not all(inputs):
        raise InvalidRequest("input must be a non-empty string or list of them", param="input")
    inputs, found = _private_texts(inputs, _mode(req.privacy, rules), "input")
    counts = rules.tokenizers.for_model(model).count_batch(inputs)
    if max(counts) > model.context_window:
        raise ContextWindowExceeded(
            f"an input of {max(counts)} tokens exceeds the {model.context_window}-token "
            f"context window of {model.id}",
            param="input",
        )
    stored = {k: v for k, v in body.items() if k != "privacy"}
    stored["input"] = inputs[0] if isinstance(req.input, str) else inputs
    return CheckedBody(model, stored, sum(counts), 0, found)


#: One validator per endpoint (LEAD: re-point at issue 12's; see the module docstring).
VALIDATORS: dict[str, Callable[[dict[str, Any], Rules], CheckedBody]] = {
    CHAT: _chat,
    COMPLETIONS: _completions,
    EMBEDDINGS: _embeddings,
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
