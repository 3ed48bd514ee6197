"""A JSON schema rewritten for llama.cpp's converter, or refused with a coded 400."""

from __future__ import annotations

from typing import Any

import pytest

from batchyard.engines.json_grammar import gbnf, resolved
from batchyard.engines.llama_sampling import grammar_for
from batchyard.errors import InvalidRequest


def test_references_point_into_one_root_defs_and_annotations_go() -> None:
    defs: dict[str, Any] = {}
    schema = {
        "title": "Step",
        "type": "object",
        "properties": {"kind": {"$ref": "#/$defs/Kind", "description": "which"}},
        "$defs": {"Kind": {"enum": ["a", "b"], "title": "Kind"}},
    }
    out = resolved(schema, defs, prefix="def-", param="p")
    assert out == {"type": "object", "properties": {"kind": {"$ref": "#/$defs/def-Kind"}}}
    assert defs == {"def-Kind": {"enum": ["a", "b"]}}


def test_a_property_named_like_a_keyword_is_a_property() -> None:
    schema = {"type": "object", "properties": {"$ref": {"type": "string"}, "enum": {}}}
    out = resolved(schema, {}, prefix="def-", param="p")
    assert out["properties"]["$ref"] == {"type": "string"}
    assert out["properties"]["enum"]["type"][0] == "object"  # {}: any value


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}, "does not resolve"),
        ({"properties": {"a": {"$ref": "other.json#/x"}}}, "not supported"),
        ({"type": 3}, "not a valid JSON schema"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "compiled"),
    ],
)
def test_what_cannot_become_a_grammar_is_a_coded_400(schema: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        grammar_for(schema)
    assert info.value.code == "unsupported_schema"
    assert info.value.param == "response_format.json_schema.schema"
    assert why in info.value.message


def test_the_grammar_keeps_the_schemas_order_and_jsons_strings() -> None:
    text = gbnf(
        {
            "type": "object",
            "properties": {"steps": {"type": "string"}, "final_answer": {"type": "string"}},
            "required": ["steps", "final_answer"],
        },
        param=None,
    )
    root = next(line for line in text.splitlines() if line.startswith("root ::= "))
    assert root.index("steps-kv") < root.index("final-answer-kv")
    char = next(line for line in text.splitlines() if line.startswith("char ::= "))
    assert r"\x00-\x1F" in char
