"""The row filter language: each operator, JSON's types, and clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchyard.core.filters import compile_filter
from batchyard.errors import InvalidFilter

ROW = {"lang": "en", "n": 3, "flag": True, "none": None, "meta": {"src": "web"}, "tags": ["a"]}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, True),
        ({"field": "lang", "eq": "en"}, True),
        ({"field": "lang", "eq": "fr"}, False),
        ({"field": "lang", "ne": "fr"}, True),
        ({"field": "missing", "ne": "fr"}, False),
        ({"field": "n", "eq": 3.0}, True),
        ({"field": "flag", "eq": 1}, False),
        ({"field": "n", "eq": True}, False),
        ({"field": "flag", "eq": True}, True),
        ({"field": "none", "eq": None}, True),
        ({"field": "missing", "eq": None}, False),
        ({"field": "tags", "eq": "a"}, False),
        ({"field": "lang", "in": ["fr", "en"]}, True),
        ({"field": "lang", "in": []}, False),
        ({"field": "meta.src", "eq": "web"}, True),
        ({"field": "lang.x", "exists": True}, False),
        ({"field": "meta", "exists": True}, True),
        ({"field": "answer", "exists": False}, True),
        ({"and": [{"field": "lang", "eq": "en"}, {"field": "n", "in": [3]}]}, True),
        ({"and": [{"field": "lang", "eq": "en"}, {"field": "n", "in": [4]}]}, False),
        ({"or": [{"field": "lang", "eq": "fr"}, {"field": "n", "in": [3]}]}, True),
        ({"not": {"field": "lang", "eq": "en"}}, False),
    ],
)
def test_each_operator_selects_as_documented(spec, expected):
    assert compile_filter(spec)(ROW) is expected


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        ("lang", "filter"),
        ({"field": "lang"}, "filter"),
        ({"field": "", "eq": 1}, "filter.field"),
        ({"field": "a..b", "eq": 1}, "filter.field"),
        ({"field": "lang", "eq": {"x": 1}}, "filter.eq"),
        ({"field": "lang", "in": "en"}, "filter.in"),
        ({"field": "lang", "in": [[1]]}, "filter.in[0]"),
        ({"field": "lang", "exists": "yes"}, "filter"),
        ({"field": "lang", "gt": 1}, "filter"),
        ({"and": []}, "filter.and"),
        ({"or": [{"field": "x", "eq": 1}, 3]}, "filter.or[1]"),
        ({"and": [1], "or": [1]}, "filter"),
    ],
)
def test_malformed_filters_are_invalid_filter_naming_the_part(spec, param):
    with pytest.raises(InvalidFilter) as info:
        compile_filter(spec)
    assert info.value.code == "invalid_filter"
    assert info.value.status == 400
    assert info.value.param == param


def test_nesting_is_bounded():
    spec: dict = {"field": "x", "eq": 1}
    for _ in range(40):
        spec = {"not": spec}
    with pytest.raises(InvalidFilter, match="deeper"):
        compile_filter(spec)


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5))


@given(value=json_scalars, other=json_scalars)
def test_not_eq_is_ne_for_present_fields_and_no_row_makes_it_raise(value, other):
    row = {"x": value}
    eq = compile_filter({"field": "x", "eq": other})(row)
    assert compile_filter({"not": {"field": "x", "eq": other}})(row) is (not eq)
    assert compile_filter({"field": "x", "ne": other})(row) is (not eq)
    assert compile_filter({"field": "x", "in": [other]})(row) is eq
