"""The official ``openai`` SDK, default settings, against a live batchyard.

Every object the SDK returns is also validated strictly against the SDK's own
types from the raw JSON, so a field of the wrong type (or a missing required
one) fails here rather than in a user's code.
"""

from __future__ import annotations

import enum
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pydantic
import pytest
from openai.types import Completion, CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "Say hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def client(gateway, key: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key=key, **kwargs)


def test_ten_concurrent_calls_at_tier_1_are_all_answered(gateway):
    sdk = client(gateway, gateway.org("ten"))

    def one(i: int) -> ChatCompletion:
        return sdk.chat.completions.create(
            model="kettei-core",
            messages=[{"role": "user", "content": f"Say hi to number {i}"}],
            max_tokens=4,
        )

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(one, range(10)))
    assert len(answers) == 10
    for answer in answers:
        ChatCompletion.model_validate(answer.model_dump(mode="json"), strict=True)
        assert answer.usage is not None and answer.usage.completion_tokens <= 4


def test_answers_carry_request_id_and_where_the_limits_stand(gateway):
    sdk = client(gateway, gateway.org("headers"))
    raw = sdk.chat.completions.with_raw_response.create(
        model="kettei-core", messages=MESSAGES, max_tokens=4
    )
    assert raw.headers["x-request-id"].startswith("req_")
    assert raw.headers["x-ratelimit-limit-requests"] == "300"  # tier 1
    assert int(raw.headers["x-ratelimit-remaining-requests"]) == 24  # a burst of 25, one used
    assert raw.headers["x-ratelimit-limit-tokens"] == "400000"
    assert raw.headers["x-ratelimit-reset-requests"].endswith("ms")
    completion = raw.parse()
    ChatCompletion.model_validate(json.loads(raw.text), strict=True)
    assert completion.choices[0].message.role == "assistant"
    assert completion.id == json.loads(raw.text)["id"]


def test_streaming_yields_chunks_then_usage(gateway):
    sdk = client(gateway, gateway.org("stream"))
    chunks = list(
        sdk.chat.completions.create(
            model="kettei-core",
            messages=MESSAGES,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump(mode="json"), strict=True)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) >= 2  # token by token, not one block
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens >= 1 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_tool_call_round_trip(gateway):
    sdk = client(gateway, gateway.org("tools"))
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.chat.completions.create(
        model="kettei-core",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
    )
    ChatCompletion.model_validate(first.model_dump(mode="json"), strict=True)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    second = sdk.chat.completions.create(
        model="kettei-core", messages=messages, tools=[WEATHER], max_tokens=40
    )
    ChatCompletion.model_validate(second.model_dump(mode="json"), strict=True)
    answer = second.choices[0]
    # With tool_choice auto the model either replies or calls again; both parse. At the
    # SDK's default temperature (1) the reply is sampled, and a 135M model's reply runs
    # past 40 tokens now and then: a reply cut at max_tokens ("length") is still a reply
    # (a run under load once drew one; the seed is random per request).
    assert answer.finish_reason in ("stop", "tool_calls", "length")
    assert answer.message.content or answer.message.tool_calls
    if answer.finish_reason == "length":
        assert answer.message.content and second.usage.completion_tokens == 40


class Operator(enum.StrEnum):
    EQ = "="
    GT = ">"
    LT = "<"


class Condition(pydantic.BaseModel):
    column: str
    operator: Operator
    value: str | int


class Query(pydantic.BaseModel):
    """A query over one table (the SDK's parsing_tools example, on a 135M model)."""

    table_name: str
    conditions: list[Condition]


def test_parse_with_a_pydantic_tool_of_an_enum_and_a_nested_model(gateway):
    """``$defs`` and ``$ref`` are constrained as written: a call to the offered tool whose
    arguments the SDK parses into the model, or a 200 text reply; never another tool."""
    sdk = client(gateway, gateway.org("parse"))
    done = sdk.chat.completions.parse(
        model="kettei-core",
        messages=[{"role": "user", "content": "Find the users older than 30."}],
        tools=[openai.pydantic_function_tool(Query)],
        max_tokens=120,
        seed=1,
        temperature=1.0,
    )
    choice = done.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "Query"
        assert isinstance(call.function.parsed_arguments, Query)
    else:
        assert choice.finish_reason in ("stop", "length")
        assert choice.message.content is not None


def test_a_tool_call_cut_by_max_tokens_is_its_text_not_a_502(gateway):
    sdk = client(gateway, gateway.org("cut-call"))
    done = sdk.chat.completions.create(
        model="kettei-core",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=3,
    )
    ChatCompletion.model_validate(done.model_dump(mode="json"), strict=True)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and choice.message.content.startswith("{")
    assert done.usage is not None and done.usage.completion_tokens == 3


def test_embeddings_and_completions_answer(gateway):
    sdk = client(gateway, gateway.org("other"))
    emb = sdk.embeddings.create(model="kettei-core", input=["a red apple", "a green pear"])
    CreateEmbeddingResponse.model_validate(emb.model_dump(mode="json"), strict=True)
    assert [d.index for d in emb.data] == [0, 1]
    assert len(emb.data[0].embedding) == len(emb.data[1].embedding) > 0
    assert abs(sum(x * x for x in emb.data[0].embedding) - 1.0) < 1e-3  # unit length
    # The SDK's default asks for base64 and decodes it; the vectors are the same.
    as_floats = sdk.embeddings.create(
        model="kettei-core", input="a red apple", encoding_format="float"
    )
    assert as_floats.data[0].embedding == pytest.approx(emb.data[0].embedding, abs=1e-6)
    text = sdk.completions.create(model="kettei-core", prompt="Once upon a time", max_tokens=6)
    Completion.model_validate(text.model_dump(mode="json"), strict=True)
    assert text.object == "text_completion" and text.usage.completion_tokens <= 6


def test_models_and_logprobs_have_the_sdks_shape(gateway):
    sdk = client(gateway, gateway.org("models"))
    models = sdk.models.list().data
    for m in models:
        Model.model_validate(m.model_dump(mode="json"), strict=True)
    core = sdk.models.retrieve("kettei-core")
    assert core.owned_by and core.created > 0
    assert core.model_extra["capabilities"]["tools"] is True
    answer = sdk.chat.completions.create(
        model="kettei-core", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_errors_are_typed_and_say_whether_to_retry(gateway):
    key = gateway.org("errors")
    sent: list[int] = []
    counting = httpx.Client(event_hooks={"response": [lambda r: sent.append(r.status_code)]})
    sdk = client(gateway, key, http_client=counting)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(model="nope", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as unknown:
        sdk.chat.completions.create(
            model="kettei-core", messages=MESSAGES, extra_body={"temprature": 1}
        )
    assert unknown.value.code == "unknown_field" and unknown.value.param == "temprature"
    sent.clear()
    headers = {"Idempotency-Key": "compat-conflict-1"}
    sdk.chat.completions.create(
        model="kettei-core", messages=MESSAGES, max_tokens=2, extra_headers=headers
    )
    with pytest.raises(openai.ConflictError) as conflict:
        sdk.chat.completions.create(
            model="kettei-core", messages=MESSAGES, max_tokens=3, extra_headers=headers
        )
    assert conflict.value.code == "idempotency_conflict"
    assert conflict.value.response.headers["x-should-retry"] == "false"
    assert sent == [200, 409]  # the SDK did not retry the conflict
