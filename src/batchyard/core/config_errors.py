"""What is wrong with a configuration, said in one line an operator can act on.

A config mistake is not a bug: ``serve``, ``worker`` and ``audit`` refuse to start with
one line naming where the value came from, the field and the fix, never a traceback.
``from_validation`` turns pydantic's first error into that line, so no field needs a
hand-written check.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

__all__ = ["ConfigError", "field_path", "from_validation"]


class ConfigError(ValueError):
    """One operator mistake: the field, what is wrong with it, and the fix.

    ``source`` (the config file's path, or ``environment variable BATCHYARD_X``)
    is filled in by whoever read the value. A ``ValueError``, so callers that
    caught the old hand-read errors still do.
    """

    def __init__(self, field: str, problem: str, fix: str, *, source: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        self.source = source
        super().__init__(self.detail)

    @property
    def detail(self) -> str:
        where = f"{self.field}: " if self.field else ""
        return f"{where}{self.problem} — {self.fix}"

    def line(self) -> str:
        """The one line ``serve``, ``worker`` and ``audit`` print before exiting."""
        where = f" in {self.source}" if self.source else ""
        return f"batchyard: config error{where}: {self.detail}"

    def at(self, source: str) -> ConfigError:
        """The same error, said to come from ``source`` (kept when already set)."""
        if self.source is None:
            self.source = source
        return self


def field_path(loc: Iterable[int | str]) -> str:
    """``("routes", 0, "engine")`` as ``routes[0].engine``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: pydantic's error types -> (what was expected, the fix)
_KINDS: dict[str, tuple[str, str]] = {
    kind: said
    for kinds, said in (
        ("int_parsing int_type", ("a whole number", "write a whole number such as 30")),
        ("int_from_float", ("a whole number", "write a whole number, without a fraction")),
        ("float_parsing float_type", ("a number", "write a number such as 30 or 2.5")),
        ("finite_number", ("a finite number", "write a number such as 30 or 2.5")),
        ("decimal_parsing decimal_type", ("a decimal number", 'write a decimal such as "0.50"')),
        ("bool_parsing bool_type", ("true or false", "write true or false")),
        ("string_type", ("text", "write it as a string")),
        ("list_type tuple_type", ("a list", "write a list (YAML `- item` lines, or [a, b])")),
        (
            "dict_type model_type model_attributes_type dataclass_type dataclass_args_type",
            ("a mapping", "write `name: value` pairs under it"),
        ),
    )
    for kind in kinds.split()
}


def _fields_of(kind: Any) -> dict[str, Any]:
    """The pydantic fields of a model or pydantic dataclass (none for anything else)."""
    found = getattr(kind, "__pydantic_fields__", None) if isinstance(kind, type) else None
    return dict(found) if isinstance(found, dict) else {}


def _known_fields(model: Any, loc: Sequence[int | str]) -> list[str]:
    """The field names allowed where ``loc``'s last part was refused (for a suggestion)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        info = _fields_of(current).get(str(part))
        if info is None:
            return []
        current = _inner_model(info.annotation)
    return [
        info.alias or name
        for name, info in _fields_of(current).items()
        if not (isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("derived"))
    ]


def _inner_model(annotation: Any) -> Any:
    """The model inside ``list[X] | None`` and the like."""
    if _fields_of(annotation):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _describe(error: Any, model: Any) -> tuple[str, str]:
    kind = str(error["type"])
    ctx = error.get("ctx") or {}
    given = error.get("input")
    if kind == "value_error" and isinstance(ctx.get("error"), ConfigError):
        inner: ConfigError = ctx["error"]
        return inner.problem, inner.fix
    if kind == "value_error":
        text = str(ctx.get("error", error["msg"]))
        problem, _, fix = text.partition(" — ")
        return problem, fix or "correct the value"
    if kind == "missing":
        return "required, and missing", "add it"
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        loc = list(error["loc"])
        known = _known_fields(model, loc)
        near = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return "is not a setting batchyard knows", f"{hint}remove it or fix its name"
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        return f"{_shown(given)} is not one of {expected}", "use one of those"
    if kind in _KINDS:
        expected, fix = _KINDS[kind]
        return f"expected {expected}, got {_shown(given)}", fix
    bounds = {
        "greater_than": "more than",
        "greater_than_equal": "at least",
        "less_than": "less than",
        "less_than_equal": "at most",
    }
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return (
            f"must be {bounds[kind]} {limit}, got {_shown(given)}",
            f"set it to {bounds[kind]} {limit}",
        )
    if kind in ("string_too_short", "too_short"):
        return "must not be empty", "give it a value, or remove the line"
    return f"{error['msg']} (got {_shown(given)})", "correct the value"


def from_validation(
    exc: ValidationError, *, model: Any = None, prefix: Sequence[int | str] = ()
) -> ConfigError:
    """The first of pydantic's errors as a ``ConfigError`` (with how many more there are)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    path = field_path([*prefix, *first["loc"]])
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, ConfigError) and inner.field:
        path = inner.field  # a check across fields names the field itself, from the top
    problem, fix = _describe(first, model)
    if len(errors) > 1:
        fix += f" ({len(errors) - 1} more problem(s) after this one)"
    return ConfigError(path, problem, fix)
