"""The OpenAPI document, made true, and docs that load with no network.

The handlers read their bodies themselves (strictly, with coded errors), so
FastAPI sees no body models and would document none, and it would advertise
a 422 that is never sent (validation errors are 400 here). This module holds,
per operation, the request body, the success status and schema, and the error
statuses the operation really answers, and rewrites the generated document
with them. ``tests/unit/test_openapi.py`` checks the table against the app's
routes, and ``tests/integration/api/test_openapi_statuses.py`` checks that the
statuses sent in practice are the documented ones.

``/docs`` is a small page of our own that reads ``/openapi.json`` and lists
every operation with its schemas: no script from a CDN, so it works on an
offline network. FastAPI's Swagger and ReDoc pages (which load from a CDN) are
turned off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict

from batchyard.api.bodies import (
    DatasetBody,
    DecideBody,
    KeepWarmBody,
    ProjectBody,
    RowPatchBody,
    RunBody,
    WebhookEndpointBody,
)
from batchyard.core.anthropic_bodies import CountTokensRequest, MessagesRequest
from batchyard.core.openai_bodies import ChatRequest, CompletionTextRequest, EmbeddingRequest
from batchyard.service.batch_requests import BatchBody
from batchyard.service.file_batches import FileBatchBody
from batchyard.service.message_batches import MessageBatchBody

__all__ = ["ANTHROPIC_PATHS", "OPERATIONS", "Operation", "install_openapi"]


class ErrorDetail(BaseModel):
    """Every error's body: a stable ``code``, a message, and whether to retry."""

    model_config = ConfigDict(extra="allow")

    code: str
    #: OpenAI's error type (``invalid_request_error``, ``rate_limit_error``, …), by status.
    type: str
    message: str
    retryable: bool
    param: str | None = None
    retry_after: float | None = None


class Finished(BaseModel):
    """A page of a batch's items that ended after the cursor (``service.following``)."""

    object: Literal["list"]
    #: Each item as the batch's final results show it.
    data: list[dict[str, Any]]
    #: Pass as ``after`` to read on from here.
    cursor: str
    has_more: bool
    #: The batch has ended: with ``has_more`` false, every item has been read.
    ended: bool


class SpendCapBody(BaseModel):
    """Dollars as decimal strings; null for no cap of that kind (both null removes them)."""

    model_config = ConfigDict(extra="forbid")

    total: str | float | None = None
    monthly: str | float | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class _Open(BaseModel):
    """An object with more fields than listed (see the reference docs)."""

    model_config = ConfigDict(extra="allow")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class ChatMessage(_Open):
    role: str
    content: str | None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: dict[str, Any] | None


class ChatCompletion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    charge: str


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None


class TextCompletion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    charge: str


class Embedding(BaseModel):
    object: str
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Open):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    charge: str


class ModelObject(_Open):
    id: str
    object: str
    created: int
    owned_by: str
    capabilities: dict[str, bool]
    concurrency: int | None


class Warmth(BaseModel):
    state: str
    until: str | None
    last_load_seconds: float | None


class KeptWarm(_Open):
    """What ``POST /v1/models/{id}/keep-warm`` answers: the version and how warm it is."""

    id: str
    object: str
    warm: Warmth


class ModelList(BaseModel):
    object: str
    data: list[ModelObject]


class Account(_Open):
    organization: dict[str, Any]
    tier: int
    credit: dict[str, str]
    effective_limits: dict[str, int]


class DecideUsage(_Open):
    input_tokens: int
    output_tokens: int
    #: Of ``input_tokens``, those the model read from its prompt cache (answers saved
    #: under an idempotency key before this field existed do not carry it).
    cached_input_tokens: int = 0
    calibration_input_tokens: int = 0


class Decision(_Open):
    id: str
    model: str
    answers: list[dict[str, Any]]
    usage: DecideUsage
    charge: str


class Estimate(BaseModel):
    input_tokens: int
    max_output_tokens: int
    max_cost: str


class ListOf(_Open):
    object: str
    data: list[dict[str, Any]]


class EmptyBody(BaseModel):
    """A call that takes no body: send nothing, or ``{}``."""

    model_config = ConfigDict(extra="forbid")


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    checks: dict[str, dict[str, Any]]


