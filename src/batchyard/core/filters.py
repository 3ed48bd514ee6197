"""The row filter language of batch inference runs.

A run answers the rows a filter selects. The language is small on purpose: it
is evaluated in Python over each row's JSON object while a quote is prepared,
so every operator must be cheap, total (no row can make it raise) and easy to
explain in one table::

    {"field": "lang", "eq": "en"}            field equals a JSON scalar
    {"field": "lang", "ne": "en"}            field is present and differs
    {"field": "tier", "in": ["gold", 3]}     field equals one of the scalars
    {"field": "answer", "exists": true}      field is present (false: absent)
    {"and": [f, ...]}  {"or": [f, ...]}  {"not": f}

``field`` names a top-level key, or a nested one with dots (``meta.lang``).
A missing field equals nothing (so ``eq`` and ``in`` are false and ``ne`` is
false too: absence is asked about with ``exists``). Comparisons follow JSON:
``true`` is not ``1``, and ``1`` equals ``1.0``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from batchyard.errors import InvalidFilter

__all__ = ["MAX_DEPTH", "MAX_LIST", "RowFilter", "compile_filter", "match_all"]

RowFilter = Callable[[Mapping[str, Any]], bool]

MAX_DEPTH = 16
MAX_LIST = 1000
_MISSING = object()


def match_all(_: Mapping[str, Any]) -> bool:
    return True


def _lookup(row: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = row
    for part in path:
        if not isinstance(value, Mapping):
            return _MISSING
        value = value.get(part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def _key(value: Any) -> tuple[str, Any]:
    """A hashable key that keeps JSON's types apart (``true`` is not ``1``)."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    if value is None:
        return ("null", None)
    return ("string", value)


def _scalar(value: Any, where: str) -> tuple[str, Any]:
    if value is not None and not isinstance(value, str | int | float | bool):
        raise InvalidFilter(
            f"{where} must be a JSON scalar (string, number, boolean or null)", param=where
        )
    return _key(value)


def _field(node: Mapping[str, Any], where: str) -> tuple[str, ...]:
    name = node.get("field")
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InvalidFilter(f"{where}.field must be a non-empty field name", param=f"{where}.field")
    parts = tuple(name.split("."))
    if any(not p for p in parts):
        raise InvalidFilter(f"{where}.field {name!r} has an empty segment", param=f"{where}.field")
    return parts


def _compile(node: Any, where: str, depth: int) -> RowFilter:
    if depth > MAX_DEPTH:
        raise InvalidFilter(f"the filter nests deeper than {MAX_DEPTH} levels", param=where)
    if not isinstance(node, Mapping):
        raise InvalidFilter(f"{where} must be an object", param=where)
    keys = set(node)
    if keys in ({"and"}, {"or"}):
        op = "and" if "and" in node else "or"
        items = node[op]
        if not isinstance(items, list) or not items or len(items) > MAX_LIST:
            raise InvalidFilter(
                f"{where}.{op} must be a list of 1 to {MAX_LIST} filters", param=f"{where}.{op}"
            )
        subs = [_compile(x, f"{where}.{op}[{i}]", depth + 1) for i, x in enumerate(items)]
        if op == "and":
            return lambda row: all(f(row) for f in subs)
        return lambda row: any(f(row) for f in subs)
    if keys == {"not"}:
        inner = _compile(node["not"], f"{where}.not", depth + 1)
        return lambda row: not inner(row)
    if "field" in keys and len(keys) == 2:
        path = _field(node, where)
        (op,) = keys - {"field"}
        arg = node[op]
        if op in ("eq", "ne"):
            want = _scalar(arg, f"{where}.{op}")

            def equals(row: Mapping[str, Any]) -> bool:
                value = _lookup(row, path)
                if value is _MISSING or isinstance(value, dict | list):
                    return False
                return _key(value) == want

            if op == "eq":
                return equals

            def differs(row: Mapping[str, Any]) -> bool:
                return _lookup(row, path) is not _MISSING and not equals(row)

            return differs
        if op == "in":
            if not isinstance(arg, list) or len(arg) > MAX_LIST:
                raise InvalidFilter(
                    f"{where}.in must be a list of at most {MAX_LIST} scalars", param=f"{where}.in"
                )
            wanted = {_scalar(v, f"{where}.in[{i}]") for i, v in enumerate(arg)}

            def member(row: Mapping[str, Any]) -> bool:
                value = _lookup(row, path)
                if value is _MISSING or isinstance(value, dict | list):
                    return False
                return _key(value) in wanted

            return member
        if op == "exists":
            if not isinstance(arg, bool):
                raise InvalidFilter(f"{where}.exists must be true or false", param=where)
            return lambda row: (_lookup(row, path) is not _MISSING) is arg
        raise InvalidFilter(
            f"{where} has unknown operator {op!r}; use eq, ne, in or exists", param=where
        )
    raise InvalidFilter(
        f"{where} must be one of {{field, eq|ne|in|exists}}, {{and: [...]}}, {{or: [...]}} "
        "or {not: ...}",
        param=where,
    )


def compile_filter(spec: Any) -> RowFilter:
    """A predicate over a row's JSON object; ``None`` selects every row.

    Raises ``InvalidFilter`` (400 ``invalid_filter``) naming the offending part.
    """
    if spec is None:
        return match_all
    return _compile(spec, "filter", 0)
