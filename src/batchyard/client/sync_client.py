"""The sync client: the async client's methods, for scripts and notebooks.

Kept as its own class over ``httpx.Client`` rather than a wrapper that runs
the async client in a loop, so it works where a loop is already running
(Jupyter) and costs no thread. The endpoints themselves live in ``calls.py``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, cast

import httpx

from batchyard.client import calls
from batchyard.client.base import (
    Call,
    RetryPolicy,
    Settings,
    connection_failed,
    decode,
    error_from_response,
    request_kwargs,
)
from batchyard.client.types import (
    Account,
    Batch,
    BatchRequest,
    BatchResultLine,
    ChatCompletion,
    DecideInput,
    DecideResponse,
    Decision,
    EstimateResponse,
    KeepWarm,
    Model,
    ModelList,
)
from batchyard.errors import BatchyardError

__all__ = ["Client"]

log = logging.getLogger("batchyard.client")


class Client:
    """Talks to a batchyard gateway from plain (blocking) code."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        max_retries: int = 2,
        timeout: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        http_client: httpx.Client | None = None,
    ) -> None:
        self.settings = Settings.resolve(base_url, api_key, timeout)
        self.retry = RetryPolicy(max_retries=max_retries)
        self._sleep = sleep
        self._http = http_client or httpx.Client(
            base_url=self.settings.base_url, timeout=self.settings.timeout
        )
        self._owns_http = http_client is None

    def __repr__(self) -> str:
        return f"Client(base_url={self.settings.base_url!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def send_raw(self, call: Call) -> httpx.Response:
        """Send with retries; the response of the attempt that succeeded."""
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    call.method, call.path, **request_kwargs(self.settings, call)
                )
            except httpx.TransportError as exc:
                error: BatchyardError = connection_failed(exc, self.settings.base_url)
                cause: BaseException | None = exc
            else:
                if response.is_success:
                    return response
                error, cause = error_from_response(response), None
            delay = self.retry.delay(attempt, error)
            if delay is None:
                raise error from cause
            attempt += 1
            log.info(
                "retrying",
                extra={
                    "method": call.method,
                    "path": call.path,
                    "code": error.code,
                    "status": error.status,
                    "attempt": attempt,
                    "delay_s": round(delay, 3),
                },
            )
            self._sleep(delay)

    def send(self, call: Call) -> Any:
        return decode(self.send_raw(call))

    # decide ---------------------------------------------------------------

    def decide(
        self,
        *,
        model: str,
        decisions: Sequence[Decision],
        text: str | None = None,
        image_url: str | None = None,
        input: DecideInput | None = None,
        max_output_tokens: int = 64,
        fallback: str = "base",
        calibration: str | None = None,
        idempotency_key: str | None = None,
    ) -> DecideResponse:
        """Every question about one text in one request."""
        body = calls.decide_body(
            model=model,
            decisions=decisions,
            input=calls.decide_input(text, image_url, input),
            max_output_tokens=max_output_tokens,
            fallback=fallback,
            calibration=calibration,
        )
        return cast(DecideResponse, self.send(calls.decide(body, idempotency_key)))

    def estimate(
        self,
        *,
        model: str,
        decisions: Sequence[Decision],
        text: str | None = None,
        image_url: str | None = None,
        input: DecideInput | None = None,
        max_output_tokens: int = 64,
        fallback: str = "base",
        calibration: str | None = None,
    ) -> EstimateResponse:
        body = calls.decide_body(
            model=model,
            decisions=decisions,
            input=calls.decide_input(text, image_url, input),
            max_output_tokens=max_output_tokens,
            fallback=fallback,
            calibration=calibration,
        )
        return cast(EstimateResponse, self.send(calls.estimate(body)))

    # account and models ---------------------------------------------------

    def account(self) -> Account:
        return cast(Account, self.send(calls.account()))

    def list_models(self) -> ModelList:
        return cast(ModelList, self.send(calls.list_models()))

    def get_model(self, model_id: str) -> Model:
        return cast(Model, self.send(calls.get_model(model_id)))

    def keep_warm(
        self, model_id: str, minutes: int = 30, *, idempotency_key: str | None = None
    ) -> KeepWarm:
        call = calls.keep_warm(model_id, minutes, idempotency_key)
        return cast(KeepWarm, self.send(call))

    def chat_completion(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        idempotency_key: str | None = None,
        **params: Any,
    ) -> ChatCompletion:
        body = {"model": model, "messages": [dict(m) for m in messages], **params}
        call = calls.chat_completion(body, idempotency_key)
        return cast(ChatCompletion, self.send(call))

    # deferred batches -------------------------------------------------------

    def create_batch(
        self,
        requests: Sequence[BatchRequest],
        *,
        min_discount: float,
        completion_window: str = "24h",
        idempotency_key: str | None = None,
    ) -> Batch:
        call = calls.create_batch(requests, min_discount, completion_window, idempotency_key)
        return cast(Batch, self.send(call))

    def get_batch(self, batch_id: str) -> Batch:
        return cast(Batch, self.send(calls.get_batch(batch_id)))

    def batch_results(self, batch_id: str) -> Iterator[BatchResultLine]:
        """The NDJSON results, one parsed line at a time."""
        response = self.send_raw(calls.batch_results(batch_id))
        for line in response.iter_lines():
            if line.strip():
                yield cast(BatchResultLine, json.loads(line))

    def cancel_batch(self, batch_id: str, *, idempotency_key: str | None = None) -> Batch:
        return cast(Batch, self.send(calls.cancel_batch(batch_id, idempotency_key)))

    def list_activity(self, **params: str) -> dict[str, Any]:
        return cast(dict[str, Any], self.send(calls.list_activity(params)))

    # projects, datasets, batch inference runs ------------------------------

    def create_project(
        self, body: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        call = calls.create_project(body, idempotency_key)
        return cast(dict[str, Any], self.send(call))

    def get_project(self, project_id: str) -> dict[str, Any]:
        return cast(dict[str, Any], self.send(calls.get_project(project_id)))

    def upload_dataset(
        self,
        project_id: str,
        filename: str,
        content: bytes,
        *,
        fields: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        call = calls.upload_dataset(project_id, filename, content, fields, idempotency_key)
        return cast(dict[str, Any], self.send(call))

    def dataset_rows(
        self, project_id: str, dataset_id: str, *, cursor: str | None = None
    ) -> dict[str, Any]:
        call = calls.dataset_rows(project_id, dataset_id, cursor)
        return cast(dict[str, Any], self.send(call))

    def create_run(
        self, project_id: str, body: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        call = calls.create_run(project_id, body, idempotency_key)
        return cast(dict[str, Any], self.send(call))

    def get_run(self, project_id: str, run_id: str) -> dict[str, Any]:
        return cast(dict[str, Any], self.send(calls.get_run(project_id, run_id)))

    def confirm_run(
        self, project_id: str, run_id: str, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        call = calls.confirm_run(project_id, run_id, idempotency_key)
        return cast(dict[str, Any], self.send(call))

    def cancel_run(
        self, project_id: str, run_id: str, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        call = calls.cancel_run(project_id, run_id, idempotency_key)
        return cast(dict[str, Any], self.send(call))

    def list_runs(
        self, project_id: str, *, status: str | None = None, cursor: str | None = None
    ) -> dict[str, Any]:
        call = calls.list_runs(project_id, status, cursor)
        return cast(dict[str, Any], self.send(call))
