"""Strict JSON and strict shapes: the rules every body obeys, whichever door it came through.

Pure functions (no request, no store) so the API (``api.inputs``), the
workspace's submission form and uploaded dataset files share them:

- strict JSON: UTF-8 only, no ``NaN``/``Infinity`` (and no number so large it
  becomes one), no duplicate keys, no lone surrogates, no NUL characters
  (PostgreSQL cannot store them, and no caller means one), and at most
  ``MAX_DEPTH`` levels of nesting, checked without recursion;
- strict shapes: a body is a Pydantic model (``Shape``: ``strict=True``,
  ``extra="forbid"``), so nothing is coerced (``true`` is not 1, ``"5"`` is
  not 5) and an unknown field is refused by name (``unknown_field``), a
  wrong type is ``invalid_type``, a missing one ``invalid_request``, each
  with ``param`` naming the field.

Why refuse rather than repair: a NaN that was accepted became a run that
could never be read again, and a ``max_token`` typo silently ran a whole
dataset with the default.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from batchyard.errors import BatchyardError, InvalidJson, InvalidRequest, InvalidType, UnknownField

__all__ = [
    "MAX_DEPTH",
    "Coded",
    "Shape",
    "check_document",
    "check_text",
    "parse_json",
    "printable",
    "strict",
]

#: Nesting levels a body may have: deep enough for any real request, far from
#: the recursion limits of the parser and of everything that walks a body.
MAX_DEPTH = 32

_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: Parts of a Pydantic error location that name a union member, not a field.
_TAGS = {"str", "int", "float", "bool", "dict", "list", "tuple", "none", "any", "literal"}

M = TypeVar("M", bound="Shape")


class Shape(BaseModel):
    """A request body's shape: strict types, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    #: The code of a 400 for a field this shape does not know (a door may keep its own).
    unknown_code: ClassVar[str] = UnknownField.code


@dataclass(frozen=True, slots=True)
class Coded:
    """The stable code of a field's 400, where its door documents one of its own.

    Put in the field's ``Annotated`` metadata, beside the constraint it names,
    so the rule, the document and the code are declared once:
    ``Annotated[Literal["1h", "24h"], Coded("invalid_completion_window")]``.
    """

    code: str
    #: What the 400 says the field must be, where the validator's own words are unclear.
    hint: str | None = None


def _field_code(model: type[BaseModel], loc: tuple[Any, ...]) -> Coded | None:
    """The ``Coded`` code of the field ``loc`` names in ``model`` (nested shapes too)."""
    current: Any = model
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or not isinstance(fields, dict) or part not in fields:
            return None
        info = fields[part]
        for meta in info.metadata:
            if isinstance(meta, Coded):
                return meta
        current = info.annotation
        args = [a for a in getattr(current, "__args__", ()) if isinstance(a, type)]
        nested = [a for a in args if issubclass(a, BaseModel)]
        if nested:
            current = nested[0]
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a double")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {printable(key, 60)!r} appears twice in one object")
        out[key] = value
    return out


def printable(text: str, limit: int = 80) -> str:
    """``text`` safe to echo in an error: no lone surrogates, no control characters, short."""
    text = text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def _path(parts: tuple[Any, ...]) -> str:
    return ".".join(printable(str(p), 40) for p in parts) or "body"


def _walk(value: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value of a parsed document with its path, without recursion."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if isinstance(node, dict):
            stack.extend(((*path, k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend(((*path, i), v) for i, v in enumerate(node))


def check_text(text: str, path: tuple[Any, ...], what: str) -> None:
    if _SURROGATE.search(text) is not None:
        raise InvalidJson(
            f"{what} holds a lone surrogate (\\ud800-\\udfff) at {_path(path)}: not Unicode text",
            param=_path(path),
        )
    if "\x00" in text:
        raise InvalidRequest(
            f"{what} holds a NUL character (\\u0000) at {_path(path)}; it cannot be stored",
            param=_path(path),
            code="unsupported_character",
        )


def check_document(value: Any, what: str = "the request body") -> Any:
    """Refuse what strict JSON excludes beyond the grammar: depth, surrogates, NUL."""
    for path, node in _walk(value):
        if len(path) > MAX_DEPTH:
            raise InvalidJson(
                f"{what} nests deeper than {MAX_DEPTH} levels", param=_path(path[:MAX_DEPTH])
            )
        if isinstance(node, str):
            check_text(node, path, what)
        elif isinstance(node, dict):
            for key in node:
                check_text(key, (*path, key), what)
    return value


def parse_json(raw: bytes | str, what: str = "the request body") -> Any:
    """One strict JSON document (see the module docstring); ``InvalidJson`` otherwise."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidJson(f"{what} is not UTF-8 (byte {exc.start})") from None
    else:
        text = raw
    if not text.strip():
        raise InvalidJson(f"{what} is empty; send a JSON object")
    try:
        value = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_finite,
            object_pairs_hook=_no_duplicates,
        )
    except RecursionError:
        raise InvalidJson(f"{what} nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise InvalidJson(f"{what} is not valid JSON: {str(exc)[:200]}") from None
    return check_document(value, what)


def _is_tag(part: Any) -> bool:
    if not isinstance(part, str):
        return False
    return "[" in part or "-" in part or part.lower() in _TAGS or part[:1].isupper()


def _error_of(exc: ValidationError, prefix: str, model: type[BaseModel]) -> BatchyardError:
    first = exc.errors()[0]
    parts = tuple(p for p in first.get("loc", ()) if not _is_tag(p))
    loc = ".".join(printable(str(p), 40) for p in parts)
    param = ".".join(p for p in (prefix, loc) if p) or None
    kind = str(first.get("type", ""))
    where = param or "the body"
    if kind == "extra_forbidden":
        code = getattr(model, "unknown_code", UnknownField.code)
        return UnknownField(f"{where} is not a field of this call", param=param, code=code)
    coded = _field_code(model, parts)
    if coded is not None:
        said = coded.hint or first.get("msg", "invalid")
        return InvalidRequest(f"{where}: {said}", param=param, code=coded.code)
    if kind == "missing":
        return InvalidRequest(f"{where} is required", param=param)
    if kind.endswith("_type") or kind in ("model_attributes_type", "union_tag_invalid"):
        return InvalidType(f"{where}: {first.get('msg', 'wrong type')}", param=param)
    return InvalidRequest(f"{where}: {first.get('msg', 'invalid')}", param=param)


def strict(model: type[M], raw: Any, *, prefix: str = "") -> M:
    """``raw`` as ``model`` (strict, unknown fields refused), or its coded 400."""
    try:
        return model.model_validate(raw, strict=True)
    except ValidationError as exc:
        raise _error_of(exc, prefix, model) from None
