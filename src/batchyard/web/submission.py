"""A batch submitted from the workspace form, under the API's own rules.

The form posts the same JSON body as ``POST /v1/batches`` and an
Idempotency-Key. Parsing, privacy, sealing, the submission rate and the
pending limit are ``service.deferred_batches``' and the idempotency rules are
``service.idempotency.run_once``, with the record fingerprinted as ``POST
/v1/batches``: a key used in the workspace and then with curl (same body)
names the same batch, and a double-clicked submit replays the first answer
instead of queueing twice.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.core.inputs import parse_json
from batchyard.errors import InvalidJson, PayloadTooLarge
from batchyard.service import Service, deferred_batches
from batchyard.service.batch_requests import MAX_BODY_BYTES, parse_submission
from batchyard.service.idempotency import run_once

__all__ = ["EXAMPLE", "Submitted", "submit_text"]

log = logging.getLogger("batchyard.web")

#: The path the idempotency fingerprint names, so both doors share keys.
API_PATH = "/v1/batches"

#: What the New batch form starts with: the example of docs/reference/batches.md on the local model.
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
class Submitted:
    """What a submission answered: the status and JSON body the API would have sent."""

    status: int
    body: dict[str, Any]
    replayed: bool = False


def _parse_json(text: str) -> dict[str, Any]:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"the batch JSON is over {MAX_BODY_BYTES} bytes")
    if not text.strip():
        raise InvalidJson("the batch JSON is empty; paste a JSON object")
    raw = parse_json(text, "the batch JSON")
    if not isinstance(raw, dict):
        raise InvalidJson("the batch JSON must be a JSON object")
    return raw


async def submit_text(svc: Service, principal: Principal, text: str, key: str) -> Submitted:
    """Submit the form's JSON under ``key``; raises the API's errors, queueing nothing."""
    svc.batch_key.require()
    raw = _parse_json(text)
    sub = parse_submission(svc, raw, principal.org_id)
    idem_rules.validate_key(key, min_len=8)

    async def handler() -> tuple[int, Any]:
        return 201, await deferred_batches.submit(svc, principal, sub)

    fingerprint = idem_rules.fingerprint("POST", API_PATH, raw)
    answer = await run_once(svc, principal, key, fingerprint, handler, answers_text=False)
    outcome = Submitted(answer.status, json.loads(answer.text), replayed=answer.replayed)
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
