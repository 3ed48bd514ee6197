"""A strict reading of a JSON body, for the OpenAI-compatible endpoints.

Python's ``json`` accepts ``NaN``, ``Infinity`` and ``-Infinity``, which are not
JSON and which no price or temperature may be; here they are a 400 like any
other malformed body. (Issue 11 owns strict input for the other doors; the two
readers can become one.)
"""

from __future__ import annotations

import json
from typing import Any

from batchyard.errors import InvalidJson

__all__ = ["parse_strict"]


def _refuse_constant(name: str) -> Any:
    raise InvalidJson(f"the request body holds {name}, which is not JSON; send a finite number")


def parse_strict(raw: bytes) -> dict[str, Any]:
    """A JSON object from ``raw``; ``InvalidJson`` for anything else, non-finite numbers too."""
    if not raw.strip():
        raise InvalidJson("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except InvalidJson:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidJson(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidJson("the request body must be a JSON object")
    return body
