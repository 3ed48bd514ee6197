"""Write the tables of docs/reference/configuration.md from the settings' one declaration.

    python docs/gen_config.py --write   # rewrite the tables
    python docs/gen_config.py --check   # exit 1 when the page is stale (``make docs``)

Each table between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``
is rendered from ``Settings`` (``settings``) or one of its sections (``runs``,
``webhooks``...): name, type, default, environment variable and accepted values
all come from the field, so the page cannot drift from the code. The prose
around the tables is the page's own. The ``models:``, ``routes:`` and
``tiers:`` tables, whose fields are declared in ``core.catalog`` and
``core.tiers``, are checked instead: every field has a row, and every row is
a field.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import annotated_types  # noqa: E402
from pages import check_or_write  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402

from batchyard.core.catalog import ModelEntry, RouteEntry  # noqa: E402
from batchyard.core.config import Settings, env_names, scalar_settings  # noqa: E402
from batchyard.core.tiers import TierEntry  # noqa: E402

PAGE = ROOT / "docs" / "reference" / "configuration.md"
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)
#: The sections whose tables are checked against their entry's fields, not written.
CHECKED = {"models": ModelEntry, "routes": RouteEntry, "tiers": TierEntry}


def _extra(info: FieldInfo) -> dict[str, Any]:
    return dict(info.json_schema_extra) if isinstance(info.json_schema_extra, dict) else {}


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """The plain type inside ``Annotated[...] | None``, and the constraints on the way."""
    found: list[Any] = []
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation, *meta = typing.get_args(annotation)
            found.extend(meta)
            continue
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) == 1:
                annotation = args[0]
                continue
        return annotation, found


def _constraints(info: FieldInfo) -> dict[str, Any]:
    meta = _unwrap(info.annotation)[1]
    bounds: dict[str, Any] = {}
    for m in [*info.metadata, *meta]:
        for kind in ("gt", "ge", "lt", "le"):
            if isinstance(m, getattr(annotated_types, kind.capitalize())):
                bounds[kind] = getattr(m, kind)
        for inner in getattr(m, "metadata", ()) or ():  # a FieldInfo inside Annotated
            for kind in ("gt", "ge", "lt", "le"):
                if isinstance(inner, getattr(annotated_types, kind.capitalize())):
                    bounds[kind] = getattr(inner, kind)
    return bounds


def _bounds(info: FieldInfo) -> str:
    b = _constraints(info)
    if _unwrap(info.annotation)[0] is int and "gt" in b:
        b["ge"] = b.pop("gt") + 1  # a whole number "> 0" is "≥ 1"
    if "ge" in b and "le" in b:
        return f"{b['ge']} to {b['le']}"
    if "ge" in b and "lt" in b:
        return f"{b['ge']} ≤ x < {b['lt']}"
    if "gt" in b:
        return f"> {b['gt']}"
    if "ge" in b:
        return f"≥ {b['ge']}"
    return ""


def _kind(name: str, info: FieldInfo) -> str:
    given = _extra(info).get("kind")
    if given:
        return str(given)
    plain, _ = _unwrap(info.annotation)
    if plain is float:
        return "seconds" if name.endswith("_s") else "number"
    if plain is Decimal:
        return "decimal"
    return {int: "integer", str: "text", bool: "boolean"}.get(plain, "list")


def _default(info: FieldInfo) -> str:
    shown = _extra(info).get("shown")
    if shown:
        return str(shown)
    value = info.get_default(call_default_factory=True)
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return f"`{value}`"
    return str(value)


def _accepts(info: FieldInfo) -> str:
    return "; ".join(p for p in (_bounds(info), info.description or "") if p)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _settings_table() -> str:
    rows = [
        _row(["setting", "type", "default", "environment variable", "accepted values"]),
        _row(["---"] * 5),
    ]
    for name, info in scalar_settings():
        own, *old = env_names(name)
        also = [f"`{v}`" for v in old] + [f"`{f}`" for f in [_extra(info).get("flag")] if f]
        env = f"`{own}`" + (f" (or {', '.join(also)})" if also else "")
        rows.append(_row([f"`{name}`", _kind(name, info), _default(info), env, _accepts(info)]))
    return "\n".join(rows) + "\n"


def _section_table(section: str) -> str:
    kind = _unwrap(Settings.__pydantic_fields__[section].annotation)[0]  # type: ignore[attr-defined]
    rows = [_row(["field", "type", "default", "accepted values"]), _row(["---"] * 4)]
    for name, info in kind.__pydantic_fields__.items():
        rows.append(_row([f"`{name}`", _kind(name, info), _default(info), _accepts(info)]))
    return "\n".join(rows) + "\n"


def _check_rows(page: str) -> list[str]:
    """Every section has its table; each checked one names exactly its entry's fields."""
    problems = []
    scalars = {name for name, _ in scalar_settings()}
    for name, info in Settings.__pydantic_fields__.items():  # type: ignore[attr-defined]
        if name in scalars or _extra(info).get("derived") or name in CHECKED:
            continue
        if f"<!-- generated: {name} -->" not in page:
            problems.append(f"the section {name!r} has no generated table")
    for section, entry in CHECKED.items():
        part = page.split(f"## `{section}:`", 1)[-1].split("\n## ", 1)[0]
        rows: set[str] = set()
        for cell in re.findall(r"^\| (`[a-z_]+`(?: / `[a-z_]+`)*) \|", part, flags=re.M):
            rows.update(re.findall(r"`([a-z_]+)`", cell))
        fields = set(entry.model_fields)
        for name in sorted(fields - rows):
            problems.append(f"{section}: the field {name!r} has no row")
        for name in sorted(rows - fields):
            problems.append(f"{section}: the row {name!r} is no field")
    return problems


def render(page: str) -> str:
    """The page with each generated table rendered afresh."""

    def table(m: re.Match[str]) -> str:
        name = m.group(2)
        body = _settings_table() if name == "settings" else _section_table(name)
        return f"{m.group(1)}{body}{m.group(4)}"

    return BLOCK.sub(table, page)


def main() -> int:
    current = PAGE.read_text(encoding="utf-8")
    problems = _check_rows(current)
    for problem in problems:
        print(f"{PAGE.relative_to(ROOT)}: {problem}")
    status = check_or_write(PAGE, render(current), "gen_config.py")
    return status or (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
