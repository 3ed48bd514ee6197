"""Tool and ``json_schema`` grammars as llama.cpp's own sampler runs them, on the real vocabulary.

Every schema here is one the dialects accept (pydantic's ``$defs``, enums,
nested models, ``anyOf``, recursion): its grammar must resolve it, let
through exactly the JSON it describes, in the schema's property order, with
no raw control character inside a string.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from batchyard.engines.llama_sampling import grammar_for
from batchyard.engines.model_files import default_model_path
from batchyard.engines.tool_calls import answer_schema
from tests.support.grammar_check import Vocab
from tests.unit.engines.test_tool_calls import QUERY, WEATHER

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def vocab() -> Iterator[Vocab]:
    v = Vocab(default_model_path())
    yield v
    v.close()


def grammar(schema: dict[str, Any] | None, param: str = "tools") -> str:
    text = grammar_for(schema, param=param)._grammar
    assert isinstance(text, str)
    return text


CALL = (
    '{"name": "Query", "arguments": {"table_name": "users", '
    '"conditions": [{"column": "age", "operator": ">", "value": 30}]}}'
)


def test_a_pydantic_tool_with_an_enum_and_a_nested_model_is_constrained_as_written(
    vocab: Vocab,
) -> None:
    g = grammar(answer_schema([WEATHER, QUERY], "auto"))
    assert vocab.compiles(g)
    assert vocab.accepts(g, CALL)
    assert vocab.accepts(g, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert vocab.accepts(g, '{"content": "No tool fits."}')
    assert not vocab.accepts(g, CALL.replace('">"', '"~"')), "the enum is enforced"
    assert not vocab.accepts(g, CALL.replace("30", "[30]")), "the anyOf is enforced"
    assert not vocab.accepts(g, '{"name": "Nova", "arguments": {}}'), "only offered tools"
    assert not vocab.accepts(g, '{"name": "get_weather", "arguments": {}}'), "required args"


def test_required_leaves_no_room_for_a_reply(vocab: Vocab) -> None:
    g = grammar(answer_schema([WEATHER, QUERY], "required"))
    assert vocab.accepts(g, CALL)
    assert not vocab.accepts(g, '{"content": "No tool fits."}')


def test_every_string_is_json(vocab: Vocab) -> None:
    g = grammar(answer_schema([WEATHER], "auto"))
    assert vocab.accepts(g, '{"content": "line one\\nline two \\u00e9"}')
    assert not vocab.accepts(g, '{"content": "line one\nline two"}')
    assert not vocab.accepts(g, '{"content": "a\tb"}')
    anything = grammar(
        {"type": "object", "properties": {"x": {}}, "required": ["x"]}, "response_format"
    )
    assert vocab.accepts(anything, '{"x": {"k": ["v", 1, null]}}')
    assert not vocab.accepts(anything, '{"x": {"k": "v\nw"}}')


def test_properties_come_in_the_schemas_order(vocab: Vocab) -> None:
    schema = {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": {"type": "string"}},
            "final_answer": {"type": "string"},
        },
        "required": ["steps", "final_answer"],
        "additionalProperties": False,
    }
    g = grammar(schema, "response_format")
    assert vocab.accepts(g, '{"steps": ["add"], "final_answer": "4"}')
    assert not vocab.accepts(g, '{"final_answer": "4", "steps": ["add"]}')


def test_an_untyped_property_is_any_value_not_only_an_object(vocab: Vocab) -> None:
    g = grammar(
        {"type": "object", "properties": {"x": {"title": "X"}}, "required": ["x"]},
        "response_format",
    )
    for value in ('"text"', "3", "true", "null", "[1]", '{"a": 1}'):
        assert vocab.accepts(g, '{"x": ' + value + "}"), value


def test_a_recursive_schema_and_definitions_resolve(vocab: Vocab) -> None:
    tree = {
        "definitions": {
            "node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/definitions/node"}},
                },
                "required": ["label", "children"],
            }
        },
        "$ref": "#/definitions/node",
    }
    g = grammar(tree, "response_format")
    assert vocab.accepts(g, '{"label": "a", "children": [{"label": "b", "children": []}]}')
    assert not vocab.accepts(g, '{"label": "a", "children": [{"label": "b"}]}')


def test_two_tools_defining_the_same_name_keep_their_own(vocab: Vocab) -> None:
    def tool(name: str, values: list[str]) -> dict[str, Any]:
        params = {
            "$defs": {"Mode": {"type": "string", "enum": values}},
            "type": "object",
            "properties": {"mode": {"$ref": "#/$defs/Mode"}},
            "required": ["mode"],
        }
        return {"type": "function", "function": {"name": name, "parameters": params}}

    g = grammar(answer_schema([tool("a", ["x"]), tool("b", ["y"])], "required"))
    assert vocab.accepts(g, '{"name": "a", "arguments": {"mode": "x"}}')
    assert vocab.accepts(g, '{"name": "b", "arguments": {"mode": "y"}}')
    assert not vocab.accepts(g, '{"name": "b", "arguments": {"mode": "x"}}')
