"""Nothing a caller sends in confidence reaches a log: not the API key, not the text.

Requests of every outcome go through the real app over loopback to a real
upstream (which needs its own key), with every logger at DEBUG. Each record is
checked raw (message, arguments, every attribute) and as the JSON line the
server would write.
"""

from __future__ import annotations

import logging

import pytest

from batchyard.core.accounts import hash_key
from batchyard.core.catalog import catalog_from_config
from batchyard.logs import JsonFormatter
from batchyard.store import accounts
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.server import asgi_client

TEXT = "Zanzibar-quokka-7781 has a private diagnosis"
UPSTREAM_KEY = "sk-upstream-Secret-4242-do-not-log"
CHAT = "/v1/chat/completions"


@pytest.fixture
def upstream():
    with FakeUpstream(mode="echo", api_key=UPSTREAM_KEY) as up:
        yield up


@pytest.fixture
def svc(make_service, upstream, monkeypatch):
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    catalog = catalog_from_config(
        {
            "models": [
                {"id": "m", "input_per_mtok": "1", "output_per_mtok": "1", "context_window": 4096}
            ],
            "routes": [
                {
                    "id": "remote",
                    "model": "m",
                    "base_url": upstream.base_url,
                    "api_key_env": "TEST_UPSTREAM_KEY",
                    "timeout_s": 5,
                }
            ],
        }
    )
    return make_service(catalog=catalog)


def _everything_in(record: logging.LogRecord) -> str:
    parts = [record.getMessage(), repr(record.args), repr(vars(record))]
    parts.append(JsonFormatter().format(record))
    return "\n".join(parts)


async def test_no_key_and_no_text_in_any_log(svc, upstream, clock, caplog):
    caplog.set_level(logging.DEBUG)
    for name in ("batchyard", "httpx", "httpcore", "uvicorn", "fastapi"):
        caplog.set_level(logging.DEBUG, logger=name)
    # SQL statements as `echo=True` logs them (INFO); their parameters stay hidden.
    # (SQLAlchemy's DEBUG prints result rows: a database debugger, not a log.)
    caplog.set_level(logging.INFO, logger="sqlalchemy")
    acct = make_account(svc, credit="1")
    poor = make_account(svc, "poor", credit="0")
    body = {"model": "m", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 32}
    async with asgi_client(svc) as http:
        h = {**acct.headers, "Idempotency-Key": "log-1"}
        ok = await http.post(CHAT, json=body, headers=h)
        assert ok.status_code == 200, ok.text
        assert TEXT in ok.json()["choices"][0]["message"]["content"]
        clock.advance(60)
        assert (await http.post(CHAT, json=body, headers=h)).status_code == 200  # replay
        conflict = await http.post(CHAT, json={**body, "max_tokens": 5}, headers=h)
        assert conflict.status_code == 409
        clock.advance(60)
        upstream.fail_next(1, status=500)
        assert (await http.post(CHAT, json=body, headers=acct.headers)).status_code == 502
        clock.advance(60)
        upstream.malformed_next(1)
        assert (await http.post(CHAT, json=body, headers=acct.headers)).status_code == 502
        clock.advance(60)
        assert (await http.post(CHAT, json=body, headers=poor.headers)).status_code == 402
        wrong = {"Authorization": f"Bearer {acct.key}x"}
        assert (await http.post(CHAT, json=body, headers=wrong)).status_code == 401
        broken = (f'{{"model": "m", "messages": [{{"content": "{TEXT}"').encode()
        as_json = {**acct.headers, "Content-Type": "application/json"}
        assert (await http.post(CHAT, content=broken, headers=as_json)).status_code == 400
        bad = {**body, "messages": [{"role": "wizard", "content": TEXT}]}
        assert (await http.post(CHAT, json=bad, headers=acct.headers)).status_code == 400
        now = clock.now()
        svc.db.transact_sync(lambda c: accounts.revoke_key(c, acct.key_id, now))
        assert (await http.post(CHAT, json=body, headers=acct.headers)).status_code == 401
    assert upstream.statuses[200] >= 1
    assert len(caplog.records) > 0
    for record in caplog.records:
        seen = _everything_in(record)
        for secret in (acct.key, poor.key, hash_key(acct.key), UPSTREAM_KEY, TEXT, "Zanzibar"):
            assert secret not in seen, (record.name, record.getMessage())
