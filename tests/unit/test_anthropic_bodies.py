"""Anthropic's Messages bodies: checked strictly, translated into the engines' OpenAI shape."""

from __future__ import annotations

import pytest

from batchyard.core.anthropic_bodies import (
    error_type,
    parse_count_tokens,
    parse_messages,
    stop_reason,
    to_openai_messages,
    to_openai_tool_choice,
    to_openai_tools,
    translate,
)
from batchyard.engines.protocol import Choice, Completion, Usage
from batchyard.errors import CapabilityUnsupported, InvalidRequest, UnknownField
from batchyard.work.openai_wire import anthropic_message

BASE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def test_system_blocks_images_and_a_tool_round_trip_become_openai_messages():
    req = parse_messages(
        {
            **BASE,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "bad",
                            "is_error": True,
                        }
                    ],
                },
            ],
        }
    )
    out = to_openai_messages(req)
    assert out[0] == {"role": "system", "content": "a\nb"}
    assert out[1]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AA=="},
    }
    assert out[2] == {
        "role": "assistant",
        "content": "calling",
        "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}
        ],
    }
    assert out[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: bad"}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_tool_choice_maps_onto_openais(choice, expected):
    req = parse_messages({**BASE, "tools": [TOOL], "tool_choice": choice})
    assert to_openai_tool_choice(req) == expected
    assert to_openai_tools(req) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]


@pytest.mark.parametrize(
    ("change", "error", "param"),
    [
        ({"max_tokens": None}, InvalidRequest, "max_tokens"),
        ({"max_tokens": "8"}, InvalidRequest, "max_tokens"),
        ({"temperature": 1.5}, InvalidRequest, "temperature"),
        ({"n": 2}, UnknownField, "n"),
        ({"stop_sequences": [""]}, InvalidRequest, "stop_sequences.0"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            CapabilityUnsupported,
            "thinking",
        ),
        (
            {"tool_choice": {"type": "tool", "name": "g"}, "tools": [TOOL]},
            InvalidRequest,
            "tool_choice.name",
        ),
        ({"tools": [{"name": "f"}]}, InvalidRequest, "tools.0.input_schema"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
            UnknownField,
            "messages.0.content.0.y",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
                ]
            },
            InvalidRequest,
            "messages.0.content.0.type",
        ),
    ],
)
def test_bad_bodies_are_coded_and_name_the_field(change, error, param):
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(error) as got:
        parse_messages(body)
    assert got.value.param == param


def test_a_tool_named_twice_is_refused_by_what_is_wrong_with_it():
    """The message names the duplicate (it once said the name had to be non-empty)."""
    with pytest.raises(InvalidRequest) as got:
        parse_messages({**BASE, "tools": [TOOL, TOOL]})
    assert got.value.param == "tools.1.name"
    assert "is given twice" in str(got.value) and repr(TOOL["name"]) in str(got.value)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (501, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_one_error_type_a_status_for_the_door_and_a_batchs_results(status, kind):
    """A status the table does not name is a request error below 500, in a batch result too."""
    assert error_type(status) == kind


def test_count_tokens_takes_no_max_tokens():
    assert parse_count_tokens({"model": "m", "messages": BASE["messages"]}).model == "m"
    with pytest.raises(UnknownField):
        parse_count_tokens({**BASE})


def test_the_message_object_and_its_stop_reasons():
    call = {"id": "call_9", "function": {"name": "f", "arguments": '{"a": 2}'}}
    called = Completion("m", [Choice("", "tool_calls", tool_calls=[call])], Usage(3, 4))
    msg = anthropic_message(id="msg.1", model="m", completion=called, stops=None)
    assert msg["content"] == [{"type": "tool_use", "id": "toolu_9", "name": "f", "input": {"a": 2}}]
    assert msg["stop_reason"] == "tool_use" and msg["usage"]["input_tokens"] == 3
    assert [stop_reason(f) for f in ("stop", "length", "tool_calls")] == [
        "end_turn",
        "max_tokens",
        "tool_use",
    ]
    ended = Completion("m", [Choice("x", stop_sequence="END")], Usage(1, 1))
    stopped = anthropic_message(id="msg.2", model="m", completion=ended, stops=["END"])
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")


@pytest.mark.parametrize(
    "field",
    [
        {"container": {"id": "c"}},
        {"context_management": {"edits": []}},
        {"thread": {"id": "t"}},
        {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]},
        {"inference_geo": "us"},
        {"fallbacks": [{"model": "x"}]},
    ],
)
def test_every_field_the_newest_sdk_sends_is_served_or_refused_by_name(field):
    """A documented field is never ``unknown_field``: unserved ones are named as such."""
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(CapabilityUnsupported) as err:
        parse_messages({**body, **field})
    assert err.value.param == next(iter(field))


def test_structured_outputs_are_the_openai_doors_json_schema_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    wanted = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    for given in (
        {"output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}},
        {"output_format": {"type": "json_schema", "schema": schema}},
    ):
        assert translate(parse_messages({**body, **given})).response_format == wanted
    for off in ({"thinking": {"type": "disabled"}}, {"mcp_servers": []}, {"speed": "fast"}):
        assert translate(parse_messages({**body, **off})).response_format is None


def test_the_hints_a_tool_and_its_blocks_may_carry_are_accepted_and_change_nothing():
    """docs/reference/messages.md: a tool's runner hints are accepted, as the shapes declare."""
    hints = {"allowed_callers": ["direct"], "defer_loading": False, "input_examples": [{}]}
    turns = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}, "caller": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": "ok", "toolset_name": "s"}
            ],
        },
    ]
    got = translate(parse_messages({**BASE, "tools": [{**TOOL, **hints}], "messages": turns}))
    assert got.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert got.messages[2] == {"role": "tool", "tool_call_id": "t", "content": "ok"}