_JSON = "application/json"
_SSE = "text/event-stream"
_NDJSON = "application/x-ndjson"


@dataclass(frozen=True)
class Operation:
    """What one operation takes and answers, as sent."""

    success: int
    response: type[BaseModel] | None
    errors: tuple[int, ...]
    #: The JSON body; several models are alternatives (``anyOf``: one door, two dialects).
    body: type[BaseModel] | tuple[type[BaseModel], ...] | None = None
    #: False where the body may be left out (a call that takes none, or ``{}``).
    body_required: bool = True
    media: str = _JSON
    summary: str = ""
    #: Also answers ``text/event-stream`` (with ``stream: true``).
    streams: bool = False
    #: Other success statuses with the same body (a dialect that answers differently).
    also: tuple[int, ...] = ()
    extra_body_types: tuple[str, ...] = field(default=())
    #: The schema of a multipart/form-data body, where there is one.
    multipart: dict[str, Any] | None = None
    #: What the error statuses answer where it is not the error body (a probe's own body).
    error_body: type[BaseModel] | None = None


# Error statuses by kind of operation. 503: the store cannot take the request now
# (storage_unavailable); 415: a JSON body without Content-Type: application/json.
_READ = (400, 401, 403, 404, 500, 503)
_WRITE = (400, 401, 403, 404, 409, 413, 415, 500, 503)
_MODEL_CALL = (400, 401, 402, 403, 404, 409, 413, 415, 429, 500, 502, 503, 504)

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("get", "/healthz"): Operation(
        200, Health, (503,), summary="Liveness: the process is up", error_body=Health
    ),
    ("get", "/readyz"): Operation(
        200,
        Readiness,
        (503,),
        summary="Readiness: store writable, migrations current, limiter reachable",
        error_body=Readiness,
    ),
    ("get", "/v1/account"): Operation(200, Account, (401, 403, 500, 503), summary="Your account"),
    ("get", "/v1/activity"): Operation(200, ListOf, _READ, summary="Credit activity"),
    ("post", "/v1/chat/completions"): Operation(
        200,
        ChatCompletion,
        _MODEL_CALL,
        ChatRequest,
        streams=True,
        summary="Chat completions (OpenAI's shape)",
    ),
    ("post", "/v1/completions"): Operation(
        200,
        TextCompletion,
        _MODEL_CALL,
        CompletionTextRequest,
        streams=True,
        summary="Text completions (OpenAI's shape)",
    ),
    ("post", "/v1/embeddings"): Operation(
        200, EmbeddingList, _MODEL_CALL, EmbeddingRequest, summary="Embeddings (OpenAI's shape)"
    ),
    ("post", "/v1/decide"): Operation(
        200, Decision, _MODEL_CALL, DecideBody, summary="Every question about one text"
    ),
    ("post", "/v1/decide/estimate"): Operation(
        200,
        Estimate,
        (400, 401, 403, 404, 409, 413, 415, 429, 500, 503),
        DecideBody,
        summary="Price a decide call without running it",
    ),
    ("post", "/v1/models/{model_id}/keep-warm"): Operation(
        200, KeptWarm, _WRITE, KeepWarmBody, summary="Keep a fine-tuned version loaded"
    ),
    ("get", "/v1/models"): Operation(200, ModelList, (401, 500, 503), summary="The catalog"),
    ("get", "/v1/models/{model_id}"): Operation(200, ModelObject, (401, 404, 500, 503)),
    ("post", "/v1/batches"): Operation(
        201,
        _Open,
        (*_WRITE, 402, 429, 503),
        (BatchBody, FileBatchBody),
        summary="Submit a batch: deferred (201, batchyard's body) or a file batch (200, OpenAI's)",
        also=(200,),
    ),
    ("get", "/v1/batches"): Operation(200, ListOf, _READ, summary="Batches of both dialects"),
    ("get", "/v1/batches/{batch_id}"): Operation(200, _Open, _READ),
    ("post", "/v1/batches/{batch_id}/cancel"): Operation(
        200, _Open, _WRITE, EmptyBody, body_required=False
    ),
    ("get", "/v1/batches/{batch_id}/results"): Operation(
        200,
        _Open,
        (*_READ, 410),
        media=_NDJSON,
        summary="Results, one JSON line per request (410 results_expired once purged)",
    ),
    ("post", "/v1/batches/{batch_id}/retry"): Operation(
        200,
        _Open,
        (*_WRITE, 402),
        EmptyBody,
        body_required=False,
        summary="A batchyard extension: a new file batch of the failed, expired, canceled lines",
    ),
    ("get", "/v1/batches/{batch_id}/finished"): Operation(
        200,
        Finished,
        (*_READ, 410),
        summary="A batchyard extension: what has ended so far, from a cursor, while it runs",
    ),
    ("post", "/v1/files"): Operation(
        200,
        _Open,
        (*_WRITE, 415),
        None,
        summary="Upload a batch input file (multipart/form-data: purpose, file)",
        multipart={
            "type": "object",
            "required": ["purpose", "file"],
            "additionalProperties": False,
            # The expiry is both its parts or neither.
            "dependentRequired": {
                "expires_after[anchor]": ["expires_after[seconds]"],
                "expires_after[seconds]": ["expires_after[anchor]"],
            },
            "properties": {
                "purpose": {"type": "string", "enum": ["batch"]},
                "file": {"type": "string", "format": "binary"},
                "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                "expires_after[seconds]": {
                    "type": "integer",
                    "minimum": 3600,
                    "maximum": 2_592_000,
                },
            },
        },
    ),
    ("get", "/v1/files"): Operation(200, ListOf, _READ, summary="Files"),
    ("get", "/v1/files/{file_id}"): Operation(200, _Open, _READ),
    ("get", "/v1/files/{file_id}/content"): Operation(
        200, _Open, _READ, media="application/jsonl", summary="A file's lines"
    ),
    ("delete", "/v1/files/{file_id}"): Operation(200, _Open, (*_READ, 409)),
    ("post", "/v1/projects"): Operation(201, _Open, _WRITE, ProjectBody),
    ("put", "/v1/projects/{project_id}/spend-cap"): Operation(
        200, _Open, _WRITE, SpendCapBody, summary="Cap what a project's runs may spend"
    ),
    ("put", "/v1/keys/{key_id}/spend-cap"): Operation(
        200, _Open, _WRITE, SpendCapBody, summary="Cap what a key may spend"
    ),
    ("get", "/v1/projects/{project_id}"): Operation(200, _Open, _READ),
    ("post", "/v1/projects/{project_id}/datasets"): Operation(
        201,
        _Open,
        _WRITE,
        DatasetBody,
        extra_body_types=("text/csv", _NDJSON, "application/vnd.apache.parquet"),
    ),
    ("get", "/v1/projects/{project_id}/datasets/{dataset_id}"): Operation(200, _Open, _READ),
    ("get", "/v1/projects/{project_id}/datasets/{dataset_id}/rows"): Operation(200, ListOf, _READ),
    ("patch", "/v1/projects/{project_id}/datasets/{dataset_id}/rows/{row_id}"): Operation(
        200, _Open, _WRITE, RowPatchBody
    ),
    ("post", "/v1/projects/{project_id}/batch-inference-runs"): Operation(
        201, _Open, (*_WRITE, 402, 429), RunBody
    ),
    ("get", "/v1/projects/{project_id}/batch-inference-runs"): Operation(200, ListOf, _READ),
    ("get", "/v1/projects/{project_id}/batch-inference-runs/{run_id}"): Operation(
        200, _Open, _READ
    ),
    ("post", "/v1/projects/{project_id}/batch-inference-runs/{run_id}/confirm"): Operation(
        200, _Open, (*_WRITE, 402), EmptyBody, body_required=False
    ),
    ("post", "/v1/projects/{project_id}/batch-inference-runs/{run_id}/cancel"): Operation(
        200, _Open, _WRITE, EmptyBody, body_required=False
    ),
    ("get", "/v1/projects/{project_id}/batch-inference-runs/{run_id}/failures"): Operation(
        200, ListOf, _READ
    ),
    ("get", "/v1/projects/{project_id}/batch-inference-runs/{run_id}/finished"): Operation(
        200,
        Finished,
        _READ,
        summary="A batchyard extension: the rows that ended so far, from a cursor, while it runs",
    ),
    ("post", "/v1/projects/{project_id}/batch-inference-runs/{run_id}/retry"): Operation(
        201,
        _Open,
        _WRITE,
        EmptyBody,
        body_required=False,
        summary="A new run of the failed and canceled rows, quoted and awaiting confirmation",
    ),
}

