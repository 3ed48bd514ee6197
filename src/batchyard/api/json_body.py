"""A strict reading of a JSON body, for callers that hold the raw bytes already.

The one strict reader is ``core.inputs.parse_json`` (no ``NaN``, ``Infinity``,
lone surrogates, NUL or deep nesting); this keeps the name the
OpenAI-compatible doors first used, and adds "an object, please".
"""

from __future__ import annotations

from typing import Any

from batchyard.core.inputs import parse_json
from batchyard.errors import InvalidJson

__all__ = ["parse_strict"]


def parse_strict(raw: bytes) -> dict[str, Any]:
    """A JSON object from ``raw``; ``InvalidJson`` (or a coded 400) for anything else."""
    body = parse_json(raw, request=True)
    if not isinstance(body, dict):
        raise InvalidJson("the request body must be a JSON object")
    return body
