"""How much of a tier's requests limit does the runner use, and how many 429s does it cause?

Starts a real batchyard server in a subprocess on loopback (SQLite in a temp
directory, an instant scripted engine behind the embedded route, so the
model is never the bottleneck) whose tier allows ``--rpm`` requests a minute,
and scores ``--texts`` texts three ways, each as its own organisation so
each starts with an idle limit:

- the runner (``batchyard.client.text_runner.run_texts``), at the account's pace;
- a naive ``asyncio.gather`` over every text with a semaphore, raw httpx,
  sleeping the ``Retry-After`` header on each 429 and trying again;
- the same naive loop through the SDK without a pacer, whose retries wait the
  exact ``retry_after`` of the error body (twice; then once more by hand);
- the official ``openai`` SDK with its default settings (two retries that honour
  ``retry-after-ms``), ``asyncio.gather`` over ``--burst`` chat completions at once;
- the same ``gather`` with raw httpx and no retries at all, to show what the
  server admits by itself (its burst, its concurrency and its short queue).

    python bench/pacing.py [--rpm 1200] [--texts 600] [--burst 200] [--concurrency N]

Every response is counted at the client's transport (an httpx event hook),
so the SDK's own retries of a 429 are counted too. The sustained rate is the
answered texts between the first and the last answer, per minute, as a share
of the limit; the wall time includes the runner's free estimate of a sample.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from batchyard.client.async_client import AsyncClient
from batchyard.client.fleet import plan_pace
from batchyard.client.inputs import TextItem
from batchyard.client.text_runner import run_texts
from batchyard.errors import BatchyardError

DECISIONS: list[dict[str, Any]] = [
    {
        "id": "sentiment",
        "question": "How does the writer feel about the product?",
        "outcomes": [{"id": "positive"}, {"id": "negative"}, {"id": "neutral"}],
    },
    {
        "id": "topic",
        "question": "What is the comment about?",
        "outcomes": [{"id": "battery"}, {"id": "screen"}, {"id": "price"}],
    },
]
ORGS = ("runner", "naive-httpx", "naive-sdk", "openai-sdk", "gather-httpx")
WORDS = [
    "battery",
    "screen",
    "price",
    "shipping",
    "support",
    "colour",
    "weight",
    "sound",
    "charger",
    "case",
]


# --- the server (child process) ---------------------------------------------------


def serve(home: Path, port: int, rpm: int) -> None:
    """The real app with an instant engine; one organisation per contender, at ``rpm``."""
    import uvicorn

    from batchyard.app import build_service, create_app
    from batchyard.core.accounts import Scope
    from batchyard.core.clock import SystemClock
    from batchyard.core.config import load_settings
    from batchyard.core.money import to_ticks
    from batchyard.core.tiers import Tier
    from batchyard.engines.scripted import ScriptedEngine
    from batchyard.store import accounts, ledger

    settings = load_settings(database_url=f"sqlite:///{home / 'batchyard.db'}")
    # TPM and the estimate budget far above what the texts use: only RPM binds.
    tier = Tier(1, rpm, 1_000_000_000, 10_000_000_000, Decimal("1e9"))
    settings = dataclasses.replace(settings, tiers=(settings.tiers[0], tier))
    clock = SystemClock()
    service = build_service(
        settings, clock=clock, engines={"embedded": ScriptedEngine(clock=clock)}
    )
    service.db.migrate()

    def setup(conn: Any) -> dict[str, str]:
        now = clock.now()
        out = {}
        for name in ORGS:
            org = accounts.ensure_org(conn, name, now)
            _, secret = accounts.create_key(conn, org.id, Scope.FULL, now)
            ledger.top_up(conn, org.id, to_ticks(Decimal(1000)), now)
            accounts.set_tier(conn, org.id, tier.level)
            out[name] = secret
        return out

    keys = service.db.transact_sync(setup)
    (home / "keys.json").write_text(json.dumps(keys))
    uvicorn.run(
        create_app(service), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(home: Path, rpm: int) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    port = _free_port()
    env = {**os.environ, "BATCHYARD_HOME": str(home)}
    env.pop("BATCHYARD_CONFIG", None)
    env.pop("BATCHYARD_DATABASE_URL", None)
    cmd = [sys.executable, __file__, "--serve", str(home), "--port", str(port), "--rpm", str(rpm)]
    proc = subprocess.Popen(cmd, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise SystemExit("the bench server did not start")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("the bench server did not start in 120 s")
        time.sleep(0.1)
    return proc, base, json.loads((home / "keys.json").read_text())


# --- measuring ----------------------------------------------------------------------


@dataclass
class Tally:
    """Decide responses as the client's transport saw them."""

    statuses: Counter[int] = field(default_factory=Counter)
    answered_at: list[float] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    path: str = "/v1/decide"
    sent: int = 0
    failed: int = 0

    async def hook(self, response: httpx.Response) -> None:
        if response.request.url.path != self.path:
            return
        self.statuses[response.status_code] += 1
        if response.status_code == 200:
            self.answered_at.append(time.monotonic())

    def counted_http(self, base: str) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        return httpx.AsyncClient(
            base_url=base, timeout=60, limits=limits, event_hooks={"response": [self.hook]}
        )

    @property
    def sustained_rpm(self) -> float:
        t = self.answered_at
        return (len(t) - 1) / (t[-1] - t[0]) * 60 if len(t) > 1 and t[-1] > t[0] else 0.0


