"""Strict JSON and strict shapes (``core.inputs``): what every door refuses, and how it says so."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchyard.core.inputs import MAX_DEPTH, Shape, parse_json, printable, strict
from batchyard.errors import InvalidJson, InvalidRequest, InvalidType, UnknownField


@pytest.mark.parametrize(
    "raw",
    [
        b"NaN",
        b'{"a": Infinity}',
        b'{"a": -Infinity}',
        b'{"a": 1e400}',
        b'{"a": "\\ud800"}',
        b'{"\\udc00": 1}',
        b'{"a": 1, "a": 2}',
        b'{"a": "\xff"}',
        b"[" * 50_000,
        b"[" * (MAX_DEPTH + 2) + b"]" * (MAX_DEPTH + 2),
        b"",
        b"9" * 5000,
    ],
)
def test_what_strict_json_refuses(raw):
    with pytest.raises(InvalidJson):
        parse_json(raw)


def test_a_nul_character_has_its_own_code_and_path():
    with pytest.raises(InvalidRequest) as caught:
        parse_json(b'{"a": [{"b": "x\\u0000"}]}')
    assert (caught.value.code, caught.value.param) == ("unsupported_character", "a.0.b")


def test_what_it_keeps():
    assert parse_json(b'{"a": [1, 2.5, "\\u00e9", true, null], "b": {"c": -0}}') == {
        "a": [1, 2.5, "é", True, None],
        "b": {"c": 0},
    }
    deep = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_json(deep) is not None


@settings(max_examples=200, derandomize=True, database=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), lambda x: st.lists(x)))
def test_any_json_text_either_parses_or_is_refused_with_a_code(value):
    import json

    text = json.dumps(value)
    try:
        assert parse_json(text) == json.loads(text)
    except InvalidRequest as exc:
        assert exc.code in ("invalid_json", "unsupported_character")
        exc.to_body()


class Body(Shape):
    name: str
    count: int | None = None
    ratio: float | None = None


@pytest.mark.parametrize(
    ("raw", "cls", "param"),
    [
        ({"name": "x", "nmae": 1}, UnknownField, "nmae"),
        ({"name": ["x"]}, InvalidType, "name"),
        ({"name": "x", "count": True}, InvalidType, "count"),
        ({"name": "x", "count": "5"}, InvalidType, "count"),
        ({"name": "x", "ratio": "0.5"}, InvalidType, "ratio"),
        ({}, InvalidRequest, "name"),
    ],
)
def test_a_shape_coerces_nothing_and_names_the_field(raw, cls, param):
    with pytest.raises(cls) as caught:
        strict(Body, raw, prefix="")
    assert type(caught.value) is cls and caught.value.param == param


def test_an_int_is_a_float_but_never_the_reverse():
    assert strict(Body, {"name": "x", "ratio": 1}).ratio == 1.0
    with pytest.raises(InvalidType):
        strict(Body, {"name": "x", "count": 1.0})


def test_echoed_input_is_always_printable():
    assert printable("a\ud800b\x00c") == "a\\ud800b\\x00c"
    assert len(printable("x" * 1000)) == 80
