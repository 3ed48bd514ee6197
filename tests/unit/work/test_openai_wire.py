"""The one OpenAI wire layer: typed bodies into engine requests, answers into OpenAI's bodies."""

from __future__ import annotations

import base64
import struct

import pytest
from openai.types import Completion as TextCompletion
from openai.types.chat import ChatCompletion

from batchyard.core.anthropic_bodies import Translated, parse_messages, translate
from batchyard.core.openai_bodies import parse_chat, parse_completion, parse_embedding
from batchyard.engines.protocol import Choice, Completion, Usage
from batchyard.work.openai_wire import (
    CHAT,
    MESSAGES,
    Reply,
    chat_request,
    embedding_list,
    line_request,
    messages_request,
    text_requests,
    usage_body,
)

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def test_a_chat_body_becomes_the_engine_request_and_tool_choice_none_sends_no_tools():
    body = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.5,
            "stop": "END",
            "n": 2,
            "seed": 7,
            "logprobs": True,
            "top_logprobs": 3,
            "tools": [TOOL],
            "tool_choice": "none",
        }
    )
    req = chat_request(body, model="upstream-m", max_tokens=32)
    assert (req.model, req.max_tokens, req.temperature, req.n, req.seed) == (
        "upstream-m",
        32,
        0.5,
        2,
        7,
    )
    assert req.stop == ["END"] and req.logprobs and req.top_logprobs == 3
    assert req.tools is None and req.tool_choice is None
    with_tools = chat_request(
        parse_chat({**body.model_dump(exclude_unset=True), "tool_choice": "auto"}),
        model="m",
        max_tokens=1,
    )
    assert with_tools.tools == [TOOL] and with_tools.tool_choice == "auto"


def test_each_prompt_is_its_own_engine_request_sent_raw():
    body = parse_completion({"model": "m", "prompt": ["a", "b"], "logprobs": 2, "n": 3})
    reqs = text_requests(body, ["a", "b"], model="m", max_tokens=5)
    assert [r.prompt for r in reqs] == ["a", "b"]
    assert all(r.logprobs and r.top_logprobs == 2 and r.n == 3 for r in reqs)


def test_a_message_batch_line_stored_before_the_wire_layer_reads_back_as_the_door_request():
    """The stored shape of a Message Batch line (translated, with top_k) is ``Translated``."""
    stored = {
        "model": "kettei-core",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}],
        "max_tokens": 16,
        "top_k": 5,
        "stop": ["###"],
    }
    read = line_request(MESSAGES, stored)
    assert isinstance(read, Translated)
    door = translate(
        parse_messages(
            {
                "model": "kettei-core",
                "system": "Be brief.",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 16,
                "top_k": 5,
                "stop_sequences": ["###"],
            }
        )
    )
    assert read == door
    req = messages_request(read, model="up")
    assert (req.model, req.top_k, req.stop, req.max_tokens) == ("up", 5, ["###"], 16)


def test_a_stored_body_that_no_longer_reads_is_a_value_error():
    with pytest.raises(ValueError):
        line_request(CHAT, {"model": "m", "messages": [], "surprise": 1})


def test_a_chat_completion_is_openais_object_with_tool_calls_and_cached_tokens():
    done = Completion(
        "m",
        [Choice("", "tool_calls", tool_calls=[{"function": {"name": "lookup"}}])],
        Usage(10, 4, cached_input_tokens=6),
    )
    body = Reply("chatcmpl-1", 1700000000, "kettei-core").chat(done, logprobs=True)
    sdk = ChatCompletion.model_validate(body)
    (choice,) = sdk.choices
    assert choice.message.content is None and choice.message.refusal is None
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.arguments == ""  # type: ignore[union-attr]
    assert choice.logprobs is None  # asked for, but the engine gave none
    assert sdk.usage is not None and sdk.usage.prompt_tokens_details is not None
    assert sdk.usage.prompt_tokens_details.cached_tokens == 6
    assert "prompt_tokens_details" not in usage_body(Usage(1, 1))


def test_a_text_completion_echoes_each_choices_own_prompt():
    body = parse_completion({"model": "m", "prompt": ["A", "B"], "n": 2, "echo": True})
    done = Completion("m", [Choice(f"-{i}") for i in range(4)], Usage(2, 4))
    answer = Reply("cmpl-1", 1, "m").text(done, body, ["A", "B"])
    assert [c.text for c in TextCompletion.model_validate(answer).choices] == [
        "A-0",
        "A-1",
        "B-2",
        "B-3",
    ]


def test_embeddings_keep_the_first_dimensions_and_pack_little_endian_float32():
    body = parse_embedding(
        {"model": "m", "input": "x", "dimensions": 2, "encoding_format": "base64"}
    )
    answer = embedding_list(body, "m", [[0.5, -1.0, 2.0]], Usage(3, 0))
    (item,) = answer["data"]
    assert struct.unpack("<2f", base64.b64decode(item["embedding"])) == (0.5, -1.0)
    assert answer["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