def texts(n: int, prefix: str) -> list[TextItem]:
    return [
        TextItem(
            f"{prefix}-{i:05d}",
            f"Comment {i}: the {WORDS[i % len(WORDS)]} was fine but the "
            f"{WORDS[(i * 7) % len(WORDS)]} could be better.",
        )
        for i in range(n)
    ]


async def bench_runner(base: str, key: str, items: list[TextItem], out: Path) -> Tally:
    tally = Tally()
    async with tally.counted_http(base) as http, AsyncClient(base, key, http_client=http) as client:
        tally.started = time.monotonic()
        summary = await run_texts(client, items, DECISIONS, model="kettei-core", output=out)  # type: ignore[arg-type]
        tally.ended = time.monotonic()
    if summary.failed or summary.answered != len(items):
        raise SystemExit(f"the runner left {summary.failed} failures")
    return tally


async def bench_naive_httpx(base: str, key: str, items: list[TextItem], workers: int) -> Tally:
    tally = Tally()
    gate = asyncio.Semaphore(workers)
    headers = {"Authorization": f"Bearer {key}"}

    async with tally.counted_http(base) as http:

        async def one(item: TextItem) -> None:
            body = {"model": "kettei-core", "input": {"text": item.text}, "decisions": DECISIONS}
            async with gate:
                while True:
                    r = await http.post(
                        "/v1/decide", json=body, headers={**headers, "Idempotency-Key": item.id}
                    )
                    if r.status_code != 429:
                        r.raise_for_status()
                        return
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))

        tally.started = time.monotonic()
        await asyncio.gather(*(one(i) for i in items))
        tally.ended = time.monotonic()
    return tally


async def bench_naive_sdk(base: str, key: str, items: list[TextItem], workers: int) -> Tally:
    tally = Tally()
    gate = asyncio.Semaphore(workers)
    async with tally.counted_http(base) as http, AsyncClient(base, key, http_client=http) as client:

        async def one(item: TextItem) -> None:
            async with gate:
                while True:
                    try:
                        await client.decide(
                            model="kettei-core",
                            decisions=DECISIONS,  # type: ignore[arg-type]
                            text=item.text,
                            idempotency_key=item.id,
                        )
                        return
                    except BatchyardError as exc:
                        if exc.status != 429:
                            raise
                        await asyncio.sleep(exc.retry_after or 1.0)

        tally.started = time.monotonic()
        await asyncio.gather(*(one(i) for i in items))
        tally.ended = time.monotonic()
    return tally


