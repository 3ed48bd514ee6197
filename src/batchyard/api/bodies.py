"""The shapes of the request bodies the API reads (decide, keep-warm, projects, runs).

Each is a ``core.inputs.Shape``: strict types and unknown fields refused, so
``max_token`` (a typo) or ``"maxOutputTokens": "5"`` is a 400 naming the
field. A shape says only which fields exist and their JSON types; ranges and
the rules between fields stay with each door's own checks
(``core.decisions``, ``api.run_requests``), which keep their specific codes.
The fuzz tests generate bodies from these same classes.

Field names are the wire's: snake_case for decide, camelCase for the runs API's
runs, so some classes break Python's naming conventions on purpose.
"""

from __future__ import annotations

from typing import Any

from batchyard.core.inputs import Shape

__all__ = [
    "DatasetBody",
    "DecideBody",
    "KeepWarmBody",
    "ProjectBody",
    "RowPatchBody",
    "RunBody",
    "WebhookEndpointBody",
]


# -- decide (docs/reference/decide.md) -----------------------------------------------------------


class DecideOutcome(Shape):
    id: str
    description: str | None = None


class DecideQuestion(Shape):
    id: str
    question: str
    outcomes: list[DecideOutcome]


class DecideInputBody(Shape):
    text: str | None = None
    image_url: str | None = None


class DecideBody(Shape):
    """``POST /v1/decide`` and ``POST /v1/decide/estimate``."""

    model: str
    input: DecideInputBody
    decisions: list[DecideQuestion] | None = None
    max_output_tokens: int | None = None
    fallback: str | None = None
    calibration: str | None = None


class KeepWarmBody(Shape):
    """``POST /v1/models/{id}/keep-warm``."""

    minutes: float


# -- projects, datasets and rows (docs/reference/runs.md) ---------------------------------------


class ProjectBody(Shape):
    """``POST /v1/projects``."""

    name: str


class DatasetBody(Shape):
    """``POST …/datasets`` with a JSON body: an empty dataset."""

    name: str
    kind: str | None = None


class RowPatchBody(Shape):
    """``PATCH …/rows/{rowId}``: the fields to change; ``null`` removes one."""

    data: dict[str, Any]


# -- batch inference runs (docs/reference/runs.md) ----------------------------------------------


class RunModelRef(Shape):
    type: str
    id: str


class RunMode(Shape):
    type: str


class RunInput(Shape):
    type: str
    field: str | None = None


class RunOutput(Shape):
    type: str
    field: str | None = None
    name: str | None = None


class RunSampling(Shape):
    maxOutputTokens: int | None = None
    samplesPerRow: int | None = None
    temperature: float | None = None
    topP: float | None = None


class RunBody(Shape):
    """``POST /v1/projects/{id}/batch-inference-runs``."""

    datasetId: str
    model: RunModelRef
    output: RunOutput
    mode: RunMode | None = None
    input: RunInput | None = None
    sampling: RunSampling | None = None
    filter: dict[str, Any] | None = None


# -- webhook endpoints ---------------------------------------------------------------


class WebhookEndpointBody(Shape):
    """``POST /v1/webhook-endpoints``: where to send which events."""

    url: str
    events: list[str] | None = None
    description: str | None = None