# -- Anthropic's Messages door (api/messages.py): its own answers and error envelope --


class AnthropicErrorDetail(BaseModel):
    """Anthropic's error object, with batchyard's stable ``code`` beside its ``type``."""

    model_config = ConfigDict(extra="allow")

    type: str
    message: str
    code: str
    param: str | None = None


class AnthropicErrorBody(BaseModel):
    type: str = "error"
    error: AnthropicErrorDetail
    request_id: str | None = None


class AnthropicMessage(_Open):
    """Anthropic's ``message`` object (see docs/reference/messages.md)."""

    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: dict[str, Any]


class MessageTokensCount(BaseModel):
    input_tokens: int


_ANTHROPIC_CALL = (400, 401, 402, 403, 404, 409, 413, 415, 429, 500, 502, 503, 504, 529)


def _anthropic_operations() -> dict[tuple[str, str], Operation]:
    return {
        ("post", "/v1/messages"): Operation(
            200,
            AnthropicMessage,
            _ANTHROPIC_CALL,
            MessagesRequest,
            streams=True,
            summary="Messages (Anthropic's shape)",
        ),
        ("post", "/v1/messages/batches"): Operation(
            200,
            _Open,
            (*_WRITE, 402),
            MessageBatchBody,
            summary="Create a Message Batch (Anthropic's shape; a file batch underneath)",
        ),
        ("get", "/v1/messages/batches"): Operation(
            200, _Open, _READ, summary="Message Batches, newest first (before_id / after_id)"
        ),
        ("get", "/v1/messages/batches/{batch_id}"): Operation(200, _Open, _READ),
        ("post", "/v1/messages/batches/{batch_id}/cancel"): Operation(200, _Open, _WRITE),
        ("get", "/v1/messages/batches/{batch_id}/results"): Operation(
            200,
            _Open,
            (*_READ, 409),
            media="application/x-jsonl",
            summary="Results, one {custom_id, result} line per request, once ended",
        ),
        ("post", "/v1/messages/batches/{batch_id}/retry"): Operation(
            200,
            _Open,
            (*_WRITE, 402),
            summary="A batchyard extension: a new batch of the errored, canceled, expired requests",
        ),
        ("get", "/v1/messages/batches/{batch_id}/finished"): Operation(
            200,
            Finished,
            _READ,
            summary="A batchyard extension: the results so far, from a cursor, while it runs",
        ),
        ("post", "/v1/messages/count_tokens"): Operation(
            200,
            MessageTokensCount,
            (400, 401, 403, 404, 413, 415, 429, 500, 503),
            CountTokensRequest,
            summary="Count a Messages prompt's tokens without running it",
        ),
    }