CHAT = {
    "model": "kettei-core",
    "messages": [{"role": "user", "content": "Say hi"}],
    "max_tokens": 4,
}


async def bench_openai_sdk(base: str, key: str, n: int) -> Tally:
    """The official SDK, default settings (only a counting hook on its HTTP client)."""
    import openai

    tally = Tally(path="/v1/chat/completions", sent=n)
    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [tally.hook]})
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, http_client=http) as sdk:

        async def one() -> None:
            try:
                await sdk.chat.completions.create(**CHAT)  # type: ignore[call-overload]
            except openai.APIError:
                tally.failed += 1

        tally.started = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        tally.ended = time.monotonic()
    return tally


async def bench_gather_httpx(base: str, key: str, n: int) -> Tally:
    """Every request at once, no retries: what the server admits by itself."""
    tally = Tally(path="/v1/chat/completions", sent=n)
    async with tally.counted_http(base) as http:

        async def one() -> None:
            r = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}
            )
            if r.status_code != 200:
                tally.failed += 1

        tally.started = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        tally.ended = time.monotonic()
    return tally


async def measure(
    base: str, keys: dict[str, str], n: int, workers: int | None, tmp: Path, burst: int
) -> Any:
    async with AsyncClient(base, keys["runner"]) as client:
        pace = await plan_pace(client)
    workers = workers or pace.concurrency
    runner = await bench_runner(base, keys["runner"], texts(n, "r"), tmp / "answers.jsonl")
    naive = await bench_naive_httpx(base, keys["naive-httpx"], texts(n, "h"), workers)
    sdk = await bench_naive_sdk(base, keys["naive-sdk"], texts(n, "s"), workers)
    for tally in (runner, naive, sdk):
        tally.sent = n
    official = await bench_openai_sdk(base, keys["openai-sdk"], burst)
    at_once = await bench_gather_httpx(base, keys["gather-httpx"], burst)
    return (
        pace,
        workers,
        {
            "runner (run_texts)": runner,
            "gather + httpx": naive,
            "gather + SDK": sdk,
            f"openai SDK defaults, gather {burst}": official,
            f"gather {burst}, httpx, no retry": at_once,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rpm", type=int, default=1200, help="the tier's requests a minute")
    parser.add_argument("--texts", type=int, default=600)
    parser.add_argument(
        "--burst", type=int, default=200, help="requests the gather contenders send at once"
    )
    parser.add_argument(
        "--concurrency", type=int, help="naive loops' semaphore (default: the runner's workers)"
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.rpm)
        return
    console = Console()
    with tempfile.TemporaryDirectory(prefix="batchyard-bench-") as tmp:
        proc, base, keys = start_server(Path(tmp), args.rpm)
        try:
            pace, workers, results = asyncio.run(
                measure(base, keys, args.texts, args.concurrency, Path(tmp), args.burst)
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    table = Table(
        title=f"{args.texts} texts against a tier of {args.rpm} requests a minute "
        f"(runner: {pace.concurrency} workers; naive: semaphore of {workers})"
    )
    cols = ("contender", "sent", "answered", "failed", "sustained rpm", "share of limit", "429s")
    for col in (*cols, "wall time"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    for name, t in results.items():
        table.add_row(
            name,
            f"{t.sent:,}",
            f"{t.statuses[200]:,}",
            f"{t.failed:,}",
            f"{t.sustained_rpm:,.0f}",
            f"{t.sustained_rpm / args.rpm:.3f}",
            f"{t.statuses[429]:,}",
            f"{t.ended - t.started:.1f} s",
        )
    console.print(table)
    console.print(
        "sustained: answers between the first and the last, per minute; "
        "429s counted at the client's transport, retries included"
    )


if __name__ == "__main__":
    main()
