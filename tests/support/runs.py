"""Helpers shared by the batch inference run tests: upload, create, wait, read."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import httpx

from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.core.sections import RunSettings
from batchyard.engines.protocol import Completion, CompletionRequest

RUNS = {"poll_s": 0.02, "heartbeat_s": 0.2}
ISO = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$"


def fast_runs(**runs: Any) -> RunSettings:
    """Run timings fast enough for tests (``RUNS``), with ``runs`` over them."""
    return RunSettings(**{**RUNS, **runs})


def http_catalog(base_url: str, **route: Any) -> Catalog:
    model = ModelSpec(
        "kettei-core",
        Decimal("0.10"),
        Decimal("0.40"),
        2048,
        tokenizer="default",
        max_output_tokens=1024,
    )
    return Catalog(
        [model],
        [RouteSpec("fake", "kettei-core", "openai_http", "fake-model", base_url=base_url, **route)],
    )


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


class Api:
    """The run API over a real HTTP client, for one account and project."""

    def __init__(self, http: httpx.AsyncClient, headers: dict[str, str]) -> None:
        self.http = http
        self.headers = headers
        self.project = ""
        self.keys = 0

    async def start(self) -> Api:
        r = await self.http.post("/v1/projects", json={"name": "p"}, headers=self.headers)
        assert r.status_code == 201, r.text
        self.project = r.json()["id"]
        return self

    @property
    def runs(self) -> str:
        return f"/v1/projects/{self.project}/batch-inference-runs"

    async def upload(self, rows: list[dict[str, Any]], name: str = "ds") -> dict[str, Any]:
        r = await self.http.post(
            f"/v1/projects/{self.project}/datasets",
            params={"name": name},
            content=jsonl(rows),
            headers={**self.headers, "Content-Type": "application/x-ndjson"},
        )
        assert r.status_code == 201, r.text
        body: dict[str, Any] = r.json()
        return body

    async def rows(self, dataset_id: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if cursor:
                params["cursor"] = cursor
            r = await self.http.get(
                f"/v1/projects/{self.project}/datasets/{dataset_id}/rows",
                params=params,
                headers=self.headers,
            )
            body = r.json()
            out += body["data"]
            cursor = body["nextCursor"]
            if not cursor:
                return out

    async def create(self, body: dict[str, Any], key: str | None = None) -> httpx.Response:
        self.keys += 1
        headers = {**self.headers, "Idempotency-Key": key or f"key-{self.keys}"}
        return await self.http.post(self.runs, json=body, headers=headers)

    async def get(self, run_id: str) -> dict[str, Any]:
        r = await self.http.get(f"{self.runs}/{run_id}", headers=self.headers)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    async def post(self, run_id: str, action: str) -> httpx.Response:
        return await self.http.post(f"{self.runs}/{run_id}/{action}", headers=self.headers)

    async def confirmed(self, rows: list[dict[str, Any]], body: dict[str, Any]) -> tuple[str, str]:
        """Upload ``rows``, create a run of ``body`` over them, wait for its quote, confirm it.

        The run's ID and its dataset's; a worker (here or in another process) quotes it.
        """
        ds = await self.upload(rows)
        created = await self.create({**body, "datasetId": ds["id"]})
        assert created.status_code == 201, created.text
        run_id: str = created.json()["id"]
        await self.wait(run_id, "awaiting_confirmation")
        confirmed = await self.post(run_id, "confirm")
        assert confirmed.status_code == 200, confirmed.text
        return run_id, ds["id"]

    async def status_in(self, run_id: str, *statuses: str) -> bool:
        return (await self.get(run_id))["status"] in statuses

    async def wait(self, run_id: str, *statuses: str) -> dict[str, Any]:
        """Poll until the run reaches one of ``statuses`` (the worker runs on its own).

        No deadline of its own: how long a quote or a run takes on the real model
        depends on the machine (beside other work, many times longer), so a run
        that ends anywhere else fails at once, and one that never moves is the
        test's timeout.
        """
        while True:
            run = await self.get(run_id)
            if run["status"] in statuses:
                return run
            assert run["status"] not in {"failed", "canceled", "completed"} - set(statuses), run
            await asyncio.sleep(0.02)


class GatedEngine:
    """Answers once the test opens the gate; counts every prompt it was sent."""

    name = "gated"

    def __init__(self, open_first: int = 0) -> None:
        self.gate = asyncio.Event()
        self.open_first = open_first
        self.prompts: list[str] = []

    async def complete(self, request: CompletionRequest) -> Completion:
        from batchyard.engines.protocol import Choice, Usage

        text = request.messages[-1]["content"]
        self.prompts.append(text)
        if len(self.prompts) > self.open_first:
            await self.gate.wait()
        return Completion(
            model=request.model,
            choices=[Choice(f"answer to {text}") for _ in range(request.n)],
            usage=Usage(len(text.split()), 3 * request.n),
        )

    async def aclose(self) -> None:
        return None


#: A run of the ``text`` field into the ``answer`` field, 8 tokens at most a row.
FIELD_RUN: dict[str, Any] = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}


class RowEngine:
    """Answers ``answer to <prompt>``; a prompt naming ``fail_word`` fails until ``healed``.

    ``gated``: each answer waits for one ``release()``, so a test reads between answers.
    Every prompt it was sent is kept, in order.
    """

    name = "rows"

    def __init__(self, fail_word: str = "fail", *, gated: bool = False) -> None:
        self.fail_word = fail_word
        self.healed = False
        self.gated = gated
        self.prompts: list[str] = []
        self._gate = asyncio.Semaphore(0)

    def release(self) -> None:
        self._gate.release()

    async def complete(self, request: CompletionRequest) -> Completion:
        from batchyard.engines.protocol import Choice, Usage
        from batchyard.errors import ModelOutputInvalid

        text = str(request.messages[-1]["content"])
        self.prompts.append(text)
        if self.fail_word in text and not self.healed:
            raise ModelOutputInvalid("the model answered outside the schema")
        if self.gated:
            await self._gate.acquire()
        return Completion(
            model=request.model, choices=[Choice(f"answer to {text}")], usage=Usage(3, 3)
        )

    async def aclose(self) -> None:
        return None
