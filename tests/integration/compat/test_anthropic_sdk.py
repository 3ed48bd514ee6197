"""The official ``anthropic`` SDK, unchanged and on default settings, against a live batchyard.

The embedded model answers. Every object the SDK hands back is validated
strictly against the SDK's own types from the raw JSON, and walked for fields
the types do not know (pydantic keeps them in ``model_extra``): a field missing,
misspelt or of the wrong type fails here rather than in a user's code.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from anthropic.types import (
    Message,
    MessageTokensCount,
    RawMessageStreamEvent,
    TextBlock,
    ToolUseBlock,
)
from pydantic import BaseModel, TypeAdapter

pytestmark = pytest.mark.model

MODEL = "kettei-core"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def client(gateway, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base, api_key=key)


def no_unknown_fields(obj: Any, where: str = "") -> None:
    """Every model in ``obj``, all the way down, holds only fields its type declares."""
    if isinstance(obj, BaseModel):
        assert not obj.model_extra, f"{where or type(obj).__name__}: unknown {obj.model_extra}"
        for name in type(obj).model_fields:
            no_unknown_fields(getattr(obj, name), f"{where}.{name}")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            no_unknown_fields(item, f"{where}[{i}]")


def exactly(model: type[BaseModel], raw: dict[str, Any]) -> BaseModel:
    parsed = model.model_validate(raw, strict=True)
    no_unknown_fields(parsed, model.__name__)
    return parsed


def test_create_answers_a_message_of_the_sdks_own_type(gateway):
    sdk = client(gateway, gateway.org("create"))
    raw = sdk.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=24,
        system="You are terse.",
        messages=[{"role": "user", "content": "Say hi"}],
        temperature=0.2,
        top_k=20,
    )
    message = raw.parse()
    exactly(Message, json.loads(raw.text))
    assert raw.headers["request-id"].startswith("req_")
    assert isinstance(message.content[0], TextBlock) and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= message.usage.output_tokens <= 24 and message.usage.input_tokens > 0


def test_max_tokens_is_reported_as_the_stop_reason(gateway):
    sdk = client(gateway, gateway.org("short"))
    message = sdk.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": "Write a long story about the sea."}],
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2


def test_a_stop_sequence_is_named_as_anthropic_names_it(gateway):
    sdk = client(gateway, gateway.org("stops"))
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
    }
    whole = sdk.messages.create(**ask)
    assert isinstance(whole.content[0], TextBlock)
    text = whole.content[0].text
    # A stop string the answer is known to reach (at temperature 0 it repeats
    # itself), beside one it never writes: Anthropic names the one that ended it.
    words = [w.strip(" ,.") for w in text.split() if w.strip(" ,.")]
    assert len(words) >= 3, text
    stop = words[2]
    cut = text[: text.index(stop)]
    message = sdk.messages.create(**ask, stop_sequences=["never written here", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert isinstance(message.content[0], TextBlock) and message.content[0].text == cut
    with sdk.messages.stream(**ask, stop_sequences=[stop]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == cut
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    # Without a stop string in play, the field stays null.
    assert whole.stop_sequence is None and whole.stop_reason in ("end_turn", "max_tokens")


def test_a_stream_is_events_of_the_sdks_own_types(gateway):
    sdk = client(gateway, gateway.org("stream"))
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    events = list(
        sdk.messages.create(
            model=MODEL,
            max_tokens=16,
            messages=[{"role": "user", "content": "Count to five"}],
            stream=True,
        )
    )
    for event in events:
        adapter.validate_python(event.model_dump(mode="json", exclude_unset=True), strict=True)
        no_unknown_fields(event, event.type)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    # And the SDK's own stream helper puts the same kind of stream back together.
    with sdk.messages.stream(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Count to five"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    exactly(Message, final.model_dump(mode="json", exclude_unset=True))
    assert text and final.content[0].type == "text" and final.content[0].text == text
    assert final.usage.output_tokens >= 1 and final.stop_reason in ("end_turn", "max_tokens")


def test_a_tool_use_round_trip(gateway):
    sdk = client(gateway, gateway.org("tools"))
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    raw = sdk.messages.with_raw_response.create(
        model=MODEL, max_tokens=60, messages=messages, tools=[WEATHER], tool_choice={"type": "any"}
    )
    first = raw.parse()
    exactly(Message, json.loads(raw.text))
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if isinstance(b, ToolUseBlock)]
    assert use.name == "get_weather" and isinstance(use.input, dict)
    assert isinstance(use.input["city"], str)
    messages.append({"role": "assistant", "content": first.content})
    messages.append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
        }
    )
    second = sdk.messages.create(model=MODEL, max_tokens=60, messages=messages, tools=[WEATHER])
    exactly(Message, second.model_dump(mode="json", exclude_unset=True))
    # With tool_choice auto the model either replies or calls again; both are well formed.
    assert second.stop_reason in ("end_turn", "tool_use", "max_tokens")
    assert second.content


def test_count_tokens_is_the_prompt_the_model_reads(gateway):
    sdk = client(gateway, gateway.org("count"))
    prompt: dict[str, Any] = {
        "model": MODEL,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Say hi"}],
    }
    raw = sdk.messages.with_raw_response.count_tokens(**prompt)
    counted = raw.parse()
    exactly(MessageTokensCount, json.loads(raw.text))
    answered = sdk.messages.create(**prompt, max_tokens=4)
    # Counted with the model's own tokenizer and chat template: what the model was given,
    # which its usage splits, as Anthropic's does, into tokens read anew and from the cache.
    cached = answered.usage.cache_read_input_tokens or 0
    assert counted.input_tokens == answered.usage.input_tokens + cached
    with_tools = sdk.messages.count_tokens(**prompt, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_errors_are_the_sdks_own_exceptions_in_anthropics_envelope(gateway):
    sdk = client(gateway, gateway.org("errors"))
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    body = missing.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == "model_not_found"
    with pytest.raises(anthropic.AuthenticationError):
        client(gateway, "sk-not-a-key").messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"frequency_penalty": 1},
        )
    assert bad.value.body["error"]["code"] == "unknown_field"  # type: ignore[index]


class Verdict(BaseModel):
    # Booleans, not a ``Literal``: the SDK moves an enum into the description before it
    # sends the schema, then checks the enum itself, so no server can hold a model to it.
    wet: bool
    sure: bool


def test_structured_outputs_parse_into_the_callers_type(gateway):
    """``messages.parse(output_format=...)`` sends ``output_config``; the answer is held to
    its schema by the same JSON-schema grammar as OpenAI's ``response_format``."""
    sdk = client(gateway, gateway.org("parse"))
    parsed = sdk.messages.parse(
        model=MODEL,
        max_tokens=32,
        messages=[{"role": "user", "content": "Is water wet? Answer yes or no."}],
        output_format=Verdict,
    )
    assert isinstance(parsed.parsed_output, Verdict)
    assert list(json.loads(parsed.content[0].text)) == ["wet", "sure"]  # the schema's order
