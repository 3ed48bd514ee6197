"""Personal data submitted with privacy mode ``redact`` is nowhere at rest or in logs.

The database file and its WAL are read as raw bytes after a batch has run,
alongside every captured log record and the results download. Bodies are
also sealed, so even text that is not personal data (a codeword) must not be
readable in the file.
"""

from __future__ import annotations

import json
import logging
import re

from batchyard.app import run_worker
from batchyard.core.tokens import message_text
from batchyard.engines.scripted import ScriptedEngine
from batchyard.store import activity
from tests.support.accounts import make_account
from tests.support.deferred_batches import (
    all_items,
    feed_route,
    set_price,
    submit,
    worker,
)
from tests.support.runs import Api, fast_runs
from tests.support.server import asgi_client
from tests.support.workspace import signed_in, submit_form

EMAIL = "alice.smith@example.com"
PHONE = "+44 20 7946 0958"
CARD = "4111 1111 1111 1111"
IBAN = "GB82 WEST 1234 5698 7654 32"
IP = "203.0.113.42"
CODEWORD = "PURPLE-ELEPHANT-42"
TEXT = (
    f"Write to {EMAIL} or call {PHONE}. Card {CARD}, IBAN {IBAN}, last seen from {IP}. "
    f"Codeword {CODEWORD}."
)
PLANTED = [
    EMAIL,
    "alice.smith",
    "example.com",
    PHONE,
    "7946 0958",
    "79460958",
    CARD,
    CARD.replace(" ", ""),
    IBAN,
    IBAN.replace(" ", ""),
    IP,
]


def _echo(request) -> str:
    return " ".join(message_text(m["content"])[0] for m in request.messages)


def _body(mode: str) -> dict:
    return {
        "min_discount": 90,
        "requests": [
            {
                "custom_id": f"ticket-{i}",
                "body": {
                    "model": "kettei-core",
                    "messages": [
                        {"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": [{"type": "text", "text": TEXT}]}
                        if i
                        else {"role": "user", "content": TEXT},
                    ],
                    "max_tokens": 200,
                    "privacy": {"mode": mode},
                },
            }
            for i in range(2)
        ],
    }


def _raw_store_bytes(settings) -> bytes:
    db = settings.sqlite_path
    parts = [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    return b"".join(p.read_bytes() for p in parts if p.exists())


async def test_redacted_personal_data_is_not_in_the_database_logs_or_results(
    market, clock, caplog, settings
):
    caplog.set_level(logging.DEBUG)
    svc = market(feed_route("spot"))
    engine = ScriptedEngine(_echo, clock=clock)
    svc.engines.set("spot", engine)
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        r = await submit(http, acct.headers, _body("redact"))
        assert r.status_code == 201, r.text
        bid = r.json()["id"]
        # The store holds the waiting, sealed bodies now; look before they are dropped.
        waiting_bytes = _raw_store_bytes(settings)
        set_price(svc, "spot", "0.008", "0.03")
        report = await worker(svc).run_pass()
        assert report.succeeded == 2
        results = (await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)).content
    final_bytes = _raw_store_bytes(settings)

    sent = [_echo(c) for c in engine.calls]
    assert all("[EMAIL]" in s and "[CARD]" in s and "[IBAN]" in s for s in sent)
    assert all(CODEWORD in s for s in sent)  # not personal data: it reaches the model

    lines = [json.loads(x) for x in results.splitlines()]
    answers = [ln["result"]["body"]["choices"][0]["message"]["content"] for ln in lines]
    assert all("[PHONE]" in a and "[IP]" in a for a in answers)

    logs = caplog.text + "\n".join(repr(vars(rec)) for rec in caplog.records)
    for planted in PLANTED:
        needle = planted.encode()
        assert needle not in waiting_bytes, planted
        assert needle not in final_bytes, planted
        assert needle not in results, planted
        assert planted not in logs, planted
        for text in sent:
            assert planted not in text
    # Sealed at rest: even the harmless codeword is unreadable in the file.
    assert CODEWORD.encode() not in waiting_bytes
    assert CODEWORD.encode() not in final_bytes
    assert re.search(rb"Answer briefly", waiting_bytes) is None


