"""A grammar-constrained tool answer read back: a call only when it names an offered tool and
its arguments validate; anything else is the model's text, never an error."""

from __future__ import annotations

from typing import Any

import pytest

from batchyard.engines.tool_calls import answer_schema, parse_answer
from batchyard.errors import InvalidRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

# What openai.pydantic_function_tool writes for a model with an enum and a nested model.
QUERY: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "Query",
        "strict": True,
        "parameters": {
            "$defs": {
                "Operator": {"enum": ["=", ">", "<"], "title": "Operator", "type": "string"},
                "Condition": {
                    "properties": {
                        "column": {"title": "Column", "type": "string"},
                        "operator": {"$ref": "#/$defs/Operator"},
                        "value": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                    },
                    "required": ["column", "operator", "value"],
                    "title": "Condition",
                    "type": "object",
                    "additionalProperties": False,
                },
            },
            "properties": {
                "table_name": {"title": "Table Name", "type": "string"},
                "conditions": {"items": {"$ref": "#/$defs/Condition"}, "type": "array"},
            },
            "required": ["table_name", "conditions"],
            "title": "Query",
            "type": "object",
            "additionalProperties": False,
        },
    },
}


def read(text: str, finish: str = "stop", tools: list[dict[str, Any]] | None = None) -> Any:
    return parse_answer(text, tools or [WEATHER], "auto", finish_reason=finish)


def test_a_plain_reply_cut_at_max_tokens_comes_back_as_far_as_it_was_written() -> None:
    assert read('{"content": "The weather in Paris is sun', "length") == (
        "The weather in Paris is sun",
        None,
    )


@pytest.mark.parametrize(
    ("cut", "kept"),
    [('{"content":"a\\', "a"), ('{"content":"caf\\u00e', "caf"), ('{"content": "', "")],
)
def test_an_escape_cut_in_two_is_left_out(cut: str, kept: str) -> None:
    assert read(cut, "length") == (kept, None)


def test_a_cut_tool_call_is_its_text_not_an_error() -> None:
    cut = '{"name": "get_weather", "argu'
    assert read(cut, "length") == (cut, None)


def test_a_slip_that_is_not_json_is_its_text() -> None:
    assert read('{"content": "half', "stop") == ('{"content": "half', None)


def test_whole_answers_parse_as_before() -> None:
    assert read('{"content": "hi"}') == ("hi", None)
    text, calls = read('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert text == "" and calls is not None
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_a_tool_nobody_offered_is_no_call() -> None:
    answer = '{"name": "Nova", "arguments": {}}'
    assert read(answer) == (answer, None)


def test_arguments_that_do_not_validate_are_no_call() -> None:
    for answer in (
        '{"name": "get_weather", "arguments": {}}',
        '{"name": "get_weather", "arguments": {"city": 3}}',
        '{"name": "get_weather", "arguments": {"city": "Oslo", "extra": 1}}',
        '{"name": "get_weather", "arguments": "Oslo"}',
    ):
        assert read(answer) == (answer, None)


def test_arguments_are_validated_through_the_tools_own_defs() -> None:
    good = (
        '{"name": "Query", "arguments": {"table_name": "users", "conditions": '
        '[{"column": "age", "operator": ">", "value": 30}]}}'
    )
    text, calls = read(good, tools=[QUERY])
    assert text == "" and calls is not None and calls[0]["function"]["name"] == "Query"
    bad = good.replace('">"', '"~"')
    assert read(bad, tools=[QUERY]) == (bad, None)


def test_a_named_tool_choice_admits_only_that_tool() -> None:
    answer = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    choice = {"type": "function", "function": {"name": "Query"}}
    assert parse_answer(answer, [WEATHER, QUERY], choice, finish_reason="stop") == (answer, None)


def test_the_answer_schema_keeps_each_tools_defs_resolvable() -> None:
    schema = answer_schema([WEATHER, QUERY], "auto")
    assert schema is not None
    query = schema["anyOf"][1]["properties"]["arguments"]
    condition_ref = query["properties"]["conditions"]["items"]["$ref"]
    condition = schema["$defs"][condition_ref.removeprefix("#/$defs/")]
    operator = schema["$defs"][condition["properties"]["operator"]["$ref"].removeprefix("#/$defs/")]
    assert operator == {"enum": ["=", ">", "<"], "type": "string"}
    # The schema's own order: the table before its conditions.
    assert list(query["properties"]) == ["table_name", "conditions"]
    assert list(schema["anyOf"][1]["properties"]) == ["name", "arguments"]


def test_two_tools_with_a_def_of_the_same_name_keep_their_own() -> None:
    def tool(name: str, values: list[str]) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "$defs": {"Mode": {"enum": values}},
                    "type": "object",
                    "properties": {"mode": {"$ref": "#/$defs/Mode"}},
                },
            },
        }

    schema = answer_schema([tool("a", ["x"]), tool("b", ["y"])], "required")
    assert schema is not None
    refs = [alt["properties"]["arguments"]["properties"]["mode"]["$ref"] for alt in schema["anyOf"]]
    assert refs[0] != refs[1]
    assert [schema["$defs"][r.removeprefix("#/$defs/")] for r in refs] == [
        {"enum": ["x"]},
        {"enum": ["y"]},
    ]


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}},
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}},
        {"type": "object", "properties": {"a": {"type": "strnig"}}},
    ],
)
def test_a_schema_that_cannot_be_resolved_is_refused_naming_the_tool(
    parameters: dict[str, Any],
) -> None:
    tools = [WEATHER, {"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(InvalidRequest) as info:
        answer_schema(tools, "auto")
    assert info.value.code == "unsupported_schema"
    assert info.value.param == "tools.1.function.parameters"
