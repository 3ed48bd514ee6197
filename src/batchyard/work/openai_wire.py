"""OpenAI's wire, written once: typed bodies into engine requests, answers into bodies.

The HTTP doors, the lines of a file batch and the results of a deferred batch all answer
through here, so a ``chat.completion`` is one object whichever way it was asked for; the
``openai`` SDK's types are the reference. A batch line is stored as its typed request's
JSON and read back as that type (``line_request``), so its worker builds the engine
request with the function the door uses.
"""

from __future__ import annotations

import base64
import json
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchyard.core.anthropic_bodies import Translated, stop_reason, tool_id, usage_object
from batchyard.core.openai_bodies import ChatRequest, CompletionTextRequest, EmbeddingRequest
from batchyard.engines.protocol import Choice, Completion, CompletionRequest, Delta, Usage

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "ENDPOINTS",
    "MESSAGES",
    "LineRequest",
    "Reply",
    "anthropic_message",
    "chat_first",
    "chat_piece",
    "chat_replay",
    "chat_request",
    "embedding_list",
    "line_request",
    "matched_stop",
    "messages_request",
    "text_piece",
    "text_replay",
    "text_requests",
    "usage_body",
]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
#: Anthropic's Messages, the endpoint of a Message Batch's requests.
MESSAGES = "/v1/messages"
#: Endpoints a batch line may name.
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES)

#: What a line of a batch file asks for, by its endpoint: the door's own request type.
LineRequest = ChatRequest | CompletionTextRequest | EmbeddingRequest | Translated

_LINE_TYPES: dict[str, type[LineRequest]] = {
    CHAT: ChatRequest,
    COMPLETIONS: CompletionTextRequest,
    EMBEDDINGS: EmbeddingRequest,
    MESSAGES: Translated,
}


# -- requests ---------------------------------------------------------------------------


def line_request(endpoint: str, body: dict[str, Any]) -> LineRequest:
    """A stored line's body read back as the typed request it was checked as at upload.

    Only pydantic's reading of the shape runs again (the rules were checked
    once, ``service.openai_requests``); a body that no longer reads raises
    ``ValueError`` (pydantic's ``ValidationError`` is one) or ``KeyError``.
    """
    return _LINE_TYPES[endpoint].model_validate(body)


def _sampling(body: ChatRequest | CompletionTextRequest) -> dict[str, Any]:
    """What OpenAI's chat and text completions both ask of the sampler."""
    return {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "n": body.n,
        "stop": body.stop_list(),
        "seed": body.seed,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
    }


def chat_request(body: ChatRequest, *, model: str, max_tokens: int) -> CompletionRequest:
    """A chat body as the engine request; ``model`` is the route's name for the model.

    ``tool_choice: none`` sends no tools, so an engine never constrains an
    answer nobody asked to be a tool call.
    """
    using_tools = body.tool_choice != "none"
    return CompletionRequest(
        model=model,
        messages=body.messages,
        max_tokens=max_tokens,
        response_format=body.response_format,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs,
        tools=body.tools if using_tools else None,
        tool_choice=body.tool_choice if using_tools else None,
        **_sampling(body),
    )


def text_requests(
    body: CompletionTextRequest, prompts: Sequence[str], *, model: str, max_tokens: int
) -> list[CompletionRequest]:
    """One engine request per prompt of a text completions body (token ids read as text)."""
    return [
        CompletionRequest(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            prompt=prompt,
            max_tokens=max_tokens,
            logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs,
            **_sampling(body),
        )
        for prompt in prompts
    ]


def messages_request(body: Translated, *, model: str) -> CompletionRequest:
    """A Messages request, translated, as the engine request (its fields are the engine's)."""
    return CompletionRequest(model=model, **body.model_dump(exclude={"model"}))


# -- answers ----------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens`` where any were cached."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_input_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_input_tokens}
    return body


def _token_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A choice's ``logprobs``: every token has its ``top_logprobs`` list (the SDK requires it)."""
    content = [{**lp, "top_logprobs": lp.get("top_logprobs") or []} for lp in entries]
    return {"content": content, "refusal": None}


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": c["function"].get("arguments") or "",
            },
        }
        for c in calls
    ]


def _chat_choice(i: int, ch: Choice, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": ch.text if (ch.text or not ch.tool_calls) else None,
        "refusal": None,
    }
    if ch.tool_calls:
        message["tool_calls"] = _tool_calls(ch.tool_calls)
    return {
        "index": i,
        "message": message,
        "finish_reason": ch.finish_reason,
        "logprobs": _token_logprobs(ch.logprobs) if logprobs and ch.logprobs is not None else None,
    }


def _text_logprobs(ch: Choice) -> dict[str, Any] | None:
    if ch.logprobs is None:
        return None
    return {
        "tokens": [lp["token"] for lp in ch.logprobs],
        "token_logprobs": [lp["logprob"] for lp in ch.logprobs],
        "top_logprobs": [
            {alt["token"]: alt["logprob"] for alt in lp.get("top_logprobs") or []}
            for lp in ch.logprobs
        ],
        "text_offset": [],
    }


