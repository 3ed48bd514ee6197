"""The bodies of the OpenAI-compatible endpoints, checked strictly, one function each.

They touch no service, so a batch-file line is checked by the code a request on the wire
is. Every documented field is accepted (ignored where it changes nothing here, refused
with a code where no engine here can honour it), an unknown field is ``unknown_field``,
nothing is coerced, and an optional field sent as ``null`` means its default, as on
OpenAI's API (LiteLLM sends ``"encoding_format": null``).
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, model_validator

from batchyard.core.catalog import ModelSpec
from batchyard.core.inputs import AsDicts, Shape, Unserved, strict
from batchyard.errors import InvalidRequest, UnsupportedInput

__all__ = [
    "ChatRequest",
    "CompletionTextRequest",
    "EmbeddingRequest",
    "StreamOptions",
    "check_images",
    "parse_chat",
    "parse_completion",
    "parse_embedding",
]


class _Body(Shape):
    """A body of OpenAI's API: strict, and an optional field sent as ``null`` is its default."""

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
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
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


# -- messages, tools and formats: declared once, read by the door and shown in the document --


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: str


#: A content part; ``input_audio`` and ``file`` parts are refused with ``capability_unsupported``.
Part = Annotated[TextPart | ImagePart | RefusalPart, Field(discriminator="type")]
Content = str | list[Part]


class PromptMessage(_Body):
    """A system, developer or user message."""

    role: Literal["system", "developer", "user"]
    content: Content
    name: str | None = None


class CalledFunction(_Body):
    name: str
    #: The arguments as a JSON string, as the model wrote them.
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None


class ToolMessage(_Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


class FunctionMessage(_Body):
    role: Literal["function"]
    content: str | None
    name: str


Message = Annotated[
    PromptMessage | AssistantMessage | ToolMessage | FunctionMessage, Field(discriminator="role")
]


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    #: A JSON schema of the arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(_Body):
    """A tool; OpenAI's ``custom`` tools are refused with ``capability_unsupported``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaSpec(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class ChatRequest(_Common):
    """``POST /v1/chat/completions``, as OpenAI documents it."""

    messages: Annotated[list[dict[str, Any]], AsDicts(list[Message]), Field(min_length=1)]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Annotated[list[dict[str, Any]], AsDicts(list[FunctionTool])] | None = None
    tool_choice: (
        Annotated[
            str | dict[str, Any], AsDicts(Literal["none", "auto", "required"] | NamedToolChoice)
        ]
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    response_format: Annotated[dict[str, Any], AsDicts(ResponseFormat)] | None = None
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
    # Documented, but nothing here can honour them: refused with a code when set
    # (``functions`` and ``function_call``: use tools).
    audio: Annotated[Any, Unserved()] = None
    modalities: Annotated[Any, Unserved((None, ["text"]))] = None
    prediction: Annotated[Any, Unserved()] = None
    web_search_options: Annotated[Any, Unserved()] = None
    functions: Annotated[Any, Unserved()] = None
    function_call: Annotated[Any, Unserved()] = None

    @model_validator(mode="after")
    def _tools_named_once(self) -> ChatRequest:
        """What the tools' shapes cannot say: each name once, and a choice that names one."""
        names: set[str] = set()
        for i, tool in enumerate(self.tools or []):
            name = tool["function"]["name"]
            if name in names:
                raise InvalidRequest(
                    f"tools.{i}.function.name {name!r} is given twice; each tool has its own",
                    param=f"tools.{i}.function.name",
                )
            names.add(name)
        choice = self.tool_choice
        if choice == "required" and not names:
            raise InvalidRequest("tool_choice required needs tools", param="tool_choice")
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise InvalidRequest(
                "tool_choice must name one of the request's tools",
                param="tool_choice.function.name",
            )
        return self


_T = TypeVar("_T")
_NonEmpty = Annotated[list[_T], Field(min_length=1)]
_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionTextRequest(_Common):
    """``POST /v1/completions`` (the legacy text completions)."""

    prompt: str | _NonEmpty[str] | _TokenIds | _NonEmpty[_TokenIds]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    # Documented, refused when used: insertion, and choosing the best of more samples.
    suffix: Annotated[Any, Unserved((None, ""))] = None
    best_of: Annotated[Any, Unserved((None, 1))] = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or as token ids (read by the door, ``engines.token_ids``)."""
        return _items(self.prompt)


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``."""

    model: str = Field(min_length=1)
    input: _Text | _NonEmpty[_Text] | _TokenIds | _NonEmpty[_TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input, as text or as token ids (read by the door, ``engines.token_ids``)."""
        return _items(self.input)


_Given = str | list[str] | list[int] | list[list[int]]


def _items(given: _Given) -> list[str | list[int]]:
    """OpenAI's four shapes of ``input``/``prompt`` as one list (their shapes refuse empties).

    A text, texts, one token-id array, or several.
    """
    if isinstance(given, str):
        return [given]
    if all(isinstance(i, int) for i in given):
        return [[i for i in given if isinstance(i, int)]]
    return [i for i in given if not isinstance(i, int)]


#: A body checked whole, the rules its shape cannot say included; raises a coded 400.
parse_chat = partial(strict, ChatRequest)
parse_completion = partial(strict, CompletionTextRequest)
parse_embedding = partial(strict, EmbeddingRequest)


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
