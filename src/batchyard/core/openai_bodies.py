"""The bodies of the OpenAI-compatible endpoints, checked strictly, one function each.

``parse_chat``, ``parse_completion`` and ``parse_embedding`` take a decoded
JSON object and return a typed request or raise a coded 400; they touch no
service, so a line of an OpenAI batch file can be checked by the same code
as a request on the wire, and ``check_images`` refuses an image for a
text-only model on both. ``work.openai_wire`` turns the typed request into the
engines' request and renders the answer.

Strict means what OpenAI documents and nothing else: every documented field
is accepted (those that change nothing here, such as ``user`` or ``store``, are
accepted and ignored; those that would change the answer in a way no engine
here can honour, such as audio output, are refused with a code), an unknown
field is ``unknown_field`` naming it, and no value is coerced: ``"1"`` is not
a number and ``1`` is not a boolean. A ``null`` optional field means its
default, as on OpenAI's API (LiteLLM sends ``"encoding_format": null``); a
required one (``model``, ``messages``, ``input``) is still refused as null.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from batchyard.core.catalog import ModelSpec
from batchyard.errors import CapabilityUnsupported, InvalidRequest, UnknownField, UnsupportedInput

__all__ = [
    "ChatRequest",
    "CompletionTextRequest",
    "EmbeddingRequest",
    "StreamOptions",
    "check_images",
    "parse_chat",
    "parse_completion",
    "parse_embedding",
    "validated",
    "validation_error",
]

_STRICT = ConfigDict(extra="forbid", strict=True)


class _Body(BaseModel):
    """A body of OpenAI's API: strict, and an optional field sent as ``null`` is its default."""

    model_config = _STRICT

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required()
        }


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Common(_Body):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return stops or None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``, as OpenAI documents it."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Accepted and ignored: they change no answer this gateway gives.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    # Documented, but nothing here can honour them: refused with a code.
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools or []]


class CompletionTextRequest(_Common):
    """``POST /v1/completions`` (the legacy text completions)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=16)
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or as token ids (read by the door, ``engines.token_ids``)."""
        return _items(self.prompt, "prompt")


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``."""

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input, as text or as token ids (read by the door, ``engines.token_ids``)."""
        return _items(self.input, "input")


_Given = str | list[str] | list[int] | list[list[int]]


def _items(given: _Given, param: str) -> list[str | list[int]]:
    """OpenAI's four shapes of ``input``/``prompt`` as one list.

    A text, texts, one token-id array, or several; none of them empty.
    """
    if isinstance(given, str):
        items: list[str | list[int]] = [given]
    elif given and all(isinstance(i, int) for i in given):
        items = [[i for i in given if isinstance(i, int)]]
    else:
        items = [i for i in given if not isinstance(i, int)]
    if not items:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    for n, item in enumerate(items):
        if isinstance(item, str) and not item and param == "input":
            raise InvalidRequest(f"{param} must not hold an empty string", param=param)
        if isinstance(item, list) and not item:
            raise InvalidRequest(f"{param}.{n} is an empty token-id array", param=param)
        if isinstance(item, list) and any(t < 0 for t in item):
            raise InvalidRequest(f"{param}.{n}: token ids are not negative", param=param)
    return items


_Model = TypeVar("_Model", bound=BaseModel)


def validated(cls: type[_Model], raw: dict[str, Any]) -> _Model:
    """``raw`` read strictly as ``cls``; its first problem a coded 400 naming the field."""
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> InvalidRequest:
    """The first problem pydantic found, as a coded 400 that names the field."""
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return UnknownField(f"unknown field {loc!r}; see the endpoint's reference", param=loc)
    return InvalidRequest(f"{loc}: {first.get('msg')}", param=loc or None)


# -- messages, tools and formats ----------------------------------------------------

_MESSAGE_FIELDS: dict[str, frozenset[str]] = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset(
        {"role", "content", "name", "tool_calls", "refusal", "function_call", "audio"}
    ),
    "tool": frozenset({"role", "content", "tool_call_id"}),
    "function": frozenset({"role", "content", "name"}),
}
_PART_TYPES = frozenset({"text", "image_url", "input_audio", "file", "refusal"})


def _check_content(i: int, content: Any, role: str) -> None:
    where = f"messages.{i}.content"
    if content is None:
        if role != "assistant":
            raise InvalidRequest(f"{where} is required for a {role} message", param=where)
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts", param=where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_TYPES:
            raise InvalidRequest(
                f"{where}.{j} is a content part of unknown type {kind!r}", param=f"{where}.{j}"
            )
        if kind == "text" and not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.{j}.text must be a string", param=f"{where}.{j}.text")
        if kind in ("input_audio", "file"):
            raise CapabilityUnsupported(
                f"{where}.{j}: {kind} parts are not supported here", param=f"{where}.{j}"
            )