@dataclass(frozen=True, slots=True)
class Reply:
    """What every OpenAI answer and chunk starts with: its ID, when (Unix seconds), the model."""

    id: str
    created: int
    model: str

    def _head(self, object: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def chat(self, completion: Completion, *, logprobs: bool) -> dict[str, Any]:
        """A ``chat.completion``; ``logprobs``: whether the request asked for them."""
        choices = [_chat_choice(i, ch, logprobs) for i, ch in enumerate(completion.choices)]
        return {
            **self._head("chat.completion"),
            "choices": choices,
            "usage": usage_body(completion.usage),
        }

    def text(
        self, completion: Completion, body: CompletionTextRequest, prompts: Sequence[str]
    ) -> dict[str, Any]:
        """A ``text_completion`` of ``body``'s ``prompts`` (echoed where it asks).

        Choices go prompt by prompt, ``n`` each, so choice ``i`` is of prompt ``i // n``.
        """

        def choice(i: int, ch: Choice) -> dict[str, Any]:
            echoed = prompts[i // body.n] if body.echo else ""
            return {
                "index": i,
                "text": echoed + ch.text,
                "finish_reason": ch.finish_reason,
                "logprobs": _text_logprobs(ch) if body.logprobs is not None else None,
            }

        return {
            **self._head("text_completion"),
            "choices": [choice(i, ch) for i, ch in enumerate(completion.choices)],
            "usage": usage_body(completion.usage),
        }

    def chunk(
        self,
        object: str,
        choices: list[dict[str, Any]],
        *,
        include_usage: bool,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One chunk of a stream: ``chat.completion.chunk`` or a ``text_completion`` piece.

        With ``stream_options.include_usage`` every chunk carries ``usage`` (null
        until the last, which has no choices); without it, none has the key.
        """
        body = {**self._head(object), "choices": choices}
        if include_usage:
            body["usage"] = usage
        return body


def embedding_list(
    body: EmbeddingRequest, model: str, vectors: list[list[float]], usage: Usage
) -> dict[str, Any]:
    """An embeddings answer: a ``list`` of ``embedding`` objects; base64 is little-endian float32.

    ``dimensions`` keeps the first N numbers of each vector; a model with fewer
    gives all it has (the call has run and been paid for, so it is not refused
    after the fact).
    """

    def encoded(vector: list[float]) -> list[float] | str:
        if body.dimensions is not None:
            vector = vector[: body.dimensions]
        if body.encoding_format == "base64":
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return vector

    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encoded(v)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": usage.input_tokens, "total_tokens": usage.input_tokens},
    }


def matched_stop(completion: Completion, stops: list[str] | None) -> str | None:
    """The stop sequence that ended the answer, where the engine says which (the embedded
    engine and vLLM do)."""
    if not stops:
        return None
    if completion.choices and completion.choices[0].stop_sequence in stops:
        return completion.choices[0].stop_sequence
    choices = completion.raw.get("choices") if isinstance(completion.raw, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else {}
    said = first.get("stop_reason") if isinstance(first, dict) else None
    return said if isinstance(said, str) and said in stops else None


def anthropic_message(
    *, id: str, model: str, completion: Completion, stops: list[str] | None
) -> dict[str, Any]:
    """Anthropic's whole ``message`` for an answer, its door's and a Message Batch's: a text
    block (unless only tools were called), then one ``tool_use`` block per call."""
    choice, usage = completion.choices[0], completion.usage
    calls = choice.tool_calls or []
    content: list[dict[str, Any]] = []
    if choice.text or not calls:
        content.append({"type": "text", "text": choice.text, "citations": None})
    for call in calls:
        fn = call.get("function") or {}
        name, arguments = str(fn.get("name", "")), _tool_input(fn.get("arguments"))
        content.append({"type": "tool_use", "id": tool_id(call), "name": name, "input": arguments})
    stop = matched_stop(completion, stops)
    reason = "stop_sequence" if stop else stop_reason(choice.finish_reason)
    return {
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if calls else reason,
        "stop_sequence": stop,
        "usage": usage_object(usage.input_tokens, usage.output_tokens, usage.cached_input_tokens),
        "container": None,
    }


def _tool_input(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except (TypeError, ValueError):
        parsed = None
    # Only an upstream that ignores its schema gets here; the text is kept, not lost.
    return parsed if isinstance(parsed, dict) else {"_unparsed_arguments": arguments}


# -- chunks -----------------------------------------------------------------------------


def _piece(index: int, delta: dict[str, Any], lp: Any = None, finish: Any = None) -> dict[str, Any]:
    """One choice of a ``chat.completion.chunk``."""
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}


def chat_first(i: int) -> dict[str, Any]:
    """Choice ``i``'s first chunk: the assistant's role and no text yet."""
    return _piece(i, {"role": "assistant", "content": ""})


def chat_piece(d: Delta, logprobs: bool) -> dict[str, Any]:
    """A piece of a chat answer as a chunk's choice."""
    delta: dict[str, Any] = {}
    if d.text:
        delta["content"] = d.text
    if d.tool_calls:
        if all("index" in call for call in d.tool_calls):
            delta["tool_calls"] = d.tool_calls  # an upstream's own fragments, as they came
        else:
            calls = _tool_calls(d.tool_calls)
            delta["tool_calls"] = [{**call, "index": k} for k, call in enumerate(calls)]
    lp = _token_logprobs(d.logprobs) if logprobs and d.logprobs is not None else None
    return _piece(d.index, delta, lp, d.finish_reason)


def chat_replay(whole: dict[str, Any]) -> list[dict[str, Any]]:
    """A saved ``chat.completion``'s choices as one chunk choice each (a replayed stream)."""
    out = []
    for ch in whole.get("choices", []):
        message = ch.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                {**call, "index": k} for k, call in enumerate(message["tool_calls"])
            ]
        out.append(_piece(ch.get("index", 0), delta, ch.get("logprobs"), ch.get("finish_reason")))
    return out


def text_piece(d: Delta) -> dict[str, Any]:
    """A piece of a text completion as a chunk's choice."""
    return {"index": d.index, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}


def text_replay(whole: dict[str, Any]) -> list[dict[str, Any]]:
    """A saved ``text_completion``'s choices as chunk choices (a replayed stream)."""
    return [{**c, "logprobs": None} for c in whole.get("choices", [])]
