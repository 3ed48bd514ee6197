"""Strict JSON and strict shapes: the rules every body obeys, whichever door it came through.

Pure functions (no request, no store) so the API (``api.context``), the
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
from types import UnionType
from typing import Annotated, Any, ClassVar, TypeVar, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, core_schema

from batchyard.errors import (
    BatchyardError,
    CapabilityUnsupported,
    InvalidJson,
    InvalidRequest,
    InvalidType,
    UnknownField,
)

__all__ = [
    "MAX_DEPTH",
    "SOME_TEXT",
    "SPACE",
    "UNSERVED_TAGS",
    "AsDicts",
    "Coded",
    "Shape",
    "Unserved",
    "check_document",
    "check_text",
    "field",
    "field_error",
    "parse_json",
    "printable",
    "strict",
]

#: Whitespace as ``str.isspace`` knows it, spelled out for a regex character class: ``\s``
#: differs between the document's (ECMA: not U+0085, but U+FEFF) and the server's engines.
SPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
#: A pattern a string matches when it is not only spaces (a name, a question, a text).
SOME_TEXT = rf"[^{SPACE}]"

#: Nesting levels a body may have: deep enough for any real request, far from
#: the recursion limits of the parser and of everything that walks a body.
MAX_DEPTH = 32

_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: Parts of a Pydantic error location that name a union member, not a field.
_TAGS = {"str", "int", "float", "bool", "dict", "list", "tuple", "none", "any", "literal"}

M = TypeVar("M", bound=BaseModel)


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


def field(raw: Any, *path: str) -> Any:
    """``raw[path[0]][path[1]]…`` of a body not yet checked, or None where a step is not an
    object: what a door reads before the shape (the model it names, to answer 404 first)."""
    for key in path:
        raw = raw.get(key) if isinstance(raw, dict) else None
    return raw


def _members(tp: Any) -> list[Any]:
    """The alternatives of a union (each kept with its ``Annotated`` metadata)."""
    if get_origin(tp) in (Union, UnionType):
        return [m for a in get_args(tp) for m in _members(a)]
    return [tp]


def _bare(tp: Any) -> Any:
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _field_code(model: type[BaseModel], loc: tuple[Any, ...]) -> Coded | None:
    """The ``Coded`` of the field ``loc`` ends at in ``model`` (through nested shapes and lists)."""
    current: Any = model
    for n, part in enumerate(loc):
        found: Any = None
        metadata: list[Any] = []
        for member in map(_bare, _members(current)):
            if isinstance(member, FieldInfo):
                metadata += member.metadata
                member = member.annotation
            for alt in _members(member):
                base = _bare(alt)
                fields = getattr(base, "model_fields", None)
                if isinstance(part, str) and isinstance(fields, dict) and part in fields:
                    found = fields[part]
                elif isinstance(part, int) and get_origin(base) is list:
                    found = get_args(base)[0]
                if found is not None:
                    break
            if found is not None:
                break
        if found is None:
            return None
        metadata = list(getattr(found, "metadata", ()))
        annotation = getattr(found, "annotation", found)
        metadata += [m for alt in _members(annotation) for m in getattr(alt, "__metadata__", ())]
        if n == len(loc) - 1:  # the field the error is at, not one it lies inside
            return next((m for m in metadata if isinstance(m, Coded)), None)
        current = found
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


def _whole(text: str) -> float | int:
    """A number with no fraction as an int: JSON Schema's integer (``5.0`` is 5)."""
    value = _finite(text)
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def parse_json(raw: bytes | str, what: str = "the request body", *, request: bool = False) -> Any:
    """One strict JSON document (see the module docstring); ``InvalidJson`` otherwise.

    ``request``: a request's body, read as its OpenAPI document (JSON Schema) reads it,
    where ``5.0`` is the integer 5 (a client's JSON encoder may write either); data a
    caller stores (a dataset's rows) keeps every number as it was written.
    """
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
            parse_float=_whole if request else _finite,
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


def _located(loc: tuple[Any, ...], raw: Any, missing: bool) -> tuple[Any, ...]:
    """The parts of a Pydantic error location that are the body's own keys and indexes.

    A location also names union members and the tags of tagged unions (a message's
    ``role``, a part's ``type``); walking the body itself tells them apart, and where
    a tag is also a key (a ``text`` part's ``text``) the reading that follows the body
    furthest wins. A missing field's name is the last part, not in the body.
    """
    if not loc:
        return ()
    part, rest = loc[0], loc[1:]
    inside = isinstance(node := raw, dict) and part in node
    inside |= isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
    skipped = _located(rest, raw, missing)
    if inside:
        taken = (part, *_located(rest, node[part], missing))
        return taken if len(taken) > len(skipped) else skipped
    if missing and not rest and not _is_tag(part):
        return (part,)
    return skipped