OPERATIONS.update(_anthropic_operations())
ANTHROPIC_PATHS = frozenset(path for _, path in _anthropic_operations())


def _anthropic_errors(doc: dict[str, Any], schemas: dict[str, Any]) -> None:
    """Anthropic's door answers errors in Anthropic's envelope, and streams its events."""
    ref = _ref(AnthropicErrorBody, schemas)
    for path in ANTHROPIC_PATHS:
        for op in doc.get("paths", {}).get(path, {}).values():
            for status, answer in op.get("responses", {}).items():
                if int(status) >= 400:
                    answer["content"] = {_JSON: {"schema": ref}}
                elif _SSE in answer.get("content", {}):
                    answer["content"][_SSE]["schema"]["description"] = (
                        "with stream: true, server-sent events of Anthropic's types "
                        "(message_start ... message_stop)"
                    )


def _model_version_operations() -> dict[tuple[str, str], Operation]:
    """A project's uploaded model versions (kept apart so other edits of the table merge)."""
    path = "/v1/projects/{project_id}/models"
    return {
        ("post", path): Operation(
            201,
            _Open,
            (*_WRITE, 415),
            None,
            summary="Upload a model version (multipart/form-data: file, base, type, name)",
            multipart={
                "type": "object",
                "required": ["file", "base", "type"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "base": {"type": "string"},
                    "type": {"type": "string", "enum": ["lora", "weights"]},
                    "name": {"type": "string"},
                },
            },
        ),
        ("get", path): Operation(200, ListOf, _READ, summary="The project's model versions"),
        ("get", path + "/{version_id}"): Operation(200, _Open, _READ),
        ("delete", path + "/{version_id}"): Operation(200, _Open, (*_READ, 409)),
    }


