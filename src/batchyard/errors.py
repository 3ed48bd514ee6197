"""Every error batchyard raises or answers, in one tree.

The ``code`` of each class is the wire code: the string a client sees in
``{"error": {"code", "type", "message", "retryable"}}``. Keeping the tree in one module
means the API, the SDK and the CLI agree on codes by construction, and a test
checks that no two classes claim the same code.

``retryable`` is true exactly where sending the same request again, with the
same idempotency key, can succeed: a rate limit, an overloaded upstream, a
model still loading. Anything that needs the caller to change the request is
not retryable.

    BatchyardError
    ├── InvalidRequest (400)
    │   ├── InvalidJson
    │   ├── InvalidType
    │   ├── InvalidIdempotencyKey
    │   ├── UnknownModel
    │   ├── UnknownField, CapabilityUnsupported
    │   ├── ModelUnavailable
    │   ├── UnsupportedInput
    │   ├── ContextWindowExceeded
    │   ├── NoDecisions, TooFewOutcomes, DuplicateId, EmptyText
    │   ├── EmptyFilterResult, InvalidFilter, InvalidField
    │   └── BatchInvalid (TooManyRequests/DuplicateCustomId/...) via codes
    ├── Unauthorized (401)
    │   ├── MissingApiKey
    │   └── InvalidApiKey
    ├── InsufficientCredit (402) ── SpendCapExceeded
    ├── Forbidden (403) ── InsufficientScope
    ├── NotFound (404) ── ModelNotFound
    ├── Conflict (409)
    │   ├── IdempotencyConflict
    │   ├── IdempotencyResponseExpired
    │   ├── IdempotencyInProgress
    │   ├── InvalidState
    │   └── QuoteExpired
    ├── PayloadTooLarge (413)
    ├── UnsupportedMediaType (415)
    ├── RateLimited (429)
    ├── PendingLimitExceeded (429)
    ├── UpstreamError (502)
    │   ├── UpstreamUnreachable (502)
    │   ├── UpstreamTimeout (504)
    │   ├── UpstreamRateLimited (503)
    │   └── ModelOutputInvalid (502)
    ├── ModelWarming (503)
    ├── ServiceUnavailable (503)
    │   ├── BatchUnavailable
    │   ├── StorageUnavailable
    │   └── LimiterUnavailable
    └── InternalError (500)
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BatchUnavailable",
    "BatchyardError",
    "CapabilityUnsupported",
    "Conflict",
    "ContextWindowExceeded",
    "DuplicateId",
    "EmptyFilterResult",
    "EmptyText",
    "Forbidden",
    "IdempotencyConflict",
    "IdempotencyInProgress",
    "IdempotencyResponseExpired",
    "InsufficientCredit",
    "InsufficientScope",
    "InternalError",
    "InvalidApiKey",
    "InvalidFilter",
    "InvalidIdempotencyKey",
    "InvalidJson",
    "InvalidRequest",
    "InvalidState",
    "InvalidType",
    "LimiterUnavailable",
    "MissingApiKey",
    "ModelNotFound",
    "ModelOutputInvalid",
    "ModelUnavailable",
    "ModelWarming",
    "NoDecisions",
    "NotFound",
    "PayloadTooLarge",
    "PendingLimitExceeded",
    "QuoteExpired",
    "RateLimited",
    "ServiceUnavailable",
    "SpendCapExceeded",
    "StorageUnavailable",
    "TooFewOutcomes",
    "Unauthorized",
    "UnknownField",
    "UnknownModel",
    "UnsupportedInput",
    "UnsupportedMediaType",
    "UpstreamError",
    "UpstreamRateLimited",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "error_class_for_code",
    "error_type",
]

#: OpenAI's error ``type`` for each status: code written for OpenAI's API branches
#: on ``e.type`` (the SDKs expose it), so every body carries it beside the stable,
#: finer ``code``. The type follows the status, so an instance that narrows its
#: status (``status=``) gets the type that goes with it.
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_quota",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    410: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an error answered with ``status``."""
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


class BatchyardError(Exception):
    """Base of every batchyard error; carries its wire code and HTTP status."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        details: dict[str, Any] | None = None,
        code: str | None = None,
        status: int | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.details = details or {}
        # Instances may narrow a generic class to a more specific wire code
        # (an InvalidRequest about a batch says ``too_many_requests``, say)
        # without a class per code that nothing catches separately.
        if code is not None:
            self.code = code  # type: ignore[misc]
        if status is not None:
            self.status = status  # type: ignore[misc]
        if retryable is not None:
            self.retryable = retryable  # type: ignore[misc]

    def to_body(self) -> dict[str, Any]:
        """The wire body: ``{"error": {...}}``; never carries secrets."""
        err: dict[str, Any] = {
            "code": self.code,
            "type": error_type(self.status),
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.param is not None:
            err["param"] = self.param
        if self.retry_after is not None:
            err["retry_after"] = self.retry_after
        err.update(self.details)
        return {"error": err}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class InvalidRequest(BatchyardError):
    code = "invalid_request"
    status = 400


class InvalidJson(InvalidRequest):
    code = "invalid_json"


class InvalidType(InvalidRequest):
    """A field has the wrong JSON type; nothing is coerced (``true`` is not 1, ``"5"`` not 5)."""

    code = "invalid_type"


class InvalidIdempotencyKey(InvalidRequest):
    code = "invalid_idempotency_key"


class UnknownModel(InvalidRequest):
    """A model nobody here serves: 404, as OpenAI's and Anthropic's own doors answer one,
    and before any rule between a body's fields (the name is what the request is about)."""

    code = "unknown_model"
    status = 404


class UnknownField(InvalidRequest):
    """A body field the endpoint does not know: refused rather than silently ignored."""

    code = "unknown_field"


