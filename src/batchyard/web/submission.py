"""A batch submitted from the workspace form, under the API's own rules.

The form posts the same JSON body as ``POST /v1/batches`` and an
Idempotency-Key. Parsing, privacy, sealing, the submission rate and the
pending limit are the API module's functions, and the idempotency record is
fingerprinted as ``POST /v1/batches``: a key used in the workspace and then
with curl (same body) names the same batch, and a double-clicked submit
replays the first answer instead of queueing twice.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection

from batchyard.api import batches as api_batches
from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.errors import BatchyardError, InvalidJson, PayloadTooLarge
from batchyard.service import Service
from batchyard.store import idempotency as idem_store
from batchyard.work.market import market_of

__all__ = ["EXAMPLE", "Outcome", "submit_text"]

log = logging.getLogger("batchyard.web")

#: The path the idempotency fingerprint names, so both doors share keys.
API_PATH = "/v1/batches"

#: What the New batch form starts with: seed 003's example on the local model.
EXAMPLE = {
    "min_discount": 90,
    "completion_window": "24h",
    "requests": [
        {
            "custom_id": "release-summary",
            "body": {
                "model": "kettei-core",
                "messages": [{"role": "user", "content": "Summarize this public release note."}],
                "max_tokens": 64,
                "privacy": {"mode": "redact"},
            },
        }
    ],
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a submission answered: the status and JSON body the API would have sent."""

    status: int
    body: dict[str, Any]
    replayed: bool = False


def _parse_json(text: str) -> dict[str, Any]:
    if len(text.encode("utf-8")) > api_batches.MAX_BODY_BYTES:
        raise PayloadTooLarge(f"the batch JSON is over {api_batches.MAX_BODY_BYTES} bytes")
    if not text.strip():
        raise InvalidJson("the batch JSON is empty; paste a JSON object")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise InvalidJson(f"the batch JSON is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidJson("the batch JSON must be a JSON object")
    return raw


async def _once(
    svc: Service,
    principal: Principal,
    key: str,
    raw: dict[str, Any],
    handler: Callable[[], Awaitable[dict[str, Any]]],
) -> Outcome:
    """``api.context.idempotent``'s rules without an HTTP request to read them from."""
    fp = idem_rules.fingerprint("POST", API_PATH, raw)
    now = svc.clock.now()
    ttl = timedelta(seconds=svc.settings.idempotency_ttl_s)
    org = principal.org_id

    def claim(conn: Connection) -> idem_rules.SavedResponse | None:
        return idem_store.begin(conn, org, key, fp, now, ttl)

    saved = await svc.db.run(claim)
    if saved is not None:
        return Outcome(saved.status_code, json.loads(saved.body), replayed=True)
    keep = not principal.zero_data_retention
    try:
        view = await handler()
    except BatchyardError as exc:
        if exc.retryable or not keep:
            await svc.db.run(lambda c: idem_store.forget(c, org, key))
        else:
            text, status = json.dumps(exc.to_body()), exc.status
            await svc.db.run(lambda c: idem_store.finish(c, org, key, status, text))
        raise
    except BaseException:
        await svc.db.run(lambda c: idem_store.forget(c, org, key))
        raise
    if keep:
        text = json.dumps(view)
        await svc.db.run(lambda c: idem_store.finish(c, org, key, 201, text))
    else:
        await svc.db.run(lambda c: idem_store.forget(c, org, key))
    return Outcome(201, view)


async def submit_text(svc: Service, principal: Principal, text: str, key: str) -> Outcome:
    """Submit the form's JSON under ``key``; raises the API's errors, queueing nothing."""
    market_of(svc).sealer()
    raw = _parse_json(text)
    sub = api_batches.parse_submission(svc, raw)
    idem_rules.validate_key(key, min_len=8)

    async def handler() -> dict[str, Any]:
        return await api_batches.store_submission(svc, principal, sub)

    outcome = await _once(svc, principal, key, raw, handler)
    log.info(
        "workspace submission",
        extra={
            "event": "workspace_submission",
            "org_id": principal.org_id,
            "status": outcome.status,
            "replayed": outcome.replayed,
        },
    )
    return outcome