OPERATIONS.update(_model_version_operations())


class WebhookEndpoint(BaseModel):
    """A webhook endpoint; ``secret`` only in the answers that make one (create, rotate)."""

    id: str
    object: Literal["webhook_endpoint"]
    url: str
    description: str | None
    events: list[str]
    created_at: str
    updated_at: str
    secret: str | None = None


class WebhookEndpointList(BaseModel):
    object: Literal["list"]
    data: list[WebhookEndpoint]
    has_more: bool
    last_id: str | None


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"]
    deleted: bool


def _webhook_operations() -> dict[tuple[str, str], Operation]:
    """Webhook endpoints (kept apart so other edits of the table merge)."""
    path = "/v1/webhook-endpoints"
    one = path + "/{endpoint_id}"
    return {
        ("post", path): Operation(
            201,
            WebhookEndpoint,
            _WRITE,
            WebhookEndpointBody,
            summary="Register a webhook endpoint (its secret is in this answer only)",
        ),
        ("get", path): Operation(200, WebhookEndpointList, _READ, summary="Webhook endpoints"),
        ("get", one): Operation(200, WebhookEndpoint, _READ),
        ("delete", one): Operation(200, WebhookEndpointDeleted, _READ),
        ("post", one + "/rotate-secret"): Operation(
            200,
            WebhookEndpoint,
            _WRITE,
            EmptyBody,
            body_required=False,
            summary="A new signing secret, in this answer only",
        ),
    }


OPERATIONS.update(_webhook_operations())

_REASONS = {
    200: "OK",
    201: "Created",
    400: "The request is malformed or not allowed (see error.code and error.param)",
    401: "No API key, or not a valid one",
    402: "Not enough credit; nothing was charged",
    403: "The key's scope does not allow this call",
    404: "No such object (or model: model_not_found)",
    410: "Gone: the results were purged (results_expired)",
    409: "Idempotency-Key conflict, in progress, or expired; or the object's state forbids it",
    413: "The request body is too large",
    415: "The body is not of a media type this operation reads",
    429: "Over a limit; retry-after-ms and Retry-After say when a retry is admitted",
    500: "Internal error (logged with the answer's x-request-id)",
    502: "The model's upstream failed",
    503: "A model warming up, an upstream rate limit, the service not ready, or a store that "
    "cannot take the request now (storage_unavailable, retryable)",
    504: "The model's upstream timed out",
    529: "Overloaded: the model is warming up or its upstream is rate limited (Anthropic's door)",
}

_RATE_HEADERS = {
    name: {"schema": {"type": "string"}, "description": text}
    for name, text in {
        "x-request-id": "This request's id, also in the server's logs",
        "x-ratelimit-limit-requests": "Your tier's requests a minute",
        "x-ratelimit-remaining-requests": "Requests admitted now without waiting",
        "x-ratelimit-reset-requests": "Until the requests limit is idle again (1s, 20ms)",
        "x-ratelimit-limit-tokens": "Your tier's input tokens a minute",
        "x-ratelimit-remaining-tokens": "Input tokens admitted now without waiting",
        "x-ratelimit-reset-tokens": "Until the tokens limit is idle again",
    }.items()
}
_ERROR_HEADERS = {
    "x-should-retry": {
        "schema": {"type": "string", "enum": ["true", "false"]},
        "description": "Whether sending the same request again soon can succeed",
    },
    "retry-after-ms": {"schema": {"type": "string"}, "description": "Milliseconds to wait"},
    "Retry-After": {"schema": {"type": "string"}, "description": "Seconds, rounded up"},
    "x-request-id": _RATE_HEADERS["x-request-id"],
}


