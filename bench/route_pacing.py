"""How much of an upstream's request limit does the gateway use, flooded by a naive client?

A strict OpenAI-compatible upstream (``tests/support/fake_upstream``, in a
process of its own) enforces ``--rpm`` requests a minute *per second*
(3,000 a minute is 50 in any rolling second, ``--window fixed`` for calendar
seconds), answering 429 with ``Retry-After``, ``retry-after-ms`` and
``x-ratelimit-*`` as OpenAI does. ``batchyard serve`` runs as a real
subprocess with two routes to two such upstreams: one declares ``rpm``, one
declares nothing and must learn the limit from the upstream's headers. The
bench account's tier is far above the flood, so only the route limit binds.

Three contenders, each against an upstream of its own (idle windows, own counts):

- baseline: a perfectly paced direct client (straight to the upstream, each
  send waits until the one rpm/60 sends back is a second old, 429s retried
  after ``retry-after-ms``): what this machine lets anyone get right now;
- declared: ``--requests`` chat completions at once (``asyncio.gather``, one
  connection each) through the gateway to the route with ``rpm``;
- learned: the same flood to the route without a limit.

    python bench/route_pacing.py [--rpm 3000] [--requests 1500] [--window rolling]
    python bench/route_pacing.py --quick
    python bench/route_pacing.py --load 2     # two busy processes share the cores

The used share is the requests the upstream accepted between the first and
the last answer, per minute, over the limit; the upstream counts its own 429s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from batchyard.core.accounts import Scope  # noqa: E402
from batchyard.core.clock import SystemClock  # noqa: E402
from batchyard.core.money import to_ticks  # noqa: E402
from batchyard.store import accounts, ledger  # noqa: E402
from batchyard.store.database import Database  # noqa: E402

console = Console()
#: The baseline's own second, a hair long: sends land a few ms apart from when
#: they were stamped, and an exact second would be refused now and then.
BASELINE_WINDOW_S = 1.01

# The upstream process: prints its port, then answers "stats" on stdin with its counts.
UPSTREAM = """
import json, sys
from tests.support.fake_upstream import FakeUpstream
up = FakeUpstream(mode="instant", rpm=int(sys.argv[1]), window=sys.argv[2]).start()
print(up.port, flush=True)
for line in sys.stdin:
    if line.strip() == "stats":
        print(json.dumps({"ok": up.statuses[200], "refused": up.rate_limited}), flush=True)