async def test_reject_mode_refuses_the_whole_submission_and_stores_nothing(
    market, clock, caplog, settings
):
    caplog.set_level(logging.DEBUG)
    svc = market(feed_route("spot"))
    acct = make_account(svc)
    body = _body("reject")
    body["requests"].insert(
        0,
        {
            "custom_id": "clean",
            "body": {
                **body["requests"][0]["body"],
                "messages": [{"role": "user", "content": "Nothing personal here."}],
            },
        },
    )
    async with asgi_client(svc, worker=False) as http:
        r = await submit(http, acct.headers, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "privacy_rejected"
    assert "requests[1]" in err["message"] and "EMAIL" in err["message"]
    assert all_items(svc) == []
    raw = _raw_store_bytes(settings)
    for planted in PLANTED:
        assert planted.encode() not in raw
        assert planted not in r.text
        assert planted not in caplog.text


# --- every front door, privacy mode off: sealing alone keeps the text unreadable ---------


def _db_bytes(path) -> bytes:
    parts = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
    return b"".join(p.read_bytes() for p in parts if p.exists())


def _echo_all(request) -> str:
    """An engine that repeats the prompt: personal data in, personal data out."""
    return "You said: " + _echo(request)


async def test_no_front_door_leaves_personal_data_readable_at_rest(
    make_service, clock, caplog, tmp_path
):
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "fresh" / "store.db"  # created by the service itself
    svc = make_service(database_url=f"sqlite:///{path}", runs=fast_runs())
    engine = ScriptedEngine(_echo_all, clock=clock)
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="50", tier=3)
    h = acct.headers
    chat_body = {"model": "kettei-core", "messages": [{"role": "user", "content": TEXT}]}
    decide_body = {
        "model": "kettei-core",
        "input": {"text": TEXT},
        "decisions": [
            {"id": "urgent", "question": "Is it urgent?", "outcomes": [{"id": "yes"}, {"id": "no"}]}
        ],
    }
    async with asgi_client(svc, worker=False) as http:
        # OpenAI-compatible chat and decide, each with its answer saved under a key.
        r = await http.post(
            "/v1/chat/completions", json=chat_body, headers={**h, "Idempotency-Key": "chat"}
        )
        assert r.status_code == 200 and EMAIL in r.text  # the echo carries it back
        clock.advance(1)
        r = await http.post("/v1/decide", json=decide_body, headers={**h, "Idempotency-Key": "d"})
        assert r.status_code == 200, r.text
        clock.advance(1)
        assert (await http.post("/v1/decide/estimate", json=decide_body, headers=h)).is_success
        # A deferred batch, privacy off, through the API and through the workspace form.
        r = await submit(http, h, _body("off"))
        assert r.status_code == 201, r.text
        clock.advance(10)
        await signed_in(http, acct.key)
        form = await submit_form(http, json.dumps(_body("off")))
        assert form.status_code == 303, form.text
        await worker(svc).run_pass()
        # Datasets, a row edit, and a run that writes the model's answers back.
        api = await Api(http, h).start()
        ds = await api.upload([{"text": TEXT}, {"text": "nothing personal"}])
        patch = await http.patch(
            f"/v1/projects/{api.project}/datasets/{ds['id']}/rows/2",
            json={"data": {"note": f"call {PHONE}"}},
            headers=h,
        )
        assert patch.status_code == 200, patch.text
        run_body = {
            "datasetId": ds["id"],
            "model": {"type": "base", "id": "kettei-core"},
            "input": {"type": "field", "field": "text"},
            "output": {"type": "dataset", "name": "answers"},
            "sampling": {"maxOutputTokens": 64},
        }
        run_id = (await api.create(run_body)).json()["id"]
        await run_worker(svc).run_until_idle()
        assert (await api.post(run_id, "confirm")).status_code == 200
        await run_worker(svc).run_until_idle()
        done = await api.get(run_id)
        assert done["status"] == "completed", done
        rows = await api.rows(done["output"]["datasetId"])
        assert any(EMAIL in json.dumps(r) for r in rows)  # readable through the API
        acts = svc.db.read_sync(lambda c: activity.list_activity(c, acct.org_id))
    stored = _db_bytes(path)

    assert {a["kind"] for a in acts} >= {"charge"}
    assert sum(1 for c in engine.calls if EMAIL in _echo(c)) >= 5  # every door reached it
    logs = caplog.text + "\n".join(repr(vars(rec)) for rec in caplog.records)
    for planted in PLANTED:
        assert planted.encode() not in stored, planted
        assert planted not in logs, planted
    assert CODEWORD.encode() not in stored
    for part in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if part.exists():
            assert oct(part.stat().st_mode & 0o777) == "0o600", part
