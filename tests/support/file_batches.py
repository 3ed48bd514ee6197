"""Helpers for OpenAI-dialect file batches: JSONL lines, uploads, creation, a worker."""

from __future__ import annotations

import json
from typing import Any

import httpx

from batchyard.app import file_batch_worker
from batchyard.service import Service
from batchyard.store import file_batches as fstore
from batchyard.work.file_batches.file_batch_worker import FileBatchWorker

CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, text: str = "Say hi.", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "model": "kettei-core",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 8,
            **body,
        },
    }


def jsonl(lines: list[dict[str, Any]] | list[str]) -> bytes:
    return "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines).encode()


async def upload(
    http: httpx.AsyncClient,
    headers: dict[str, str],
    content: bytes,
    *,
    purpose: str = "batch",
    filename: str = "requests.jsonl",
    **fields: str,
) -> httpx.Response:
    return await http.post(
        "/v1/files",
        headers=headers,
        data={"purpose": purpose, **fields},
        files={"file": (filename, content, "application/jsonl")},
    )


async def create(
    http: httpx.AsyncClient,
    headers: dict[str, str],
    file_id: str,
    *,
    endpoint: Any = CHAT,
    window: Any = "24h",
    **extra: Any,
) -> httpx.Response:
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window, **extra}
    return await http.post("/v1/batches", headers=headers, json=body)


def worker(service: Service, owner: str | None = None) -> FileBatchWorker:
    return file_batch_worker(service, owner=owner)


def lines_of(service: Service, batch_id: str) -> list[Any]:
    from sqlalchemy import select

    fbl = fstore.file_batch_lines

    def load(c: Any) -> list[Any]:
        return list(c.execute(select(fbl).where(fbl.c.batch_id == batch_id).order_by(fbl.c.line)))

    return service.db.read_sync(load)


def parse_lines(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(x) for x in content.splitlines() if x.strip()]
