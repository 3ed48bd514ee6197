"""A part's settings dataclass read from its section of the config file.

Each part that an operator tunes (file batches, files, webhooks) keeps its
settings as one frozen dataclass with its defaults; the config model checks a
section's shape, and this reads it into that dataclass, so the conversion is
written once instead of once a part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["section_settings"]

_Settings = TypeVar("_Settings")


def section_settings(cls: type[_Settings], raw: Any, **parsers: Callable[[Any], Any]) -> _Settings:
    """A part's settings dataclass from its config section, each key by its field's type.

    The config model has already checked the section's shape; this turns its
    values into the dataclass's (``int``, ``float``, ``str``; ``parsers`` for a
    field of another type) and leaves unknown keys and the defaults alone, so a
    part's settings are written once, as the dataclass.
    """
    fields_of: dict[str, Any] = cls.__dataclass_fields__  # type: ignore[attr-defined]
    plain: dict[str, Callable[[Any], Any]] = {"int": int, "float": float, "str": str}
    given: dict[str, Any] = {}
    for key, value in dict(raw or {}).items():
        spec = fields_of.get(key)
        if spec is None:
            continue
        kind = spec.type if isinstance(spec.type, str) else spec.type.__name__
        given[key] = (parsers.get(key) or plain[kind])(value)
    return cls(**given)
