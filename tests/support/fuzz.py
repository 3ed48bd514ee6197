"""Bodies for the fuzz suite: Hypothesis strategies from the request models, and malformed bytes.

``from_model`` reads a Pydantic model's JSON schema and draws documents of
that shape, with values chosen to hurt: empty and very long strings, NUL
characters, lone surrogates, digits from other scripts, integers past 2^63,
NaN and infinities, lists where a string goes. ``mutations`` takes one valid
body and breaks it one way at a time (a field dropped, renamed, retyped,
poisoned). ``MALFORMED`` are whole bodies no JSON parser should accept the
way Python's does by default. Bodies are serialised by ``encode`` with
``ensure_ascii`` (so a lone surrogate travels as ``\\ud800``) and NaN allowed,
because the point is to send what a careless or hostile client would.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

__all__ = [
    "MALFORMED",
    "WRONG_TYPES",
    "encode",
    "from_model",
    "json_values",
    "mutations",
    "nasty_strings",
]

NASTY_STRINGS = [
    "",
    " ",
    "a" * 300,
    "\x00",
    "name\x00",
    "\ud800",
    "x\udfffy",
    "١٢٣",  # Arabic-Indic digits
    "²",
    "𝟙",
    "NaN",
    "Infinity",
    "null",
    "-1",
    "9" * 40,
    "kettei-core",
    "text",
    "chat-sft",
    "field",
    "dataset",
    "messages",
    "single_turn",
    "base",
    "version",
    "user",
    "24h",
    "redact",
    "ds.00000000-0000-7000-8000-000000000000",
]
HUGE_INTS = [0, -1, 1, 2**31, 2**31 - 1, 2**53 + 1, 2**63, -(2**63) - 1, 10**30, 10**100]
ODD_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 0.5, 1e-320]
#: A value of each JSON type, for "a list where a string goes" and its cousins.
WRONG_TYPES: list[Any] = [None, True, 0, 1.5, "s", [], ["s"], {}, {"k": "v"}, 10**30]


def nasty_strings() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(NASTY_STRINGS), st.text(max_size=12))


def _numbers() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(HUGE_INTS),
        st.sampled_from(ODD_FLOATS),
        st.integers(-1000, 1000),
        st.floats(allow_nan=False, allow_infinity=False, width=32),
    )


def json_values(depth: int = 2) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), _numbers(), nasty_strings())
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(nasty_strings(), inner, max_size=3)
        ),
        max_leaves=4 * depth,
    )


def from_model(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """Documents of ``model``'s shape (its JSON schema), with hostile values."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    strategy: st.SearchStrategy[dict[str, Any]] = _strategy(schema, defs)
    return strategy


def _strategy(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        return st.deferred(lambda: _strategy(defs[schema["$ref"].split("/")[-1]], defs))
    if "anyOf" in schema:
        return st.one_of([_strategy(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if props is None:  # dict[str, Any]
            return st.dictionaries(nasty_strings(), json_values(), max_size=3)
        required = set(schema.get("required", ()))
        fields = {k: _strategy(v, defs) for k, v in props.items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "array":
        return st.lists(_strategy(schema.get("items", {}), defs), max_size=3)
    if kind == "string":
        return nasty_strings()
    if kind == "integer":
        return st.one_of(st.sampled_from(HUGE_INTS), st.integers(-10, 5000))
    if kind == "number":
        return _numbers()
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return json_values()


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*path, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replace(copy[head], rest, new)
    return copy


def _drop(value: Any, path: tuple[Any, ...]) -> Any:
    head, rest = path[0], path[1:]
    if rest:
        if isinstance(value, dict):
            return {**value, head: _drop(value[head], rest)}
        copy = list(value)
        copy[head] = _drop(copy[head], rest)
        return copy
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k != head}
    return [v for i, v in enumerate(value) if i != head]


def mutations(valid: dict[str, Any]) -> st.SearchStrategy[Any]:
    """``valid`` broken one way: a value retyped or poisoned, a field dropped or misspelt."""
    paths = _paths(valid)
    retyped = st.builds(
        lambda p, v: _replace(valid, p, v),
        st.sampled_from(paths),
        st.one_of(st.sampled_from(WRONG_TYPES), nasty_strings(), _numbers()),
    )
    dropped = st.builds(lambda p: _drop(valid, p), st.sampled_from(paths))

    def misspell(p: tuple[Any, ...], extra: str) -> Any:
        parent = p[:-1]
        target: Any = valid
        for part in parent:
            target = target[part]
        if not isinstance(target, dict):
            return valid
        return _replace(valid, parent, {**target, str(p[-1]) + extra: target[p[-1]]})

    misspelt = st.builds(misspell, st.sampled_from(paths), st.sampled_from(["_", "s", "X"]))
    return st.one_of(retyped, dropped, misspelt)


def encode(body: Any) -> bytes:
    """What a client that does not check sends: NaN allowed, surrogates escaped."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode("utf-8")


#: Whole bodies: each a way a JSON body can be wrong, by name.
MALFORMED: dict[str, bytes] = {
    "nan": b'{"name": NaN}',
    "infinity": b'{"name": Infinity, "minutes": -Infinity}',
    "overflowing float": b'{"minutes": 1e400, "name": "x"}',
    "lone surrogate": b'{"name": "\\ud800", "model": "\\udfff"}',
    "nul": b'{"name": "a\\u0000b", "model": "\\u0000"}',
    "deep nesting": b"[" * 50_000,
    "deep objects": b'{"a":' * 40 + b"1" + b"}" * 40,
    "huge int": b'{"minutes": ' + b"9" * 5000 + b"}",
    "duplicate key": b'{"name": "a", "name": "b"}',
    "not utf-8": b'{"name": "\xff\xfe"}',
    "utf-16": '{"name": "x"}'.encode("utf-16"),
    "truncated": b'{"name": "x"',
    "empty": b"",
    "whitespace": b" \n ",
    "array": b'["name"]',
    "string": b'"name"',
    "number": b"42",
    "null": b"null",
    "trailing garbage": b'{"name": "x"} {"name": "y"}',
    "comment": b'{"name": "x" /* hi */}',
    "single quotes": b"{'name': 'x'}",
}
