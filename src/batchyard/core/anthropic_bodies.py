"""The bodies of Anthropic's Messages API, checked strictly and turned into OpenAI's shape.

``parse_messages`` and ``parse_count_tokens`` take a decoded JSON object and
return a typed request or raise a coded 400, as ``core.openai_bodies`` does for
OpenAI's endpoints: every field Anthropic documents is accepted (those that
change nothing here, such as ``metadata`` or ``service_tier``, are accepted and
ignored; those no engine here can honour, such as extended thinking or server
tools, are refused with ``capability_unsupported``), an unknown field is
``unknown_field`` naming it, and nothing is coerced.

The engines take one request shape, OpenAI's (``engines.protocol.CompletionRequest``),
so a Messages body is translated rather than answered by a second path:
``to_openai_messages`` writes the system prompt as a system message, content
blocks as content parts, ``tool_use`` blocks as an assistant's ``tool_calls``
and ``tool_result`` blocks as ``tool`` messages; ``to_openai_tools`` and
``to_openai_tool_choice`` do the same for the tools. The translation touches
no service, so a line of a Message Batch can be checked by the same code.
"""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from batchyard.core.inputs import AsDicts, Unserved
from batchyard.core.openai_bodies import validated
from batchyard.errors import CapabilityUnsupported, InvalidRequest, UnknownField

__all__ = [
    "ERROR_TYPES",
    "CountTokensRequest",
    "MessagesRequest",
    "Translated",
    "anthropic_version_ok",
    "message_object",
    "openai_prompt",
    "parse_count_tokens",
    "parse_messages",
    "stop_reason",
    "to_openai_messages",
    "to_openai_tool_choice",
    "to_openai_tools",
    "tool_id",
    "translate",
    "usage_object",
]


def anthropic_version_ok(version: str) -> bool:
    """Whether ``anthropic-version`` is well formed: a calendar date, ``YYYY-MM-DD``.

    Every well-formed version is answered in the newest shapes this door knows: a list
    of accepted dates breaks on the SDK's next release (the 2.x SDK sends a date no list
    written before it could hold), while the shapes a newer version adds are the ones a
    client of that version reads anyway.
    """
    if len(version) != 10 or version[4] != "-" or version[7] != "-":
        return False
    try:
        datetime.date.fromisoformat(version)
    except ValueError:
        return False
    return True


#: Anthropic's error ``type`` for each status, for its envelope (the wire and batch results).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}

_STRICT = ConfigDict(extra="forbid", strict=True)
_MEDIA_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


class _Strict(BaseModel):
    model_config = _STRICT


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(_Strict):
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(_Strict):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(_Block):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    transformations: Annotated[Any, Unserved()] = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = (
        None
    )
    is_error: bool | None = None
    toolset_name: str | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


#: The blocks of each turn; Anthropic's other blocks (documents, thinking, server tools)
#: are refused with ``capability_unsupported`` (``core.inputs.UNSERVED_TAGS``).
UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")]


class UserTurn(_Strict):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantTurn(_Strict):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


Turn = Annotated[UserTurn | AssistantTurn, Field(discriminator="role")]


class Tool(_Strict):
    """A client tool; Anthropic's server tools are refused with ``capability_unsupported``."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None
    # Hints for Anthropic's own tool runner: accepted, change nothing here.
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _server_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise PydanticCustomError(
                "unserved", "Anthropic's server tools are not offered here; define a client tool"
            )
        return data


class _Choice(_Strict):
    disable_parallel_tool_use: bool | None = None


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class NoneChoice(_Choice):
    type: Literal["none"]


class ToolChoice(_Choice):
    type: Literal["tool"]
    name: str


Choice = Annotated[AutoChoice | AnyChoice | NoneChoice | ToolChoice, Field(discriminator="type")]


class JsonOutputFormat(_Strict):
    """Structured outputs: the answer is JSON that validates against ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    #: How hard to think: accepted, changes nothing here (no extended thinking).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    task_budget: Annotated[Any, Unserved()] = None