class CapabilityUnsupported(InvalidRequest):
    """The model (its route) cannot do what the request asks: tools, streaming, embeddings..."""

    code = "capability_unsupported"


class ModelUnavailable(InvalidRequest):
    """The model is in the catalog but no route serves it yet."""

    code = "model_unavailable"


class UnsupportedInput(InvalidRequest):
    code = "unsupported_input"


class ContextWindowExceeded(InvalidRequest):
    code = "context_window_exceeded"


class NoDecisions(InvalidRequest):
    code = "no_decisions"


class TooFewOutcomes(InvalidRequest):
    code = "too_few_outcomes"


class DuplicateId(InvalidRequest):
    code = "duplicate_id"


class EmptyText(InvalidRequest):
    code = "empty_text"


class InvalidFilter(InvalidRequest):
    code = "invalid_filter"


class EmptyFilterResult(InvalidRequest):
    code = "filter_matches_no_rows"


class Unauthorized(BatchyardError):
    code = "unauthorized"
    status = 401


class MissingApiKey(Unauthorized):
    code = "missing_api_key"


class InvalidApiKey(Unauthorized):
    code = "invalid_api_key"


class InsufficientCredit(BatchyardError):
    """Nothing was charged; after buying credit the same key can succeed."""

    code = "insufficient_credit"
    status = 402
    retryable = True


class SpendCapExceeded(InsufficientCredit):
    """A key's or project's spend cap would be crossed; nothing was held.

    Not retryable as it stands: the cap must be raised, or the month turn.
    """

    code = "spend_cap_exceeded"
    retryable = False


class Forbidden(BatchyardError):
    code = "forbidden"
    status = 403


class InsufficientScope(Forbidden):
    code = "insufficient_scope"


class NotFound(BatchyardError):
    code = "not_found"
    status = 404


class ModelNotFound(NotFound):
    """OpenAI's answer to an unknown model on its own endpoints."""

    code = "model_not_found"


class Conflict(BatchyardError):
    code = "conflict"
    status = 409


class IdempotencyConflict(Conflict):
    code = "idempotency_conflict"


class IdempotencyResponseExpired(Conflict):
    code = "idempotency_response_expired"


class IdempotencyInProgress(Conflict):
    """Another request with this key is still running; try again shortly."""

    code = "idempotency_in_progress"
    retryable = True


class InvalidState(Conflict):
    code = "invalid_state"


class QuoteExpired(Conflict):
    code = "quote_expired"


class PayloadTooLarge(BatchyardError):
    code = "request_too_large"
    status = 413


class UnsupportedMediaType(BatchyardError):
    """A JSON body sent without ``Content-Type: application/json``."""

    code = "unsupported_media_type"
    status = 415


class RateLimited(BatchyardError):
    code = "rate_limited"
    status = 429
    retryable = True


class PendingLimitExceeded(BatchyardError):
    """Too much work waiting; it frees up as items finish, so it is retryable."""

    code = "pending_limit_exceeded"
    status = 429
    retryable = True


class UpstreamError(BatchyardError):
    """The engine or its upstream failed.

    ``not_taken``: the upstream said it did not take the call (503 Service
    Unavailable, before any token), so the call never reached the engine and
    a batch worker may send it again (``upstream_unavailable_retries``);
    anything else may have reached it, and is never sent twice.
    """

    code = "upstream_error"
    status = 502
    retryable = True

    def __init__(self, message: str, *, not_taken: bool = False, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.not_taken = not_taken


class UpstreamUnreachable(UpstreamError):
    """The route's upstream could not be connected to: nothing was sent.

    A door answers it as a retryable 502, as any upstream failure; the
    workers tell it apart, because a call that never left can wait for its
    route to come back instead of failing its line, row or item.
    """

    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    code = "upstream_timeout"
    status = 504


class UpstreamRateLimited(UpstreamError):
    code = "upstream_rate_limited"
    status = 503


class ModelOutputInvalid(UpstreamError):
    """The model answered something outside the allowed outcomes."""

    code = "model_output_invalid"
    retryable = False


class ModelWarming(BatchyardError):
    code = "model_warming"
    status = 503
    retryable = True


class ServiceUnavailable(BatchyardError):
    code = "service_unavailable"
    status = 503
    retryable = True


class BatchUnavailable(ServiceUnavailable):
    """Deferred batches cannot run: no encryption key is configured."""

    code = "batches_unavailable"
    retryable = False


class StorageUnavailable(ServiceUnavailable):
    """The store cannot be reached or cannot write (disk full, read-only, down).

    Each write is one transaction, so a failed one left nothing behind; the
    same request (same Idempotency-Key) can be sent again once the store is back.
    """

    code = "storage_unavailable"


class LimiterUnavailable(ServiceUnavailable):
    """The shared limiter (Redis) cannot be reached: nothing is admitted until it is back.

    The limiter fails closed: admitting without it could exceed an upstream's
    limits or a tier's spend for the whole fleet. Nothing was called or
    charged; send the same request again once the limiter is back.
    """

    code = "limiter_unavailable"


class InternalError(BatchyardError):
    code = "internal_error"
    status = 500
    retryable = True


def _all_subclasses(cls: type[BatchyardError]) -> list[type[BatchyardError]]:
    out: list[type[BatchyardError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_class_for_code(code: str) -> type[BatchyardError]:
    """The most specific class for a wire code, for clients that rebuild errors."""
    # The base shares InternalError's code only as a fallback; skip it so
    # ``internal_error`` rebuilds the retryable InternalError.
    for cls in _all_subclasses(BatchyardError)[1:]:
        if cls.code == code:
            return cls
    return BatchyardError
