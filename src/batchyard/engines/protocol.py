"""The Engine protocol: ``complete(request) -> completion with usage``.

Engines sit at the edge. They raise ``batchyard.errors.UpstreamError`` (or a
subclass) for failures, carrying ``retry_after`` where the upstream said so,
and report the upstream's own rate-limit signals on each completion so the
dispatcher can pace by them instead of guessing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from batchyard.core.limits import RateLimitSignal

__all__ = [
    "CacheReporting",
    "CacheState",
    "Choice",
    "Completion",
    "CompletionRequest",
    "Delta",
    "EmbeddingEngine",
    "Embeddings",
    "Engine",
    "RateLimitSignal",
    "ScoringEngine",
    "StreamingEngine",
    "Usage",
]


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One chat completion, in OpenAI's shape, already validated and priced.

    ``messages`` are OpenAI chat messages; ``content`` may be a string or a
    list of content parts (text and ``image_url``), passed through untouched
    to engines that read images. ``response_format`` is OpenAI's
    ``{"type": "json_schema", ...}`` where the caller wants constrained output.
    """

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    #: Sample from the k likeliest tokens only (Anthropic's ``top_k``); sent only when set.
    top_k: int | None = None
    n: int = 1
    stop: list[str] | None = None
    seed: int | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI's tools, passed through untouched; the embedded engine answers them
    # under a grammar built from their JSON schemas.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # A text completion (``/v1/completions``): the prompt is sent as it is, with
    # no chat template, and ``messages`` only carry it for counting.
    prompt: str | None = None
    #: Ask an HTTP upstream to report usage at the end of a stream.
    stream_usage: bool = True
    #: Set when the caller of a whole (not streamed) answer hung up: an engine that
    #: can (the embedded one) stops generating at its next step and answers what it
    #: produced, finish_reason ``length``; one that cannot runs to the end.
    hangup: asyncio.Event | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class CacheState:
    """What one loaded embedded model keeps of prompts read, for ``/metrics``."""

    #: ``base``, or the full-weights version's name (a LoRA version shares the base's).
    model: str
    #: Bytes and prompts on the shelf: prompts moved out of the KV cache to host memory.
    shelf_bytes: int
    shelf_prompts: int


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int
    output_tokens: int
    #: How many of ``input_tokens`` the engine read from its prompt cache
    #: instead of evaluating them (OpenAI's ``prompt_tokens_details.cached_tokens``).
    cached_input_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        """Two calls' usage as one (every count summed, the cached one too)."""
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cached_input_tokens + other.cached_input_tokens,
        )


@dataclass(frozen=True, slots=True)
class Choice:
    text: str
    finish_reason: str = "stop"
    # Token log-probabilities, OpenAI's ``logprobs.content`` list, where given.
    logprobs: list[dict[str, Any]] | None = None
    # OpenAI's ``message.tool_calls`` where the model called tools.
    tool_calls: list[dict[str, Any]] | None = None
    #: The caller's stop string that ended the answer, where the engine says which
    #: (Anthropic's ``stop_sequence``); ``None`` when it ended otherwise or cannot tell.
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """One piece of a streamed answer: new text (or tool-call pieces) of one choice.

    ``tool_calls`` is OpenAI's ``delta.tool_calls`` list; ``finish_reason`` is
    set on the last piece of a choice.
    """

    index: int = 0
    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    #: How many prompt tokens the engine has read from its cache so far, where it says
    #: before the end (the embedded one does): a stream cut short is settled with it.
    cached_input_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Embeddings:
    vectors: list[list[float]]
    usage: Usage


@dataclass(frozen=True, slots=True)
class Completion:
    model: str
    choices: list[Choice]
    usage: Usage
    rate_limit: RateLimitSignal | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""


@runtime_checkable
class Engine(Protocol):
    """Anything that answers chat completions."""

    name: str

    async def complete(self, request: CompletionRequest) -> Completion: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that answers piece by piece.

    ``stream`` yields ``Delta`` pieces and ends with exactly one ``Completion``
    (the whole answer and its usage). Closing the iterator early stops the
    generation; the engine then knows nothing more, and the caller bills what
    it saw.
    """

    def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]: ...


@runtime_checkable
class EmbeddingEngine(Protocol):
    """An engine that turns texts into vectors (``/v1/embeddings``)."""

    async def embed(self, model: str, texts: list[str]) -> Embeddings: ...


@runtime_checkable
class ScoringEngine(Protocol):
    """An engine that can score candidate continuations (per-outcome scoring).

    ``score`` returns the total log-probability of each candidate string as the
    assistant's reply to ``messages``, which lets decide pick an outcome and
    report real probabilities instead of parsing free text.
    """

    async def score(
        self, model: str, messages: list[dict[str, Any]], candidates: list[str]
    ) -> tuple[list[float], Usage]: ...


@runtime_checkable
class CacheReporting(Protocol):
    """An engine that keeps prompts it read (the embedded one), and says how much (``/metrics``)."""

    async def cache_states(self) -> list[CacheState]: ...
