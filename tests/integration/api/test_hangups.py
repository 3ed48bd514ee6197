"""A client that hangs up on a whole (not streamed) answer stops its generation, and pays for it.

The real embedded model on a real socket, one slot wide: a text completion
that counts on and on (``max_tokens`` 1024) is sent under an Idempotency-Key,
and the socket is closed a moment later. Whatever the machine's speed, the
relations hold: the call is settled to exactly what the engine produced, well
short of 1024 tokens; the disconnect is logged once, as an info line naming
the call; the retry under the key replays the answer instead of running
again; and the next request, which needs the only slot, is answered after
the abandoned one ended, not after its 1024 tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from batchyard.store import activity
from tests.support.accounts import make_account
from tests.support.server import live_server
from tests.support.waits import HANG_S, until

pytestmark = pytest.mark.model

COUNTING = {
    "model": "kettei-core",
    "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,",
    "max_tokens": 1024,
    "temperature": 0,
}


def charges(service, org_id: str) -> list[dict]:
    rows = service.db.read_sync(lambda c: activity.list_activity(c, org_id, limit=100))
    return [r for r in rows if r["kind"] == "charge"]


async def abandon(base: str, headers: dict[str, str], body: dict, after_s: float) -> None:
    """Send ``body`` on a raw socket, then close it without reading the answer."""
    host, port = base.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    head = "".join(
        [
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
            *(f"{k}: {v}\r\n" for k, v in headers.items()),
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n",
        ]
    ).encode()
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + raw)
    await writer.drain()
    await asyncio.sleep(after_s)  # a client's timeout: how long it is, is not the point
    writer.close()
    await writer.wait_closed()


async def test_a_hang_up_stops_the_generation_charges_what_was_made_and_replays(
    make_service, caplog
):
    service = make_service(embedded_slots=1)
    acct = make_account(service, credit="5")
    caplog.set_level(logging.INFO, logger="batchyard.api")

    def hangups() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "event", None) == "client_disconnected"]

    async with (
        live_server(service) as base,
        httpx.AsyncClient(base_url=base, timeout=HANG_S) as http,
    ):
        # The model is loaded first, so the abandoned call's wait is spent reading and writing.
        warm = await http.post(
            "/v1/completions", json={**COUNTING, "max_tokens": 1}, headers=acct.headers
        )
        assert warm.status_code == 200, warm.text
        # A client that waits longer each time, until the call had begun writing when it
        # went (on a loaded machine, reading the prompt can take the first wait whole).
        made = None
        for attempt, wait in enumerate((2.0, 4.0, 8.0, 16.0, 32.0)):
            keyed = {**acct.headers, "Idempotency-Key": f"hang-up-{attempt}"}
            await abandon(base, keyed, COUNTING, after_s=wait)
            # The next call needs the only slot: it runs once the abandoned one has ended.
            nxt = await http.post(
                "/v1/completions", json={**COUNTING, "max_tokens": 4}, headers=acct.headers
            )
            assert nxt.status_code == 200, nxt.text
            assert len(hangups()) == attempt + 1, "each hang-up is logged once"
            made = hangups()[-1].output_tokens  # type: ignore[attr-defined]
            if made is not None:
                break
        paid_by_then = {
            c["ref"]: c["detail"]["output_tokens"] for c in charges(service, acct.org_id)
        }

        async def kept() -> bool:  # the answer is kept just after the charge
            nonlocal retry
            retry = await http.post("/v1/completions", json=COUNTING, headers=keyed)
            return retry.status_code != 409

        retry = None
        await until(kept, "the answer is kept", interval=0.02)
        assert retry is not None

    assert made is not None, "the call had produced nothing after its client's longest wait"
    assert 0 < made < 1024
    assert all(r.levelno == logging.INFO for r in hangups())
    assert retry.status_code == 200, retry.text
    assert retry.headers["Idempotent-Replayed"] == "true"
    answer = retry.json()
    assert answer["usage"]["completion_tokens"] == made
    assert answer["choices"][0]["finish_reason"] == "length"
    # When the last next call (which needed the only slot) was answered, the abandoned
    # one had been settled to what it made; one abandoned before it wrote anything (if
    # any) was released whole; the retry paid nothing.
    assert paid_by_then[warm.json()["id"]] == 1
    assert paid_by_then[answer["id"]] == made
    assert paid_by_then[nxt.json()["id"]] == nxt.json()["usage"]["completion_tokens"]
    assert len(paid_by_then) == 2 + len(hangups())
    assert len(charges(service, acct.org_id)) == len(paid_by_then)