def _ref(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    schemas: dict[str, Any] = {}
    error_ref = _ref(ErrorBody, schemas)
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            spec = OPERATIONS.get((method, path))
            if spec is None:
                continue
            if spec.summary:
                op["summary"] = spec.summary
            content: dict[str, Any] = {}
            if isinstance(spec.body, tuple):
                content[_JSON] = {"schema": {"anyOf": [_ref(b, schemas) for b in spec.body]}}
            elif spec.body is not None:
                content[_JSON] = {"schema": _ref(spec.body, schemas)}
            for media in spec.extra_body_types:
                content[media] = {"schema": {"type": "string", "format": "binary"}}
            if spec.multipart is not None:
                content["multipart/form-data"] = {"schema": spec.multipart}
            if content:
                op["requestBody"] = {"required": spec.body_required, "content": content}
            ok: dict[str, Any] = {}
            if spec.response is not None:
                body_schema = (
                    _ref(spec.response, schemas)
                    if spec.media == _JSON
                    else {"type": "string", "description": "one JSON object a line"}
                )
                ok[spec.media] = {"schema": body_schema}
            if spec.streams:
                ok[_SSE] = {
                    "schema": {
                        "type": "string",
                        "description": "with stream: true, server-sent events of OpenAI "
                        "chunks, ending with data: [DONE]",
                    }
                }
            responses: dict[str, Any] = {
                str(status): {
                    "description": _REASONS[status],
                    "content": ok,
                    "headers": _RATE_HEADERS,
                }
                for status in sorted({spec.success, *spec.also})
            }
            errors_ref = error_ref if spec.error_body is None else _ref(spec.error_body, schemas)
            for status in sorted(set(spec.errors)):
                responses[str(status)] = {
                    "description": _REASONS[status],
                    "content": {_JSON: {"schema": errors_ref}},
                    "headers": _ERROR_HEADERS,
                }
            op["responses"] = responses
    _anthropic_errors(doc, schemas)
    components = doc.setdefault("components", {})
    found = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        found.pop(unused, None)
    found.update(schemas)
    return doc


_DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchyard API</title>
<style>
body{font:15px/1.45 system-ui,sans-serif;max-width:70rem;margin:2rem auto;padding:0 1rem}
details{border:1px solid #ccc;border-radius:6px;margin:.4rem 0;padding:.3rem .7rem}
summary{cursor:pointer} code{font-weight:600} .m{display:inline-block;width:4.2rem;
font-weight:700;text-transform:uppercase} pre{background:#f6f6f6;padding:.6rem;overflow:auto}
</style></head><body><h1>batchyard API</h1>
<p>Read from <a href="openapi.json">openapi.json</a>; this page loads nothing else.</p>
<div id="ops">Loading...</div>
<script>
function resolve(doc, s){
  if(s&&s.$ref){return doc.components.schemas[s.$ref.split('/').pop()]} return s }
function esc(t){return String(t).replace(/[&<>]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;'}[c]))}
fetch('openapi.json').then(r=>r.json()).then(doc=>{
  const out=[];
  for(const [path,ops] of Object.entries(doc.paths)){
    for(const [method,op] of Object.entries(ops)){
      let html='<details><summary><span class="m">'+method+'</span><code>'+esc(path)+
        '</code> '+esc(op.summary||'')+'</summary>';
      const body=op.requestBody&&op.requestBody.content['application/json'];
      if(body){html+='<h4>Request</h4><pre>'+
        esc(JSON.stringify(resolve(doc,body.schema),null,2))+'</pre>'}
      for(const [status,resp] of Object.entries(op.responses||{})){
        html+='<h4>'+status+' '+esc(resp.description||'')+'</h4>';
        for(const [media,c] of Object.entries(resp.content||{})){
          html+='<p>'+esc(media)+'</p><pre>'+
            esc(JSON.stringify(resolve(doc,c.schema),null,2))+'</pre>'}
      }
      out.push(html+'</details>');
    }
  }
  document.getElementById('ops').innerHTML=out.join('');
});
</script></body></html>
"""


def install_openapi(app: FastAPI) -> None:
    """Replace the generated document with the true one, and serve ``/docs`` offline."""
    cached: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not cached:
            cached.append(_document(app))
        return cached[0]

    app.openapi = openapi  # type: ignore[method-assign]

    async def docs() -> HTMLResponse:
        return HTMLResponse(_DOCS_PAGE)

    page: Callable[[], Any] = docs
    app.add_api_route("/docs", page, methods=["GET"], include_in_schema=False)
