"""A fake batchyard gateway that speaks the decide wire over real HTTP, for client tests.

It keeps just enough of the real server's rules to test a client honestly:
a requests limit enforced per second (GCRA, burst of one second's share) that
answers 429 with Retry-After, idempotency replay and conflict, credit with
402 before any charge, the free estimate, the account and the models. Other
``/v1/...`` paths echo what they received, so the SDK's thin endpoints can be
checked for path, method, body and Idempotency-Key.

Knobs are plain attributes, safe to change between requests::

    with FakeGateway(rpm=600) as gw:
        gw.fail_next(2, 503, "service_unavailable", retry_after=0)
        gw.fail_texts["boom"] = (503, "service_unavailable", True)

A decide answer is deterministic: a text containing ``<decision>=<outcome>``
gets that outcome, any other text an outcome chosen by a hash of the text;
models in ``dumb_models`` always pick the first outcome.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.support.waits import HANG_S

__all__ = ["DECISIONS", "FakeGateway", "Recorded", "read_lines", "write_jsonl"]

#: A decision set the server accepts, for tests that need one.
DECISIONS: list[dict[str, Any]] = [
    {
        "id": "sentiment",
        "question": "How does the writer feel?",
        "outcomes": [
            {"id": "positive", "description": "pleased"},
            {"id": "negative", "description": "unhappy"},
            {"id": "neutral", "description": "neither"},
        ],
    },
    {
        "id": "spam",
        "question": "Is this spam?",
        "outcomes": [{"id": "yes"}, {"id": "no"}],
    },
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


IN_PRICE = Decimal("0.05") / 1_000_000
OUT_PRICE = Decimal("0.10") / 1_000_000


@dataclass
class Recorded:
    method: str
    path: str
    key: str | None
    body: Any
    status: int
    at: float
    headers: dict[str, str] = field(default_factory=dict)


def _tokens(body: dict[str, Any]) -> int:
    text = str(body.get("input", {}).get("text", ""))
    return len(text.split()) + 8 * len(body.get("decisions", [])) + 10


def _error(status: int, code: str, message: str, retryable: bool, retry_after: float | None = None):
    err: dict[str, Any] = {"code": code, "message": message, "retryable": retryable}
    headers = {}
    if retry_after is not None:
        err["retry_after"] = retry_after
        headers["Retry-After"] = str(int(retry_after))
    return JSONResponse({"error": err}, status_code=status, headers=headers)


class FakeGateway:
    def __init__(
        self,
        *,
        rpm: int = 6000,
        tpm: int = 10_000_000,
        api_key: str = "test-key",
        scope: str = "full",
        credit: Decimal | str = "10.00",
        latency: float = 0.0,
        models: tuple[str, ...] = ("kettei-core", "kettei-dumb", "kettei-ft"),
        context_window: int = 2000,
    ) -> None:
        self._initial = {
            "rpm": rpm,
            "tpm": tpm,
            "api_key": api_key,
            "scope": scope,
            "credit": Decimal(credit),
            "latency": latency,
            "models": models,
            "context_window": context_window,
        }
        self._lock = threading.Lock()
        # Requests the server is still answering (a cancelled client's included).
        self._in_flight = 0
        self._quiet = threading.Condition(self._lock)
        self.reset()
        self.app = self._build()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    # control -------------------------------------------------------------

    def reset(self) -> None:
        """Back to the state it started in, so one server can serve many tests.

        Waits first until the server has answered every request it received:
        a test that cancelled its client leaves requests running, and their
        records must not land in the next test's.
        """
        with self._quiet:
            if not self._quiet.wait_for(lambda: self._in_flight == 0, timeout=HANG_S):
                raise RuntimeError(
                    f"hung: the fake gateway has requests in flight after {HANG_S:g} s"
                )
        for name, value in self._initial.items():
            setattr(self, name, value)
        self.dumb_models = {"kettei-dumb"}
        # Models that calibrate: their raw probabilities favour the first outcome.
        self.calibrating: set[str] = set()
        self.warming: set[str] = set()
        self.fail_texts: dict[str, tuple[int, str, bool]] = {}
        self.requests: list[Recorded] = []
        self.charges: Counter[str] = Counter()
        self.rate_limited = 0
        self._faults: list[tuple[int, str, bool, float | None]] = []
        self._saved: dict[str, tuple[str, int, Any]] = {}
        self._tat = 0.0

    def fail_next(
        self,
        n: int,
        status: int,
        code: str,
        *,
        retryable: bool = True,
        retry_after: float | None = None,
    ) -> None:
        with self._lock:
            self._faults.extend([(status, code, retryable, retry_after)] * n)

    def decide_requests(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path == "/v1/decide"]

    def __enter__(self) -> FakeGateway:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + HANG_S
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake gateway did not start")
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(HANG_S)

    # rules ---------------------------------------------------------------

    def _limit(self) -> float | None:
        """GCRA with a one-second burst: None when allowed, else seconds to wait."""
        interval = 60.0 / self.rpm
        tolerance = max(0.0, 1.0 - interval)
        now = time.monotonic()
        with self._lock:
            tat = max(self._tat, now)
            if tat - now > tolerance + 1e-9:
                self.rate_limited += 1
                return tat - now - tolerance
            self._tat = tat + interval
            return None

    def _take_fault(self) -> tuple[int, str, bool, float | None] | None:
        with self._lock:
            return self._faults.pop(0) if self._faults else None

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        text = str(body["input"].get("text", ""))
        model = body["model"]
        answers = []
        for d in body["decisions"]:
            ids = [o["id"] for o in d["outcomes"]]
            marked = [o for o in ids if f"{d['id']}={o}" in text]
            if model in self.dumb_models:
                pick = ids[0]
            elif marked:
                pick = marked[0]
            else:
                pick = ids[int(hashlib.sha256(text.encode()).hexdigest(), 16) % len(ids)]
            probs = {o: (0.9 if o == pick else round(0.1 / (len(ids) - 1), 4)) for o in ids}
            answer: dict[str, Any] = {"decision": d["id"], "outcome": pick, "probabilities": probs}
            if model in self.calibrating:
                raw = {o: round(0.1 / len(ids), 4) for o in ids}
                raw[ids[0]] += 0.6
                raw[pick] += 0.3
                answer["raw_probabilities"] = raw
            answers.append(answer)
        usage = {"input_tokens": _tokens(body), "output_tokens": 3 * len(body["decisions"])}
        charge = usage["input_tokens"] * IN_PRICE + usage["output_tokens"] * OUT_PRICE
        fallback = None
        if model in self.warming:
            fallback = {"reason": "model_warming", "model": "kettei-core"}
        return {
            "id": f"dec.{uuid.uuid4()}",
            "model": model,
            "answers": answers,
            "usage": usage,
            "charge": f"{charge:.7f}",
            "fallback": fallback,
        }

    def _validate(self, body: dict[str, Any]) -> JSONResponse | None:
        if body.get("model") not in self.models:
            return _error(404, "unknown_model", "no such model", False)
        decisions = body.get("decisions") or []
        if not decisions:
            return _error(400, "no_decisions", "give at least one decision", False)
        if any(len(d.get("outcomes", [])) < 2 for d in decisions):
            return _error(400, "too_few_outcomes", "two outcomes at least", False)
        text = body.get("input", {}).get("text")
        if text is not None and not str(text).strip():
            return _error(400, "empty_text", "the text is empty", False)
        if _tokens(body) > self.context_window:
            return _error(400, "context_window_exceeded", "too long", False)
        return None

    def _max_cost(self, body: dict[str, Any]) -> Decimal:
        return _tokens(body) * IN_PRICE + int(body.get("max_output_tokens", 64)) * OUT_PRICE

    # app -----------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI()
        gw = self

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Response:
            with gw._lock:
                gw._in_flight += 1
            try:
                return await recorded(request, call_next)
            finally:
                with gw._quiet:
                    gw._in_flight -= 1
                    gw._quiet.notify_all()

        async def recorded(request: Request, call_next: Any) -> Response:
            raw = await request.body()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            if request.headers.get("authorization") != f"Bearer {gw.api_key}":
                response: Response = _error(401, "invalid_api_key", "bad key", False)
            else:
                response = await call_next(request)
            with gw._lock:
                gw.requests.append(
                    Recorded(
                        request.method,
                        request.url.path,
                        request.headers.get("idempotency-key"),
                        body,
                        response.status_code,
                        time.monotonic(),
                        dict(request.headers),
                    )
                )
            return response

        @app.post("/v1/decide")
        async def decide(request: Request) -> Response:
            body = await request.json()
            key = request.headers.get("idempotency-key")
            if not key or len(key) > 128:
                return _error(400, "invalid_idempotency_key", "need a key", False)
            wait = gw._limit()
            if wait is not None:
                return _error(429, "rate_limited", "slow down", True, max(1, math.ceil(wait)))
            fault = gw._take_fault()
            if fault is not None:
                status, code, retryable, retry_after = fault
                return _error(status, code, "injected", retryable, retry_after)
            fingerprint = json.dumps(body, sort_keys=True)
            saved = gw._saved.get(key)
            if saved is not None:
                if saved[0] != fingerprint:
                    return _error(409, "idempotency_conflict", "key reused", False)
                return JSONResponse(saved[2], status_code=saved[1])
            text = str(body.get("input", {}).get("text", ""))
            for marker, (status, code, retryable) in list(gw.fail_texts.items()):
                if marker in text:
                    return _error(status, code, "text fault", retryable, 0 if retryable else None)
            invalid = gw._validate(body)
            if invalid is not None:
                gw._saved[key] = (fingerprint, invalid.status_code, json.loads(invalid.body))
                return invalid
            if gw.credit < gw._max_cost(body):
                return _error(402, "insufficient_credit", "buy credit", False)
            if gw.latency:
                await asyncio.sleep(gw.latency)
            answer = gw._answer(body)
            with gw._lock:
                gw.credit -= Decimal(answer["charge"])
                gw.charges[key] += 1
            gw._saved[key] = (fingerprint, 200, answer)
            return JSONResponse(answer)

        @app.post("/v1/decide/estimate")
        async def estimate(request: Request) -> Response:
            body = await request.json()
            invalid = gw._validate(body)
            if invalid is not None:
                return invalid
            return JSONResponse(
                {
                    "input_tokens": _tokens(body),
                    "max_output_tokens": body.get("max_output_tokens", 64),
                    "max_cost": str(gw._max_cost(body).normalize()),
                }
            )

        @app.get("/v1/account")
        async def account() -> Response:
            if gw.scope == "inference":
                return _error(403, "insufficient_scope", "inference keys cannot", False)
            credit = str(gw.credit.quantize(Decimal("0.0000001")))
            return JSONResponse(
                {
                    "organization": {"id": "org.fake", "name": "Fake"},
                    "tier": 0,
                    "credit": {"balance": credit, "held": "0.00", "available": credit},
                    "effective_limits": {
                        "requests_per_minute": gw.rpm,
                        "tokens_per_minute": gw.tpm,
                        "estimate_tokens_per_minute": 100000,
                    },
                    "zero_data_retention": False,
                }
            )

        def model_json(mid: str) -> dict[str, Any]:
            return {
                "id": mid,
                "type": "base",
                "base_model": None,
                "modality": ["text"],
                "context_window": gw.context_window,
                "pricing": {"input_per_mtok": "0.05", "output_per_mtok": "0.10"},
                "available": True,
                "warm": mid not in gw.warming,
            }

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [model_json(m) for m in gw.models]})

        @app.get("/v1/models/{mid}")
        async def model(mid: str) -> Response:
            if mid not in gw.models:
                return _error(404, "not_found", "no such model", False)
            return JSONResponse(model_json(mid))

        @app.get("/v1/batches/{bid}/results")
        async def results(bid: str) -> Response:
            lines = [{"custom_id": f"{bid}-{i}", "status": "succeeded"} for i in range(2)]
            text = "".join(json.dumps(x) + "\n" for x in lines)
            return Response(text, media_type="application/x-ndjson")

        @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
        async def echo(rest: str, request: Request) -> Response:
            raw = await request.body()
            ctype = request.headers.get("content-type", "")
            body: Any = json.loads(raw) if raw and ctype.startswith("application/json") else None
            return JSONResponse(
                {
                    "method": request.method,
                    "path": request.url.path,
                    "query": dict(request.query_params),
                    "body": body,
                    "content_type": ctype.split(";")[0],
                    "idempotency_key": request.headers.get("idempotency-key"),
                }
            )

        return app
