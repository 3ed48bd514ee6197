"""The OpenAPI document, made true, and docs that load with no network.

The handlers read their bodies themselves (strictly, with coded errors), so
FastAPI sees no body models and would advertise a 422 that is never sent
(validation errors are 400 here). So each route declares, beside its handler
(``declare``), what FastAPI cannot see: its body, its answer's schema, and the
statuses it answers beyond those every operation of its method answers; its
success status and summary are the route's own (``status_code=``,
``summary=``). A chat or text completion is built through its declaration
(``api.openai_door.declared``); the other declarations are documentation
only (``response_model=`` would validate every answer, on every path), and
``tests/support/wire_check.py`` checks the answers the suite sees.

``/docs`` is a small page of our own that reads ``/openapi.json``: no script
from a CDN, so it works on an offline network.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict

from batchyard.api.context import read_empty
from batchyard.api.envelope import ANTHROPIC_DOOR

__all__ = ["Operation", "declare", "install_openapi", "operations"]


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


class _Choice(BaseModel):
    index: int
    finish_reason: str
    logprobs: dict[str, Any] | None


class ChatChoice(_Choice):
    message: ChatMessage


class TextChoice(_Choice):
    text: str


class _Completion(_Open):
    id: str
    object: str
    created: int
    model: str
    usage: Usage
    charge: str


class ChatCompletion(_Completion):
    choices: list[ChatChoice]


class TextCompletion(_Completion):
    choices: list[TextChoice]


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


_JSON = "application/json"
_SSE = "text/event-stream"
_F = TypeVar("_F", bound=Callable[..., Any])

#: What every operation of a method may answer besides success: no key (401), a scope
#: that does not allow it (403), a store that cannot take it now (503); a malformed
#: query or body (400), an object not found (404); a write's Idempotency-Key conflict
#: or an object's state (409), a body too large (413) or not JSON (415).
_COMMON = (401, 403, 500, 503)
_BY_METHOD = {"get": (400, 404), "delete": (400, 404, 409)}
_WRITE = (400, 404, 409, 413, 415)
#: What a paid model call answers beyond a write's.
MODEL_CALL = (402, 429, 502, 504)


@dataclass(frozen=True)
class Operation:
    """What one operation takes and answers beyond what FastAPI sees of its route."""

    response: type[BaseModel] = _Open
    #: Statuses beyond those of every operation of its method (``_COMMON``, ``_BY_METHOD``).
    errors: tuple[int, ...] = ()
    #: The JSON body; several models are alternatives (``anyOf``: one door, two dialects).
    body: type[BaseModel] | tuple[type[BaseModel], ...] | None = None
    media: str = _JSON
    #: Also answers ``text/event-stream`` (with ``stream: true``).
    streams: bool = False
    #: Other success statuses with the same body (a dialect that answers differently).
    also: tuple[int, ...] = ()
    extra_body_types: tuple[str, ...] = ()
    #: The schema of a multipart/form-data body, where there is one.
    multipart: dict[str, Any] | None = None
    #: A probe: no key, so none of ``_COMMON``; its errors answer its own body.
    public: bool = False
    #: Filled from the route by ``operations``.
    success: int = 200


def declare(response: type[BaseModel] = _Open, **facts: Any) -> Callable[[_F], _F]:
    """Record the handler's ``Operation`` on it, where ``operations`` finds it."""
    operation = Operation(response, **facts)

    def mark(handler: _F) -> _F:
        handler.__dict__["operation"] = operation
        return handler

    return mark


def _routes(routes: list[Any]) -> Iterator[Any]:
    for route in routes:
        inner = getattr(route, "original_router", None)  # an included router
        yield from [route] if inner is None else _routes(inner.routes)


def operations(app: FastAPI) -> dict[tuple[str, str], Operation]:
    """Every documented operation, with its success status and every error status it answers."""
    found: dict[tuple[str, str], Operation] = {}
    for route in _routes(app.routes):
        if not (isinstance(route, APIRoute) and route.include_in_schema):
            continue
        spec: Operation = getattr(route.endpoint, "operation", Operation())
        if any(d.call is read_empty for d in route.dependant.dependencies):
            spec = dataclasses.replace(spec, body=EmptyBody)  # ``context.Empty``
        for method in (m.lower() for m in route.methods or ()):
            common = () if spec.public else (*_COMMON, *_BY_METHOD.get(method, _WRITE))
            errors = tuple(sorted({*common, *spec.errors}))
            found[method, route.path_format] = dataclasses.replace(
                spec, errors=errors, success=route.status_code or 200
            )
    return found


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


#: The stream each dialect's ``stream: true`` answers.
_STREAMS = {
    False: "with stream: true, server-sent events of OpenAI chunks, ending with data: [DONE]",
    True: "with stream: true, server-sent events of Anthropic's types "
    "(message_start ... message_stop)",
}


def _document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    schemas: dict[str, Any] = {}
    for (method, path), spec in operations(app).items():
        op = doc["paths"][path][method]
        # Anthropic's door answers its errors in Anthropic's envelope (``envelope.error_response``).
        anthropic = path.startswith(ANTHROPIC_DOOR)
        content: dict[str, Any] = {}
        bodies = spec.body if isinstance(spec.body, tuple) else (spec.body,)
        refs = [_ref(b, schemas) for b in bodies if b is not None]
        if refs:
            content[_JSON] = {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}
        for media in spec.extra_body_types:
            content[media] = {"schema": {"type": "string", "format": "binary"}}
        if spec.multipart is not None:
            content["multipart/form-data"] = {"schema": spec.multipart}
        if content:
            # A call that takes no body may be sent without one, or with ``{}``.
            op["requestBody"] = {"required": spec.body is not EmptyBody, "content": content}
        lines = {"type": "string", "description": "one JSON object a line"}
        ok = {
            spec.media: {"schema": _ref(spec.response, schemas) if spec.media == _JSON else lines}
        }
        if spec.streams:
            ok[_SSE] = {"schema": {"type": "string", "description": _STREAMS[anthropic]}}
        error_body = spec.response if spec.public else ErrorBody
        error = _ref(AnthropicErrorBody if anthropic else error_body, schemas)
        op["responses"] = {
            **{
                str(status): {
                    "description": _REASONS[status],
                    "content": ok,
                    "headers": _RATE_HEADERS,
                }
                for status in sorted({spec.success, *spec.also})
            },
            **{
                str(status): {
                    "description": _REASONS[status],
                    "content": {_JSON: {"schema": error}},
                    "headers": _ERROR_HEADERS,
                }
                for status in spec.errors
            },
        }
    found = doc.setdefault("components", {}).setdefault("schemas", {})
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
    app.openapi = functools.cache(lambda: _document(app))  # type: ignore[method-assign]

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(_DOCS_PAGE)
