"""The async client: every endpoint as a typed method, retries, optional pacing.

This module is the one definition of the client. ``sync_client.py`` is
generated from it by ``scripts/gen_sync_client.py`` (``make sync-client``
fails when it is stale), so the two cannot drift: edit here, then run
``python scripts/gen_sync_client.py``. The endpoints themselves are
``calls.py``; what to do after a failure is ``RetryPolicy.step`` in ``base.py``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, cast

import httpx

from batchyard.client import calls
from batchyard.client.pacer import MonotonicClock, PaceClock, Pacer
from batchyard.client.retries import (
    Call,
    ClientSettings,
    RetryPolicy,
    connection_failed,
    decode,
    error_from_response,
    log_retry,
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

__all__ = ["AsyncClient"]


class AsyncClient:
    """Talks to a batchyard gateway from asyncio code.

    With a ``pacer``, the calls that count against the requests limit
    (decide, chat) wait for their slot first, and a 429 moves the shared pace
    instead of each caller sleeping on its own, so many tasks sharing one
    client share one steady rate. ``clock`` does the other waits (between
    retries), so tests can count them instead of sleeping.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        max_retries: int = 2,
        timeout: float | None = None,
        pacer: Pacer | None = None,
        clock: PaceClock | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.settings = ClientSettings.resolve(base_url, api_key, timeout)
        self.retry = RetryPolicy(max_retries=max_retries)
        self.pacer = pacer
        self._clock: PaceClock = clock or (pacer.clock if pacer else MonotonicClock())
        self._http = http_client or httpx.AsyncClient(
            base_url=self.settings.base_url, timeout=self.settings.timeout
        )
        self._owns_http = http_client is None

    def __repr__(self) -> str:
        return f"AsyncClient(base_url={self.settings.base_url!r})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    def with_pacer(self, pacer: Pacer) -> AsyncClient:
        """This client, sharing its connections, with ``pacer`` on the paced calls."""
        view = copy.copy(self)
        view.pacer = pacer
        view._clock = pacer.clock
        view._owns_http = False
        return view

    async def send_raw(self, call: Call) -> httpx.Response:
        """Send with pacing and retries; the response of the attempt that succeeded."""
        pacer = self.pacer if call.paced else None
        attempt = 0
        while True:
            if pacer is not None:
                await pacer.wait(call.tokens)
            try:
                response = await self._http.request(
                    call.method, call.path, **request_kwargs(self.settings, call)
                )
            except httpx.TransportError as exc:
                error: BatchyardError = connection_failed(exc, self.settings.base_url)
                cause: BaseException | None = exc
            else:
                if response.is_success:
                    if pacer is not None:
                        pacer.answered()
                    return response
                error, cause = error_from_response(response), None
            slot = pacer.interval(call.tokens) if pacer is not None else None
            step = self.retry.step(attempt, error, slot=slot)
            if step is None:
                raise error from cause
            attempt = step.attempt
            log_retry(call, error, step)
            if pacer is not None and step.pacer:
                pacer.push_back(step.delay, slow=step.slow)
            else:
                await self._clock.sleep(step.delay)

    async def send(self, call: Call) -> Any:
        return decode(await self.send_raw(call))

    # decide ---------------------------------------------------------------

    async def decide(
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
        tokens: int = 0,
    ) -> DecideResponse:
        """Every question about one text in one request; ``tokens`` feeds the pacer."""
        body = calls.decide_body(
            model=model,
            decisions=decisions,
            input=calls.decide_input(text, image_url, input),
            max_output_tokens=max_output_tokens,
            fallback=fallback,
            calibration=calibration,
        )
        return cast(DecideResponse, await self.send(calls.decide(body, idempotency_key, tokens)))

    async def estimate(
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
        return cast(EstimateResponse, await self.send(calls.estimate(body)))

    # account and models ---------------------------------------------------

    async def account(self) -> Account:
        return cast(Account, await self.send(calls.account()))

    async def list_models(self) -> ModelList:
        return cast(ModelList, await self.send(calls.list_models()))

    async def get_model(self, model_id: str) -> Model:
        return cast(Model, await self.send(calls.get_model(model_id)))

    async def keep_warm(
        self, model_id: str, minutes: int = 30, *, idempotency_key: str | None = None
    ) -> KeepWarm:
        call = calls.keep_warm(model_id, minutes, idempotency_key)
        return cast(KeepWarm, await self.send(call))

    async def chat_completion(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        idempotency_key: str | None = None,
        **params: Any,
    ) -> ChatCompletion:
        body = {"model": model, "messages": [dict(m) for m in messages], **params}
        call = calls.chat_completion(body, idempotency_key)
        return cast(ChatCompletion, await self.send(call))

    # deferred batches -------------------------------------------------------

    async def create_batch(
        self,
        requests: Sequence[BatchRequest],
        *,
        min_discount: float,
        completion_window: str = "24h",
        idempotency_key: str | None = None,
    ) -> Batch:
        call = calls.create_batch(requests, min_discount, completion_window, idempotency_key)
        return cast(Batch, await self.send(call))

    async def get_batch(self, batch_id: str) -> Batch:
        return cast(Batch, await self.send(calls.get_batch(batch_id)))

    async def batch_results(self, batch_id: str) -> AsyncIterator[BatchResultLine]:
        """The NDJSON results, one parsed line at a time."""
        response = await self.send_raw(calls.batch_results(batch_id))
        async for line in response.aiter_lines():
            if line.strip():
                yield cast(BatchResultLine, json.loads(line))

    async def batch_finished(
        self, batch_id: str, *, after: str = "0", limit: int = 100
    ) -> dict[str, Any]:
        """One page of what ended after the cursor ``after``: ``data``, ``cursor``, ``ended``."""
        return cast(dict[str, Any], await self.send(calls.batch_finished(batch_id, after, limit)))

    def follow_batch(
        self, batch_id: str, *, after: str = "0", poll: float = 2.0
    ) -> AsyncIterator[dict[str, Any]]:
        """Every line (file batch) or item (deferred batch) once, as it ends, until the batch has.

        Each is what the final results will hold for it. Between empty pages
        it waits ``poll`` seconds on the client's clock; pass a later
        ``after`` (a page's ``cursor``) to resume where an earlier reader stopped.
        """
        return self._follow(lambda at: calls.batch_finished(batch_id, at, 1000), after, poll)

    async def _follow(
        self, page_at: Callable[[str], Call], after: str, poll: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The one follow loop of every ``/finished``: pages from a cursor until ``ended``."""
        cursor = after
        while True:
            page = cast(dict[str, Any], await self.send(page_at(cursor)))
            for item in page["data"]:
                yield item
            cursor = page["cursor"]
            if page["has_more"]:
                continue
            if page["ended"]:
                return
            await self._clock.sleep(poll)

    async def cancel_batch(self, batch_id: str, *, idempotency_key: str | None = None) -> Batch:
        return cast(Batch, await self.send(calls.cancel_batch(batch_id, idempotency_key)))

    async def list_activity(self, **params: str) -> dict[str, Any]:
        return cast(dict[str, Any], await self.send(calls.list_activity(params)))

    # projects, datasets, batch inference runs ------------------------------

    async def create_project(
        self, body: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        call = calls.create_project(body, idempotency_key)
        return cast(dict[str, Any], await self.send(call))

    async def get_project(self, project_id: str) -> dict[str, Any]:
        return cast(dict[str, Any], await self.send(calls.get_project(project_id)))

    async def upload_dataset(
        self,
        project_id: str,
        filename: str,
        content: bytes,
        *,
        fields: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        call = calls.upload_dataset(project_id, filename, content, fields, idempotency_key)
        return cast(dict[str, Any], await self.send(call))

    async def dataset_rows(
        self, project_id: str, dataset_id: str, *, cursor: str | None = None
    ) -> dict[str, Any]:
        call = calls.dataset_rows(project_id, dataset_id, cursor)
        return cast(dict[str, Any], await self.send(call))

    async def create_run(
        self, project_id: str, body: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        call = calls.create_run(project_id, body, idempotency_key)
        return cast(dict[str, Any], await self.send(call))

    async def get_run(self, project_id: str, run_id: str) -> dict[str, Any]:
        return cast(dict[str, Any], await self.send(calls.get_run(project_id, run_id)))

    async def confirm_run(
        self, project_id: str, run_id: str, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        call = calls.confirm_run(project_id, run_id, idempotency_key)
        return cast(dict[str, Any], await self.send(call))

    async def cancel_run(
        self, project_id: str, run_id: str, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        call = calls.cancel_run(project_id, run_id, idempotency_key)
        return cast(dict[str, Any], await self.send(call))

    async def retry_run(
        self, project_id: str, run_id: str, *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """A new run of an ended run's failed and canceled rows, quoted; confirm it to start."""
        call = calls.retry_run(project_id, run_id, idempotency_key)
        return cast(dict[str, Any], await self.send(call))

    async def run_finished(
        self, project_id: str, run_id: str, *, after: str = "0", limit: int = 100
    ) -> dict[str, Any]:
        """One page of the rows that ended after the cursor ``after``: ``data``, ``cursor``."""
        call = calls.run_finished(project_id, run_id, after, limit)
        return cast(dict[str, Any], await self.send(call))

    def follow_run(
        self, project_id: str, run_id: str, *, after: str = "0", poll: float = 2.0
    ) -> AsyncIterator[dict[str, Any]]:
        """Every row of a run once, as it ends, until the run has (``follow_batch``'s loop).

        Each as ``…/finished`` shows it: its ``outputs`` while they wait in the
        run, ``written`` once they are in the dataset.
        """
        return self._follow(
            lambda at: calls.run_finished(project_id, run_id, at, 1000), after, poll
        )

    async def list_runs(
        self, project_id: str, *, status: str | None = None, cursor: str | None = None
    ) -> dict[str, Any]:
        call = calls.list_runs(project_id, status, cursor)
        return cast(dict[str, Any], await self.send(call))
