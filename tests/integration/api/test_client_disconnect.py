"""A client that hangs up mid-request is one info line, ``client_disconnected``, not an error.

A real socket on a real server: the request's headers and half its body are
sent, then the socket is closed. The server reads a body that never ends;
that is the client's choice, not a bug, so nothing is logged as an
``unhandled error`` and no traceback is written.
"""

from __future__ import annotations

import logging
import socket

import pytest

from batchyard.engines.scripted import ScriptedEngine
from tests.support.accounts import make_account
from tests.support.server import live_server
from tests.support.waits import until


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/projects"])
async def test_a_client_gone_mid_body_is_logged_once_as_info(service, caplog, path):
    service.engines.set("embedded", ScriptedEngine(lambda req: "hi", clock=service.clock))
    acct = make_account(service)
    caplog.set_level(logging.DEBUG)
    body = b'{"model": "kettei-core", "messages": [{"role": "user", "content": "hel'
    async with live_server(service) as base:
        port = int(base.rsplit(":", 1)[1])
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: {acct.headers['Authorization']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            # Headers and half the body arrive before the close, in that order on one
            # stream: the server starts the request, then its body read meets the end.
            sock.sendall(head + body)
        seen = ("client disconnected", "unhandled error")
        await until(
            lambda: any(r.msg in seen for r in caplog.records), "the server sees the client go"
        )

    assert not any(r.msg == "unhandled error" for r in caplog.records)
    gone = [r for r in caplog.records if r.msg == "client disconnected"]
    assert len(gone) == 1
    assert gone[0].levelno == logging.INFO
    assert gone[0].event == "client_disconnected"  # type: ignore[attr-defined]
    assert gone[0].exc_info is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [(r.name, r.getMessage()) for r in errors]