up.stop()
"""


@dataclass
class Upstream:
    proc: subprocess.Popen[str]
    url: str

    @classmethod
    def start(cls, rpm: int, window: str, env: dict[str, str]) -> Upstream:
        proc = subprocess.Popen(
            [sys.executable, "-c", UPSTREAM, str(rpm), window],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        return cls(proc, f"http://127.0.0.1:{int(proc.stdout.readline())}/v1")

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        counts: dict[str, int] = json.loads(self.proc.stdout.readline())
        return counts

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class Outcome:
    name: str
    answers: list[float] = field(default_factory=list)
    failures: int = 0
    upstream_ok: int = 0
    upstream_429: int = 0

    def share(self, rpm: int) -> float:
        if len(self.answers) < 2:
            return 0.0
        span = max(self.answers) - min(self.answers)
        return (len(self.answers) - 1) / span * 60.0 / rpm if span > 0 else 0.0


def body(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Say ok."}], "max_tokens": 4}


async def baseline(url: str, n: int, rpm: int) -> Outcome:
    """A direct client that knows the rule: at most rpm/60 sends in any second, measured as sent.

    It sends as fast as the rule allows (each send waits until the one
    ``rpm/60`` sends back is ``BASELINE_WINDOW_S`` old) and retries a 429 after its
    ``retry-after-ms``: the most a client that knows everything gets here now.
    """
    out = Outcome("baseline: paced direct client")
    per_second = max(1, rpm // 60)
    sends: list[float] = []
    turn = asyncio.Lock()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            while True:
                async with turn:
                    if len(sends) >= per_second:
                        due = sends[-per_second] + BASELINE_WINDOW_S
                        await asyncio.sleep(max(0.0, due - time.monotonic()))
                    sends.append(time.monotonic())
                async with session.post(f"{url}/chat/completions", json=body("fake")) as r:
                    await r.read()
                    if r.status == 200:
                        out.answers.append(time.perf_counter())
                        return
                    if r.status != 429:
                        out.failures += 1
                        return
                    await asyncio.sleep(float(r.headers.get("retry-after-ms", "1000")) / 1000)

        await asyncio.gather(*(one() for _ in range(n)))
    return out


async def flood(base: str, key: str, model: str, n: int, name: str) -> Outcome:
    """A naive client: every request at once, one connection each, no retries."""
    out = Outcome(name)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:

        async def one() -> None:
            try:
                async with session.post(f"{base}/v1/chat/completions", json=body(model)) as r:
                    await r.read()
                    if r.status == 200:
                        out.answers.append(time.perf_counter())
                        return
                    out.failures += 1
                    if out.failures <= 3:
                        console.print(f"[red]{r.status}[/] {(await r.text())[:200]}")
            except aiohttp.ClientError as exc:
                out.failures += 1
                if out.failures <= 3:
                    console.print(f"[red]{type(exc).__name__}[/] {exc}")

        await asyncio.gather(*(one() for _ in range(n)))
    return out


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("batchyard serve exited before it was healthy")
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("batchyard serve did not become healthy")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def gateway_config(db_url: str, declared: str, learned: str, rpm: int) -> dict[str, Any]:
    big = 10**9
    model = {"input_per_mtok": "1", "output_per_mtok": "2", "context_window": 8192}
    return {
        "database_url": db_url,
        # The bench account's tier: far above the flood, so only the route's limit binds.
        "tiers": [
            {
                "level": 0,
                "requests_per_minute": big,
                "tokens_per_minute": big * 100,
                "estimate_tokens_per_minute": big * 100,
                "concurrency": 100_000,
            }
        ],
        "models": [{"id": "paced-declared", **model}, {"id": "paced-learned", **model}],
        "routes": [
            {
                "id": "declared",
                "model": "paced-declared",
                "engine": "openai_http",
                "base_url": declared,
                "upstream_model": "fake",
                "rpm": rpm,
            },
            {
                "id": "learned",
                "model": "paced-learned",
                "engine": "openai_http",
                "base_url": learned,
                "upstream_model": "fake",
            },
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rpm", type=int, default=3000, help="the upstream's limit a minute")
    ap.add_argument("--requests", type=int, default=1500, help="requests in each flood")
    ap.add_argument("--window", choices=["rolling", "fixed"], default="rolling")
    ap.add_argument("--quick", action="store_true", help="--rpm 1200 --requests 300")
    ap.add_argument(
        "--load", type=int, default=0, help="busy processes competing for the CPU meanwhile"
    )
    args = ap.parse_args()
    if args.quick:
        args.rpm, args.requests = 1200, 300
    rpm, n = args.rpm, args.requests

    tmp = Path(tempfile.mkdtemp(prefix="batchyard-bench-pacing-"))
    env = {
        **os.environ,
        "BATCHYARD_HOME": str(tmp),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
    }
    for name in ("BATCHYARD_DATABASE_URL", "BATCHYARD_CONFIG", "BATCHYARD_LIMITER_URL"):
        env.pop(name, None)

    ups = {k: Upstream.start(rpm, args.window, env) for k in ("baseline", "declared", "learned")}
    db_url = f"sqlite:///{tmp / 'bench.db'}"
    cfg = tmp / "bench.yaml"
    cfg.write_text(
        yaml.safe_dump(gateway_config(db_url, ups["declared"].url, ups["learned"].url, rpm))
    )
    db = Database(db_url, pool_size=1)
    db.migrate()
    now = SystemClock().now()

    def setup(conn: Any) -> str:
        org = accounts.ensure_org(conn, "bench", now)
        _, secret = accounts.create_key(conn, org.id, Scope.INFERENCE, now)
        ledger.top_up(conn, org.id, to_ticks(Decimal("1000000")), now)
        return secret

    key = db.transact_sync(setup)
    db.close()
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchyard",
            "serve",
            "--port",
            str(port),
            "--config",
            str(cfg),
            "--log-level",
            "warning",
            "--no-worker",
        ],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    outcomes: list[Outcome] = []
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)
    ]
    try:
        wait_healthy(base, server)
        runs = [
            ("baseline", lambda: baseline(ups["baseline"].url, n, rpm)),
            (
                "declared",
                lambda: flood(base, key, "paced-declared", n, f"gateway, route rpm: {rpm}"),
            ),
            ("learned", lambda: flood(base, key, "paced-learned", n, "gateway, no rpm (learned)")),
        ]
        for name, go in runs:
            with console.status(f"{name}: {n} requests"):
                out = asyncio.run(go())
                time.sleep(1.1)  # let the upstream's window empty before counting
                counts = ups[name].stats()
                out.upstream_ok, out.upstream_429 = counts["ok"], counts["refused"]
            outcomes.append(out)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        for up in ups.values():
            up.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    table = Table(
        title=f"{n} requests against an upstream allowing {rpm}/min "
        f"({rpm // 60} per {args.window} second)"
        + (f", {args.load} busy processes alongside" if args.load else "")
    )
    for col in ("contender", "used share", "÷ baseline", "upstream 429s", "client failures"):
        table.add_column(col, justify="right" if col != "contender" else "left")
    ref = outcomes[0].share(rpm) or 1.0
    for out in outcomes:
        sent = out.upstream_ok + out.upstream_429
        pct = out.upstream_429 / sent if sent else 0.0
        table.add_row(
            out.name,
            f"{out.share(rpm):.3f}",
            f"{out.share(rpm) / ref:.3f}",
            f"{out.upstream_429} ({pct:.2%})",
            str(out.failures),
        )
    console.print(table)
    console.print(
        "targets: declared ≥ 0.98 with 0 upstream 429s; learned ≥ 0.90 with ≤ 1% 429s; "
        "no client failures"
    )
    declared, learned = outcomes[1], outcomes[2]
    learned_sent = learned.upstream_ok + learned.upstream_429
    ok = (
        declared.share(rpm) >= 0.98
        and declared.upstream_429 == 0
        and learned.share(rpm) >= 0.9
        and learned.upstream_429 <= 0.01 * learned_sent
        and not declared.failures
        and not learned.failures
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
