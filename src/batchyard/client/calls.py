"""Every endpoint as a ``Call``: path, body and idempotency, once for both clients.

A state-changing POST always carries an Idempotency-Key: the caller's, or a
fresh one made here, before the first attempt, so the automatic retries of
that request send the same key and the server runs it at most once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import quote

from batchyard.client.retries import Call, new_idempotency_key
from batchyard.client.types import BatchRequest, DecideInput, Decision

__all__ = [
    "account",
    "batch_finished",
    "batch_results",
    "cancel_batch",
    "cancel_run",
    "chat_completion",
    "confirm_run",
    "create_batch",
    "create_project",
    "create_run",
    "dataset_rows",
    "decide",
    "decide_body",
    "decide_input",
    "estimate",
    "get_batch",
    "get_model",
    "get_project",
    "get_run",
    "keep_warm",
    "list_activity",
    "list_models",
    "list_runs",
    "retry_run",
    "run_finished",
    "upload_dataset",
]


def _seg(value: str) -> str:
    """One path segment, escaped so an id can never change the path."""
    return quote(value, safe="")


def _key(key: str | None) -> str:
    return key if key is not None else new_idempotency_key()


def decide_input(text: str | None, image_url: str | None, input: DecideInput | None) -> DecideInput:
    if input is not None:
        return input
    if text is not None:
        return {"text": text}
    if image_url is not None:
        return {"image_url": image_url}
    raise ValueError("give text, image_url or input")


def decide_body(
    *,
    model: str,
    decisions: Sequence[Decision],
    input: DecideInput,
    max_output_tokens: int = 64,
    fallback: str = "base",
    calibration: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "input": dict(input),
        "decisions": [dict(d) for d in decisions],
        "max_output_tokens": max_output_tokens,
        "fallback": fallback,
    }
    # Left out unless chosen, so bodies (and idempotency keys) stay as before.
    if calibration is not None:
        body["calibration"] = calibration
    return body


def decide(body: dict[str, Any], key: str | None, tokens: int = 0) -> Call:
    return Call("POST", "/v1/decide", body, idempotency_key=_key(key), paced=True, tokens=tokens)


def estimate(body: dict[str, Any]) -> Call:
    # Charges nothing and changes nothing: no idempotency key needed.
    return Call("POST", "/v1/decide/estimate", body)


def account() -> Call:
    return Call("GET", "/v1/account")


def list_models() -> Call:
    return Call("GET", "/v1/models")


def get_model(model_id: str) -> Call:
    return Call("GET", f"/v1/models/{_seg(model_id)}")


def keep_warm(model_id: str, minutes: int, key: str | None) -> Call:
    return Call(
        "POST",
        f"/v1/models/{_seg(model_id)}/keep-warm",
        {"minutes": minutes},
        idempotency_key=_key(key),
    )


def chat_completion(body: dict[str, Any], key: str | None) -> Call:
    return Call("POST", "/v1/chat/completions", body, idempotency_key=_key(key), paced=True)


def create_batch(
    requests: Sequence[BatchRequest],
    min_discount: float,
    completion_window: str,
    key: str | None,
) -> Call:
    body = {
        "min_discount": min_discount,
        "completion_window": completion_window,
        "requests": [dict(r) for r in requests],
    }
    return Call("POST", "/v1/batches", body, idempotency_key=_key(key))


def get_batch(batch_id: str) -> Call:
    return Call("GET", f"/v1/batches/{_seg(batch_id)}")


def batch_results(batch_id: str) -> Call:
    return Call("GET", f"/v1/batches/{_seg(batch_id)}/results")


def batch_finished(batch_id: str, after: str, limit: int) -> Call:
    """The lines (file batch) or items (deferred batch) that ended after the cursor ``after``."""
    params = {"after": after, "limit": str(limit)}
    return Call("GET", f"/v1/batches/{_seg(batch_id)}/finished", params=params)


def cancel_batch(batch_id: str, key: str | None) -> Call:
    return Call("POST", f"/v1/batches/{_seg(batch_id)}/cancel", idempotency_key=_key(key))


def list_activity(params: Mapping[str, str]) -> Call:
    return Call("GET", "/v1/activity", params=params or None)


def create_project(body: Mapping[str, Any], key: str | None) -> Call:
    return Call("POST", "/v1/projects", dict(body), idempotency_key=_key(key))


def get_project(project_id: str) -> Call:
    return Call("GET", f"/v1/projects/{_seg(project_id)}")


#: The media type of an uploaded dataset, by its file name's extension.
_DATASET_MEDIA_TYPES = {
    ".jsonl": "application/x-ndjson",
    ".ndjson": "application/x-ndjson",
    ".csv": "text/csv",
    ".parquet": "application/vnd.apache.parquet",
}


def upload_dataset(
    project_id: str,
    filename: str,
    content: bytes,
    fields: Mapping[str, str] | None,
    key: str | None,
) -> Call:
    """The file as the request body, its format from ``filename``, ``fields`` in the query.

    ``fields`` are the upload's query parameters (``name``, ``kind``); the name
    defaults to the file's name without its extension.
    """
    path = PurePosixPath(filename)
    media_type = _DATASET_MEDIA_TYPES.get(path.suffix.lower())
    if media_type is None:
        known = ", ".join(sorted(_DATASET_MEDIA_TYPES))
        raise ValueError(f"{filename}: a dataset file ends in one of {known}")
    params = {"name": path.stem, **(fields or {})}
    return Call(
        "POST",
        f"/v1/projects/{_seg(project_id)}/datasets",
        params=params,
        idempotency_key=_key(key),
        content=(content, media_type),
    )


def dataset_rows(project_id: str, dataset_id: str, cursor: str | None) -> Call:
    path = f"/v1/projects/{_seg(project_id)}/datasets/{_seg(dataset_id)}/rows"
    return Call("GET", path, params={"cursor": cursor} if cursor else None)


def _runs(project_id: str) -> str:
    return f"/v1/projects/{_seg(project_id)}/batch-inference-runs"


def create_run(project_id: str, body: Mapping[str, Any], key: str | None) -> Call:
    return Call("POST", _runs(project_id), dict(body), idempotency_key=_key(key))


def get_run(project_id: str, run_id: str) -> Call:
    return Call("GET", f"{_runs(project_id)}/{_seg(run_id)}")


def confirm_run(project_id: str, run_id: str, key: str | None) -> Call:
    return Call("POST", f"{_runs(project_id)}/{_seg(run_id)}/confirm", idempotency_key=_key(key))


def cancel_run(project_id: str, run_id: str, key: str | None) -> Call:
    return Call("POST", f"{_runs(project_id)}/{_seg(run_id)}/cancel", idempotency_key=_key(key))


def retry_run(project_id: str, run_id: str, key: str | None) -> Call:
    return Call("POST", f"{_runs(project_id)}/{_seg(run_id)}/retry", idempotency_key=_key(key))


def run_finished(project_id: str, run_id: str, after: str, limit: int) -> Call:
    """The rows of a run that ended after the cursor ``after``."""
    params = {"after": after, "limit": str(limit)}
    return Call("GET", f"{_runs(project_id)}/{_seg(run_id)}/finished", params=params)


def list_runs(project_id: str, status: str | None, cursor: str | None) -> Call:
    params = {k: v for k, v in (("status", status), ("cursor", cursor)) if v}
    return Call("GET", _runs(project_id), params=params or None)