class _Prompt(BaseModel):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` both take."""

    model_config = _STRICT

    model: str = Field(min_length=1)
    messages: Annotated[list[dict[str, Any]], AsDicts(list[Turn]), Field(min_length=1)]
    system: Annotated[str | list[dict[str, Any]], AsDicts(str | list[TextBlock])] | None = None
    tools: Annotated[list[dict[str, Any]], AsDicts(list[Tool])] | None = None
    tool_choice: Annotated[dict[str, Any], AsDicts(Choice)] | None = None
    output_config: OutputConfig | None = None
    #: The beta name of ``output_config.format`` (SDKs before structured outputs were GA).
    output_format: JsonOutputFormat | None = None
    # Accepted and ignored: they change no answer this gateway gives.
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    # Documented, but nothing here can honour them: refused with a code when set.
    thinking: Annotated[Any, Unserved((None, {"type": "disabled"}))] = None
    mcp_servers: Annotated[Any, Unserved((None, []))] = None
    context_management: Annotated[Any, Unserved()] = None
    compaction: Annotated[Any, Unserved()] = None
    inference_geo: Annotated[Any, Unserved()] = None
    diagnostics: Annotated[Any, Unserved()] = None
    billing_policy: Annotated[Any, Unserved()] = None

    def response_format(self) -> dict[str, Any] | None:
        """The JSON-schema constraint asked for, in OpenAI's ``response_format`` shape."""
        given = self.output_config.format if self.output_config is not None else None
        given = given or self.output_format
        if given is None:
            return None
        spec = {"name": "output", "schema": given.schema_, "strict": True}
        return {"type": "json_schema", "json_schema": spec}


class MessagesRequest(_Prompt):
    """``POST /v1/messages``, as Anthropic documents it (the newest SDK's fields)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = False
    # Accepted and ignored: they change no answer this gateway gives.
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Documented, refused when used (a container is Anthropic's code sandbox; a thread,
    # fallbacks and their credit belong to Anthropic's own service).
    container: Annotated[Any, Unserved()] = None
    thread: Annotated[Any, Unserved()] = None
    fallbacks: Annotated[Any, Unserved()] = None
    fallback_credit_token: Annotated[Any, Unserved()] = None


class CountTokensRequest(_Prompt):
    """``POST /v1/messages/count_tokens``: a prompt, never run."""


def _where(*parts: object) -> str:
    return ".".join(str(p) for p in parts)


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be a string", param=f"{where}.text")
    return text


def _known(block: dict[str, Any], where: str, allowed: set[str]) -> None:
    for name in block:
        if name not in allowed:
            raise UnknownField(
                f"unknown field {name!r} in a {block.get('type')} block", param=f"{where}.{name}"
            )


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic image block as OpenAI's ``image_url`` part (a data URL or a URL)."""
    _known(block, where, {"type", "source", "cache_control"})
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media, data = source.get("media_type"), source.get("data")
        if media not in _MEDIA_TYPES or not isinstance(data, str) or not data:
            raise InvalidRequest(
                f"{where}.source needs media_type (one of {', '.join(sorted(_MEDIA_TYPES))}) "
                "and base64 data",
                param=f"{where}.source",
            )
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise InvalidRequest(
        f"{where}.source must be {{type: base64, media_type, data}} or {{type: url, url}}",
        param=f"{where}.source",
    )


def _result_content(block: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    content = block.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content must be a string or a list of blocks", param=f"{where}.content"
        )
    parts: list[dict[str, Any]] = []
    for k, sub in enumerate(content):
        at = _where(where, "content", k)
        kind = sub.get("type") if isinstance(sub, dict) else None
        if kind == "text" and isinstance(sub, dict):
            _known(sub, at, {"type", "text", "cache_control", "citations"})
            parts.append({"type": "text", "text": _text_of(sub, at)})
        elif kind == "image" and isinstance(sub, dict):
            parts.append(_image_part(sub, at))
        else:
            raise InvalidRequest(
                f"{at} must be a text or image block inside a tool_result", param=at
            )
    return parts


_UNSUPPORTED_BLOCKS = frozenset(
    {
        "document",
        "search_result",
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "container_upload",
        "mcp_tool_use",
        "mcp_tool_result",
    }
)


def _blocks(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    content = message.get("content")
    where = _where("messages", i, "content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of blocks", param=where)
    out: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = _where(where, j)
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(block, dict) or not isinstance(kind, str):
            raise InvalidRequest(f"{at} must be a content block with a type", param=at)
        if kind in _UNSUPPORTED_BLOCKS:
            raise CapabilityUnsupported(f"{at}: {kind} blocks are not supported here", param=at)
        out.append(block)
    return out


def _user(i: int, blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One user turn: its tool results as ``tool`` messages, then its other content."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = _where("messages", i, "content", j)
        kind = block["type"]
        if kind == "text":
            _known(block, at, {"type", "text", "cache_control", "citations"})
            parts.append({"type": "text", "text": _text_of(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            _known(block, at, {"type", "tool_use_id", "content", "is_error", "cache_control"})
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise InvalidRequest(
                    f"{at}.tool_use_id must name the tool_use it answers",
                    param=f"{at}.tool_use_id",
                )
            if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
                raise InvalidRequest(f"{at}.is_error must be a boolean", param=f"{at}.is_error")
            result = _result_content(block, at)
            if block.get("is_error"):
                text = result if isinstance(result, str) else _joined(result)
                result = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind == "tool_use":
            raise InvalidRequest(f"{at}: tool_use blocks belong to assistant turns", param=at)
        else:
            raise InvalidRequest(f"{at} is a content block of unknown type {kind!r}", param=at)
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        content: Any = _joined(parts) if only_text and len(parts) == 1 else parts
        out.append({"role": "user", "content": content})
    return out


def _joined(parts: list[dict[str, Any]]) -> str:
    return "\n".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def _assistant(i: int, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One assistant turn: its text, and its ``tool_use`` blocks as OpenAI tool calls."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = _where("messages", i, "content", j)
        kind = block["type"]
        if kind == "text":
            _known(block, at, {"type", "text", "cache_control", "citations"})
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            _known(block, at, {"type", "id", "name", "input", "cache_control"})
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise InvalidRequest(f"{at} needs an id and a name", param=at)
            if not isinstance(block.get("input"), dict):
                raise InvalidRequest(f"{at}.input must be an object", param=f"{at}.input")
            arguments = json.dumps(block["input"], ensure_ascii=False, separators=(",", ":"))
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind in ("image", "tool_result"):
            raise InvalidRequest(f"{at}: {kind} blocks belong to user turns", param=at)
        else:
            raise InvalidRequest(f"{at} is a content block of unknown type {kind!r}", param=at)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for k, block in enumerate(system):
        at = _where("system", k)
        if not isinstance(block, dict) or block.get("type") != "text":
            raise InvalidRequest(f"{at} must be a text block", param=at)
        _known(block, at, {"type", "text", "cache_control", "citations"})
        texts.append(_text_of(block, at))
    return "\n".join(texts) or None


def to_openai_messages(req: _Prompt) -> list[dict[str, Any]]:
    """The request's system prompt and turns as OpenAI chat messages; a coded 400 if malformed."""
    out: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages.{i} must be an object", param=f"messages.{i}")
        for name in m:
            if name not in ("role", "content"):
                raise UnknownField(
                    f"unknown field {name!r} in a message", param=f"messages.{i}.{name}"
                )
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequest(
                f"messages.{i}.role must be user or assistant (the system prompt is the "
                "top-level system field)",
                param=f"messages.{i}.role",
            )
        blocks = _blocks(m, i)
        if role == "user":
            out.extend(_user(i, blocks))
        else:
            out.append(_assistant(i, blocks))
    return out


_TOOL_FIELDS = {"name", "description", "input_schema", "cache_control", "type", "strict"}


def to_openai_tools(req: _Prompt) -> list[dict[str, Any]] | None:
    """Client tools as OpenAI function tools; Anthropic's server tools are refused with a code."""
    if not req.tools:
        return None
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(req.tools):
        at = f"tools.{i}"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{at} must be an object", param=at)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise CapabilityUnsupported(
                f"{at}: Anthropic's server tool {kind!r} is not offered here; "
                "define it as a client tool (name, description, input_schema)",
                param=f"{at}.type",
            )
        for field in tool:
            if field not in _TOOL_FIELDS:
                raise UnknownField(f"unknown field {field!r} in a tool", param=f"{at}.{field}")
        name = tool.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise InvalidRequest(
                f"{at}.name must be a non-empty name, each tool's its own", param=f"{at}.name"
            )
        names.add(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(
                f"{at}.input_schema must be a JSON schema object", param=f"{at}.input_schema"
            )
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(f"{at}.description must be a string", param=f"{at}.description")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if description:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def to_openai_tool_choice(req: _Prompt) -> str | dict[str, Any] | None:
    """``tool_choice`` as OpenAI's: auto, required (``any``), none, or one named function."""
    choice = req.tool_choice
    if choice is None:
        return None
    kind = choice.get("type")
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    for name in choice:
        if name not in allowed:
            raise UnknownField(
                f"unknown field {name!r} in tool_choice of type {kind}", param=f"tool_choice.{name}"
            )
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(
            "tool_choice.disable_parallel_tool_use must be a boolean",
            param="tool_choice.disable_parallel_tool_use",
        )
    names = {t.get("name") for t in req.tools or [] if isinstance(t, dict)}
    if kind == "auto":
        return "auto"
    if kind == "none":
        return "none"
    if kind == "any":
        if not names:
            raise InvalidRequest("tool_choice any needs tools", param="tool_choice")
        return "required"
    if kind == "tool":
        wanted = choice.get("name")
        if wanted not in names:
            raise InvalidRequest(
                "tool_choice of type tool must name one of the request's tools",
                param="tool_choice.name",
            )
        return {"type": "function", "function": {"name": wanted}}
    raise InvalidRequest(
        "tool_choice.type must be auto, any, tool or none", param="tool_choice.type"
    )


def openai_prompt(
    req: _Prompt,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """The prompt as OpenAI's ``messages``, ``tools`` and ``tool_choice``.

    Tools that ``tool_choice: none`` turns off are left out (both None), so a
    caller counts and sends the same prompt.
    """
    messages = to_openai_messages(req)
    tools = to_openai_tools(req)
    choice = to_openai_tool_choice(req)
    if not tools or choice == "none":
        return messages, None, None
    return messages, tools, choice


class Translated(BaseModel):
    """A Messages request in the OpenAI shape the engines take, with Anthropic's ``top_k``.

    What the door sends (``work.openai_wire.messages_request``) and what a line of a
    Message Batch stores and its worker reads back: one type, so both answer alike.
    """

    model_config = _STRICT

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


def translate(req: MessagesRequest) -> Translated:
    """A checked Messages request as the OpenAI-shaped request the engines take."""
    messages, tools, choice = openai_prompt(req)
    sampling = req.model_dump(include={"model", "max_tokens", "temperature", "top_p", "top_k"})
    stop = req.stop_sequences or None
    return Translated(
        **sampling,
        messages=messages,
        stop=stop,
        tools=tools,
        tool_choice=choice,
        response_format=req.response_format(),
    )


def _check_prompt(req: _Prompt) -> None:
    """What the shapes cannot say: each tool named once, a choice naming one of them."""
    to_openai_messages(req)
    to_openai_tools(req)
    to_openai_tool_choice(req)


def parse_messages(raw: dict[str, Any]) -> MessagesRequest:
    """A Messages body, checked whole (its translation included); raises a coded 400."""
    req = validated(MessagesRequest, raw)
    _check_prompt(req)
    return req


def parse_count_tokens(raw: dict[str, Any]) -> CountTokensRequest:
    """A count_tokens body, checked as strictly as a Messages body; raises a coded 400."""
    req = validated(CountTokensRequest, raw)
    _check_prompt(req)
    return req


def stop_reason(finish_reason: str) -> str:
    """OpenAI's ``finish_reason`` as Anthropic's ``stop_reason``."""
    return {
        "length": "max_tokens",
        "tool_calls": "tool_use",
        "function_call": "tool_use",
        "content_filter": "refusal",
    }.get(finish_reason, "end_turn")


def tool_id(call: dict[str, Any]) -> str:
    """Anthropic's ``toolu_`` id for an OpenAI tool call, the same each time it is rendered."""
    given = call.get("id")
    if not isinstance(given, str) or not given:
        return f"toolu_{uuid.uuid4().hex[:24]}"
    return "toolu_" + given.removeprefix("call_") if given.startswith("call_") else given


def _tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except (TypeError, ValueError):
        parsed = None
    # Only an upstream that ignores its schema gets here; the text is kept, not lost.
    return parsed if isinstance(parsed, dict) else {"_unparsed_arguments": arguments}


def usage_object(
    input_tokens: int, output_tokens: int, cached_input_tokens: int = 0
) -> dict[str, Any]:
    """Anthropic's ``usage`` for a prompt of ``input_tokens``, ``cached_input_tokens`` of them
    read from the engine's prompt cache.

    Anthropic counts the two apart: ``input_tokens`` are the prompt tokens read
    anew and ``cache_read_input_tokens`` those the cache gave (their sum is the
    prompt), so a client prices each as Anthropic's own usage asks. Nothing is
    written to a cache on request, so ``cache_creation_input_tokens`` is null;
    with nothing read from one, ``cache_read_input_tokens`` is null too.
    """
    cached = max(0, min(cached_input_tokens, input_tokens))
    return {
        "input_tokens": input_tokens - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": None,
        "cache_read_input_tokens": cached or None,
        "server_tool_use": None,
        "service_tier": "standard",
    }


def message_object(
    *,
    message_id: str,
    model: str,
    text: str,
    tool_calls: list[dict[str, Any]] | None,
    finish_reason: str,
    input_tokens: int,
    output_tokens: int,
    matched_stop: str | None = None,
    cached_input_tokens: int = 0,
) -> dict[str, Any]:
    """The whole ``message`` of an answer: a text block (unless only tools were called), then
    one ``tool_use`` block per call; shared by the wire and the results of a Message Batch."""
    content: list[dict[str, Any]] = []
    if text or not tool_calls:
        content.append({"type": "text", "text": text, "citations": None})
    for call in tool_calls or []:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": tool_id(call),
                "name": str(fn.get("name", "")),
                "input": _tool_input(fn.get("arguments")),
            }
        )
    reason = "stop_sequence" if matched_stop else stop_reason(finish_reason)
    if tool_calls:
        reason = "tool_use"
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": matched_stop,
        "usage": usage_object(input_tokens, output_tokens, cached_input_tokens),
        "container": None,
    }
