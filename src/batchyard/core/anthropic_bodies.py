"""The bodies of Anthropic's Messages API, checked strictly and turned into OpenAI's shape.

Checked as ``core.openai_bodies`` checks OpenAI's. The engines take one request shape,
OpenAI's, so a Messages body is translated rather than answered by a second path, and
the translation touches no service, so a Message Batch line is checked by the same code.
"""

from __future__ import annotations

import datetime
import json
import uuid
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from batchyard.core.inputs import AsDicts, Shape, Unserved, strict
from batchyard.errors import InvalidRequest

__all__ = [
    "CountTokensRequest",
    "MessagesRequest",
    "Translated",
    "anthropic_version_ok",
    "batch_counts",
    "error_type",
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
_ERROR_TYPES = {
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


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for ``status``: on the door and in a batch's results alike."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class CacheControl(Shape):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(Shape):
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class Base64Source(Shape):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(Shape):
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


class UserTurn(Shape):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantTurn(Shape):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


Turn = Annotated[UserTurn | AssistantTurn, Field(discriminator="role")]


class Tool(Shape):
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


class _Choice(Shape):
    disable_parallel_tool_use: bool | None = None


class PlainChoice(_Choice):
    type: Literal["auto", "any", "none"]


class ToolChoice(_Choice):
    type: Literal["tool"]
    name: str


Choice = Annotated[PlainChoice | ToolChoice, Field(discriminator="type")]


class JsonOutputFormat(Shape):
    """Structured outputs: the answer is JSON that validates against ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Shape):
    format: JsonOutputFormat | None = None
    #: How hard to think: accepted, changes nothing here (no extended thinking).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    task_budget: Annotated[Any, Unserved()] = None


class _Prompt(Shape):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` both take."""

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

    @model_validator(mode="after")
    def _tools_named_once(self) -> _Prompt:
        """What the shapes cannot say: each tool named once, a choice naming one of them."""
        to_openai_tools(self)
        to_openai_tool_choice(self)
        return self


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


# The translation reads what the shapes above already checked (``parse_messages``): only
# what no shape can say is checked here, each tool named once and a choice naming one.


def _image_part(source: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic image source as OpenAI's ``image_url`` part (a data URL or a URL)."""
    if source["type"] == "url":
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    url = f"data:{source['media_type']};base64,{source['data']}"
    return {"type": "image_url", "image_url": {"url": url}}


def _parts(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text and image blocks as OpenAI content parts."""
    return [
        {"type": "text", "text": b["text"]} if b["type"] == "text" else _image_part(b["source"])
        for b in blocks
    ]


def _joined(parts: list[dict[str, Any]]) -> str:
    return "\n".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def _user(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One user turn: its tool results as ``tool`` messages, then its other content."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    for block in content:
        if block["type"] != "tool_result":
            continue
        given = block.get("content")
        result: Any = "" if given is None else given if isinstance(given, str) else _parts(given)
        if block.get("is_error"):
            result = f"Error: {result if isinstance(result, str) else _joined(result)}"
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
    parts = _parts([b for b in content if b["type"] != "tool_result"])
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        out.append({"role": "user", "content": _joined(parts) if only_text else parts})
    return out


def _assistant(content: str | list[dict[str, Any]]) -> dict[str, Any]:
    """One assistant turn: its text, and its ``tool_use`` blocks as OpenAI tool calls."""
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    calls = [
        {
            "id": b["id"],
            "type": "function",
            "function": {
                "name": b["name"],
                "arguments": json.dumps(b["input"], ensure_ascii=False, separators=(",", ":")),
            },
        }
        for b in blocks
        if b["type"] == "tool_use"
    ]
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def to_openai_messages(req: _Prompt) -> list[dict[str, Any]]:
    """The request's system prompt and turns as OpenAI chat messages."""
    system = req.system if isinstance(req.system, str) else _joined(req.system or [])
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for m in req.messages:
        if m["role"] == "user":
            out.extend(_user(m["content"]))
        else:
            out.append(_assistant(m["content"]))
    return out


def to_openai_tools(req: _Prompt) -> list[dict[str, Any]] | None:
    """Client tools as OpenAI function tools, each name once (a coded 400 otherwise)."""
    if not req.tools:
        return None
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(req.tools):
        if tool["name"] in names:
            raise InvalidRequest(
                f"tools.{i}.name {tool['name']!r} is given twice; each tool has its own",
                param=f"tools.{i}.name",
            )
        names.add(tool["name"])
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def to_openai_tool_choice(req: _Prompt) -> str | dict[str, Any] | None:
    """``tool_choice`` as OpenAI's: auto, required (``any``), none, or one named function."""
    choice = req.tool_choice
    if choice is None:
        return None
    kind = choice["type"]
    names = {t["name"] for t in req.tools or []}
    if kind == "any" and not names:
        raise InvalidRequest("tool_choice any needs tools", param="tool_choice")
    if kind == "tool" and choice["name"] not in names:
        raise InvalidRequest(
            "tool_choice of type tool must name one of the request's tools",
            param="tool_choice.name",
        )
    if kind == "tool":
        return {"type": "function", "function": {"name": choice["name"]}}
    return "required" if kind == "any" else str(kind)


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


class Translated(Shape):
    """A Messages request in the OpenAI shape the engines take, with Anthropic's ``top_k``.

    What the door sends (``work.openai_wire.messages_request``) and what a line of a
    Message Batch stores and its worker reads back: one type, so both answer alike.
    """

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


#: A body checked whole (its translation included); raises a coded 400.
parse_messages = partial(strict, MessagesRequest)
parse_count_tokens = partial(strict, CountTokensRequest)


def batch_counts(per_state: dict[str, int]) -> dict[str, int]:
    """A Message Batch's ``request_counts`` from how many of its lines are in each state."""
    per = per_state
    return {
        "processing": per.get("pending", 0) + per.get("dispatched", 0),
        "succeeded": per.get("succeeded", 0),
        "errored": per.get("failed", 0) + per.get("uncertain", 0),
        "canceled": per.get("canceled", 0),
        "expired": per.get("expired", 0),
    }


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


def usage_object(
    input_tokens: int, output_tokens: int, cached_input_tokens: int = 0
) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` the prompt tokens read anew and
    ``cache_read_input_tokens`` those the engine's cache gave (their sum is the prompt), so a
    client prices each as Anthropic's own usage asks; nothing is written to a cache."""
    cached = max(0, min(cached_input_tokens, input_tokens))
    return {
        "input_tokens": input_tokens - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": None,
        "cache_read_input_tokens": cached or None,
        "server_tool_use": None,
        "service_tier": "standard",
    }