def field_error(
    exc: ValidationError, raw: Any, model: type[BaseModel], prefix: str = ""
) -> BatchyardError:
    """The problem Pydantic found in ``raw``, as a coded 400 naming the field.

    Of the alternatives of a union, the one that got furthest into the body says
    what is wrong (a content part of an unserved type, not "not a string").
    """

    def depth(error: Any) -> tuple[int, bool]:
        kind = str(error.get("type", ""))
        at = _located(tuple(error.get("loc", ())), raw, kind == "missing")
        return len(at), not kind.endswith("_type")

    first = max(exc.errors(), key=depth)
    kind = str(first.get("type", ""))
    parts = _located(tuple(first.get("loc", ())), raw, kind == "missing")
    loc = ".".join(printable(str(p), 40) for p in parts)
    param = ".".join(p for p in (prefix, loc) if p) or None
    where = param or "the body"
    ctx = first.get("ctx") or {}
    if kind == "extra_forbidden":
        code = getattr(model, "unknown_code", UnknownField.code)
        return UnknownField(f"{where} is not a field of this call", param=param, code=code)
    given = first.get("input")
    if kind == "unserved":
        return CapabilityUnsupported(f"{where}: {first.get('msg')}", param=param)
    if kind == "literal_error" and _unserved(given):
        return CapabilityUnsupported(f"{where}: {given} is not supported here", param=param)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        key = str(ctx.get("discriminator", "type")).strip("'")
        tag = ctx.get("tag")
        at = f"{param}.{key}" if param else key
        if _unserved(tag):
            return CapabilityUnsupported(f"{where}: {tag} is not supported here", param=at)
        if kind == "union_tag_not_found":
            return InvalidRequest(f"{at} is required", param=at)
        allowed = ctx.get("expected_tags", "")
        return InvalidRequest(f"{at} must be one of {allowed}", param=at)
    if kind.endswith("_type"):
        return InvalidType(f"{where}: {first.get('msg', 'wrong type')}", param=param)
    coded = _field_code(model, parts)
    if coded is not None:
        said = coded.hint or first.get("msg", "invalid")
        return InvalidRequest(f"{where}: {said}", param=param, code=coded.code)
    if kind == "missing":
        return InvalidRequest(f"{where} is required", param=param)
    return InvalidRequest(f"{where}: {first.get('msg', 'invalid')}", param=param)


#: Tags of tagged unions (content parts, blocks, tools) that a dialect documents but no
#: engine here can honour: refused with ``capability_unsupported``, not as unknown.
UNSERVED_TAGS = frozenset(
    {
        # OpenAI's content parts and tools
        "input_audio",
        "file",
        "custom",
        "allowed_tools",
        # Anthropic's content blocks
        "document",
        "search_result",
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "container_upload",
        "mcp_tool_use",
        "mcp_tool_result",
        "compaction",
    }
)


def _unserved(value: Any) -> bool:
    return isinstance(value, str) and value in UNSERVED_TAGS


class Unserved:
    """A field a dialect documents that nothing here can honour: only its "off" value passes.

    In the document it is ``null`` (or its off value) with a description saying so;
    a request that sets it is refused with ``capability_unsupported`` naming it.
    """

    def __init__(self, off: tuple[Any, ...] = (None,)) -> None:
        self.off = off

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        off = self.off

        def check(value: Any) -> Any:
            if (value in off and not isinstance(value, bool)) or value is None:
                return value
            raise PydanticCustomError("unserved", "this field is not supported here")

        return core_schema.no_info_plain_validator_function(check)

    def __get_pydantic_json_schema__(self, _: Any, handler: GetJsonSchemaHandler) -> Any:
        values = [v for v in self.off if v is not None]
        schema: dict[str, Any] = {"enum": values} if values else {"type": "null"}
        schema["description"] = "Not supported here: setting it is refused (capability_unsupported)"
        return schema


class AsDicts:
    """Check a field through typed models, and keep what passed as the plain JSON it was.

    The models are the field's declaration (and its schema in the document); code
    past the door keeps reading the JSON objects the dialect defines, with only
    the keys the caller sent.
    """

    def __init__(self, typed: Any) -> None:
        self.typed = typed

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_after_validator_function(
            _plain, handler.generate_schema(self.typed)
        )


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(by_alias=True, exclude_unset=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def strict(model: type[M], raw: Any, *, prefix: str = "") -> M:
    """``raw`` as ``model`` (strict, unknown fields refused), or its coded 400."""
    try:
        return model.model_validate(raw, strict=True)
    except ValidationError as exc:
        raise field_error(exc, raw, model, prefix) from None