def _check_tool_calls(i: int, calls: Any) -> None:
    where = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list", param=where)
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("id"), str)
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise InvalidRequest(
                f"{where}.{j} must be {{id, type: function, function: {{name, arguments}}}} "
                "with arguments as a JSON string",
                param=f"{where}.{j}",
            )


def check_messages(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages.{i} must be an object", param=f"messages.{i}")
        role = m.get("role")
        allowed = _MESSAGE_FIELDS.get(role) if isinstance(role, str) else None
        if allowed is None or not isinstance(role, str):
            raise InvalidRequest(
                f"messages.{i}.role is not a chat role", param=f"messages.{i}.role"
            )
        for name in m:
            if name not in allowed:
                raise UnknownField(
                    f"unknown field {name!r} in a {role} message", param=f"messages.{i}.{name}"
                )
        _check_content(i, m.get("content"), role)
        if role == "assistant" and m.get("tool_calls") is not None:
            _check_tool_calls(i, m["tool_calls"])
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise InvalidRequest(
                f"messages.{i}.tool_call_id is required for a tool message",
                param=f"messages.{i}.tool_call_id",
            )


def _check_tools(req: ChatRequest) -> None:
    names: set[str] = set()
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise CapabilityUnsupported(
                f"tools.{i}: only tools of type function are supported", param=f"tools.{i}.type"
            )
        unknown = set(tool) - {"type", "function"}
        unknown_fn = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown or unknown_fn:
            name = sorted(unknown or unknown_fn)[0]
            where = f"tools.{i}." + ("" if unknown else "function.") + name
            raise UnknownField(f"unknown field {name!r} in a tool", param=where)
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise InvalidRequest(
                f"tools.{i}.function.name must be a non-empty name, each tool's its own",
                param=f"tools.{i}.function.name",
            )
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(
                f"tools.{i}.function.parameters must be a JSON schema object",
                param=f"tools.{i}.function.parameters",
            )
    choice = req.tool_choice
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                "tool_choice must be none, auto, required or a named function",
                param="tool_choice",
            )
        if choice == "required" and not names:
            raise InvalidRequest("tool_choice required needs tools", param="tool_choice")
        return
    fn = choice.get("function")
    wanted = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or wanted not in names:
        raise InvalidRequest(
            "tool_choice must name one of the request's tools as "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )


def _check_response_format(fmt: dict[str, Any] | None) -> None:
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InvalidRequest(
                "response_format.json_schema needs a name (and a schema)",
                param="response_format.json_schema",
            )
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be an object",
                param="response_format.json_schema.schema",
            )
        return
    raise InvalidRequest(
        "response_format.type must be text, json_object or json_schema",
        param="response_format.type",
    )


def parse_chat(raw: dict[str, Any]) -> ChatRequest:
    """A chat completions body, checked whole; raises a coded 400."""
    req = validated(ChatRequest, raw)
    check_messages(req.messages)
    _check_tools(req)
    _check_response_format(req.response_format)
    if isinstance(req.stop, list) and len(req.stop) > 4:
        raise InvalidRequest("stop takes at most 4 sequences", param="stop")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options needs stream: true", param="stream_options")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    unsupported = {
        "audio": req.audio is not None,
        "modalities": bool(req.modalities and set(req.modalities) - {"text"}),
        "prediction": req.prediction is not None,
        "web_search_options": req.web_search_options is not None,
        "functions": req.functions is not None,
        "function_call": req.function_call is not None,
    }
    for name, used in unsupported.items():
        if used:
            hint = "; use tools" if name.startswith("function") else ""
            raise CapabilityUnsupported(f"{name} is not supported here{hint}", param=name)
    return req


def parse_completion(raw: dict[str, Any]) -> CompletionTextRequest:
    """A text completions body, checked whole; raises a coded 400."""
    req = validated(CompletionTextRequest, raw)
    req.prompts()
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options needs stream: true", param="stream_options")
    if req.suffix:
        raise CapabilityUnsupported("suffix (insertion) is not supported here", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise CapabilityUnsupported("best_of other than n is not supported here", param="best_of")
    return req


def parse_embedding(raw: dict[str, Any]) -> EmbeddingRequest:
    """An embeddings body, checked whole; raises a coded 400."""
    req = validated(EmbeddingRequest, raw)
    req.inputs()
    return req


def check_images(messages: list[dict[str, Any]], model: ModelSpec) -> None:
    """Refuse image parts for a model that reads text only (a coded 400, nothing charged).

    Shared by the doors and the lines of a batch file, so a line is refused
    exactly when the same request on the wire would be.
    """
    if model.reads_images:
        return
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") == "image_url" for part in content
        ):
            raise UnsupportedInput(
                f"messages[{i}] has an image, which {model.id} cannot read; "
                "GET /v1/models lists the models that read images",
                param=f"messages.{i}.content",
            )
