"""LangChain, LiteLLM and instructor, as their users call them, against a live batchyard."""

from __future__ import annotations

import instructor
import litellm
import openai
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

pytestmark = pytest.mark.model


class Person(BaseModel):
    name: str
    age: int


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


def chat(gateway, key: str, *, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(model="kettei-core", base_url=gateway.url, api_key=key, max_tokens=max_tokens)


def test_langchain_batch_of_eight(gateway):
    llm = chat(gateway, gateway.org("lc-batch"), max_tokens=4)
    answers = llm.batch([f"Say hi to number {i}" for i in range(8)])
    assert len(answers) == 8
    assert all(a.response_metadata["finish_reason"] in ("stop", "length") for a in answers)


def test_langchain_stream(gateway):
    llm = chat(gateway, gateway.org("lc-stream"), max_tokens=8)
    chunks = list(llm.stream("Say hi"))
    assert len([c for c in chunks if c.content]) >= 2
    whole = sum(chunks[1:], chunks[0])
    assert isinstance(whole, AIMessageChunk) and whole.content


def test_langchain_bind_tools_round_trip(gateway):
    llm = chat(gateway, gateway.org("lc-tools"), max_tokens=40)
    asked = [HumanMessage("What is the weather in Paris?")]
    first = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(asked)
    call = first.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    second = llm.bind_tools([get_weather]).invoke([*asked, first, result])
    assert second.content or second.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(gateway, method):
    llm = chat(gateway, gateway.org(f"lc-struct-{method}"), max_tokens=40)
    person = llm.with_structured_output(Person, method=method).invoke(
        "Jason is 25 years old. Extract the person."
    )
    assert isinstance(person, Person) and isinstance(person.age, int)


def test_litellm_completion_with_streaming(gateway):
    key = gateway.org("litellm")
    plain = litellm.completion(
        model="openai/kettei-core",
        api_base=gateway.url,
        api_key=key,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=6,
    )
    assert plain.choices[0].message.content
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in litellm.completion(
            model="openai/kettei-core",
            api_base=gateway.url,
            api_key=key,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=8,
            stream=True,
        )
        if chunk.choices
    ]
    assert len([p for p in pieces if p]) >= 2 and "".join(pieces)


def test_instructor_default_tools_mode_returns_a_typed_object(gateway):
    sdk = instructor.from_openai(openai.OpenAI(base_url=gateway.url, api_key=gateway.org("inst")))
    assert sdk.mode == instructor.Mode.TOOLS
    person = sdk.chat.completions.create(
        model="kettei-core",
        response_model=Person,
        messages=[{"role": "user", "content": "Jason is 25 years old. Extract the person."}],
        max_tokens=40,
    )
    assert isinstance(person, Person) and isinstance(person.age, int)
