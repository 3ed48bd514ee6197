"""The shapes of the request bodies the API reads (decide, keep-warm, projects, webhooks).

Each is a ``core.inputs.Shape`` (strict types, unknown fields refused by name)
that says only which fields exist and their JSON types; ranges and the rules
between fields stay with each door's own checks (``core.decisions``,
``service.runs``), which keep their specific codes. Field names are the wire's:
camelCase for the runs API, so some break Python's conventions on purpose.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from batchyard.core.decisions import IMAGE_URL
from batchyard.core.inputs import SOME_TEXT, SPACE, Coded, Shape
from batchyard.core.webhook_rules import EVENTS

__all__ = [
    "DatasetBody",
    "DecideBody",
    "KeepWarmBody",
    "ProjectBody",
    "RowPatchBody",
    "WebhookEndpointBody",
]


# -- decide (docs/reference/decide.md) -----------------------------------------------------------


#: 1 to 64 characters, no surrounding spaces, control characters, ":", quotes or backslashes.
_ID = rf'^[^{SPACE}:"\\\x00-\x1f\x7f]([^:"\\\x00-\x1f\x7f]{{0,62}}[^{SPACE}:"\\\x00-\x1f\x7f])?$'


class DecideOutcome(Shape):
    id: str = Field(pattern=_ID)
    description: str | None = None


class DecideQuestion(Shape):
    id: str = Field(pattern=_ID)
    question: str = Field(pattern=SOME_TEXT)
    #: Each outcome's id once (the document can say no two are the same object).
    outcomes: Annotated[
        list[DecideOutcome],
        Field(min_length=2, json_schema_extra={"uniqueItems": True}),
        Coded("too_few_outcomes"),
    ]


class DecideText(Shape):
    text: Annotated[
        str, Field(pattern=SOME_TEXT), Coded("empty_text", "send the text to decide about")
    ]
    image_url: str | None = Field(default=None, pattern=IMAGE_URL)


class DecideImage(Shape):
    image_url: str = Field(pattern=IMAGE_URL)
    text: str | None = None


class DecideBody(Shape):
    """``POST /v1/decide`` and ``POST /v1/decide/estimate``."""

    model: str = Field(min_length=1)
    input: DecideText | DecideImage
    decisions: Annotated[list[DecideQuestion], Field(min_length=1), Coded("no_decisions")]
    max_output_tokens: int | None = None
    fallback: Literal["base", "none"] = "base"
    calibration: Literal["batch", "content_free", "none"] = "batch"


class KeepWarmBody(Shape):
    """``POST /v1/models/{id}/keep-warm``."""

    minutes: float


# -- projects, datasets and rows (docs/reference/runs.md) ---------------------------------------


class ProjectBody(Shape):
    """``POST /v1/projects``."""

    name: str = Field(max_length=200, pattern=SOME_TEXT)


class DatasetBody(Shape):
    """``POST …/datasets`` with a JSON body: an empty dataset."""

    name: str = Field(max_length=200, pattern=SOME_TEXT)
    kind: Literal["text", "chat-sft"] | None = None


class RowPatchBody(Shape):
    """``PATCH …/rows/{rowId}``: the fields to change (at least one); ``null`` removes one."""

    data: dict[str, Any] = Field(min_length=1)


# -- webhook endpoints ---------------------------------------------------------------


#: A port from 0 to 65535, leading zeros allowed (as ``urllib`` reads one).
_PORT = r"0*(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
#: http(s), a host DNS can name (labels of 1 to 63 letters, digits, ``-``, ``_``; or an
#: IPv4 address), an optional port, then a path or query without spaces, controls or a
#: fragment; no user name or password. Whether the host's addresses may be reached is the
#: server's to say (``403 webhook_target_not_allowed``).
_WEBHOOK_URL = (
    r"^[hH][tT][tT][pP][sS]?://[A-Za-z0-9_-]{1,63}(\.[A-Za-z0-9_-]{1,63})*\.?"
    rf"(:({_PORT})?)?([/?][^\x00-\x20\x7f#]*)?$"
)


class WebhookEndpointBody(Shape):
    """``POST /v1/webhook-endpoints``: where to send which events."""

    url: Annotated[str, Field(pattern=_WEBHOOK_URL, max_length=2048), Coded("invalid_webhook_url")]
    events: Annotated[
        list[Annotated[Literal[EVENTS], Coded("unknown_webhook_event")]],  # type: ignore[valid-type]
        Field(min_length=1),
    ]
    description: str | None = Field(default=None, max_length=500)
