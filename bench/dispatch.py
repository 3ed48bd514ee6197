"""Completions per second through the gateway, against a bare httpx loop in the same run.

An instant OpenAI-compatible upstream (``tests/support/fake_upstream``, instant
mode, in a process of its own) answers both loops. ``batchyard serve`` runs as
a real subprocess (uvicorn, SQLite with ``synchronous=FULL`` in a temp dir, one
route of engine ``openai_http`` to the upstream, an organisation with ample
credit under tiers whose limits do not bind). The same number of requests at
the same concurrency then go once straight to the upstream with httpx and once
through ``/v1/chat/completions``; the ratio of the two rates is the gateway's
cost. Every gateway completion must be durably charged: afterwards the ledger
must hold exactly N new settle entries, nothing held, and a clean audit.

    python bench/dispatch.py [--requests N] [--concurrency C] [--idempotency] [--profile]

``--profile`` runs the server under cProfile (every thread, merged) and
prints where its time went: each thread's CPU time by default, since a
thread's wall time also counts its waits for the GIL and for fsync
(``--profile-clock wall`` for that).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import httpx
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
BODY = {
    "model": "bench-model",
    "messages": [{"role": "user", "content": "Say ok."}],
    "max_tokens": 4,
}

UPSTREAM = """
import signal, sys, threading
from tests.support.fake_upstream import FakeUpstream
up = FakeUpstream(mode="instant").start()
print(up.port, flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
up.stop()
"""

PROFILED_SERVE = """
import cProfile, pstats, sys, threading, time
out, clock = sys.argv[1], sys.argv[2]
# cpu: each thread's own CPU time (what "server CPU" counts); wall: time waited too
# (the GIL, an fsync, the next request), which inflates every thread's figures.
timer = time.thread_time if clock == "cpu" else time.perf_counter
profiles = []
_run = threading.Thread.run
def run(self):
    p = cProfile.Profile(timer)
    profiles.append(p)
    p.enable()
    try:
        _run(self)
    finally:
        p.disable()
threading.Thread.run = run
main = cProfile.Profile(timer)
profiles.append(main)
main.enable()
try:
    from batchyard.cli.main import cli
    cli(sys.argv[3:], standalone_mode=False)
except KeyboardInterrupt:
    pass
finally:
    main.disable()
    stats = pstats.Stats(main)
    for p in profiles[1:]:
        try:
            stats.add(p)
        except TypeError:
            pass
    stats.dump_stats(out)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Result:
    seconds: float
    ok: int
    failed: int
    latencies: list[float]

    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else 0.0


async def drive(
    url: str, n: int, concurrency: int, headers: dict[str, str], keys: bool, tag: str
) -> Result:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    failed = 0
    counter = iter(range(n))
    async with httpx.AsyncClient(limits=limits, timeout=60, headers=headers) as client:

        async def worker() -> None:
            nonlocal failed
            for i in counter:
                h = {"Idempotency-Key": f"{tag}-{i}"} if keys else None
                t = time.perf_counter()
                r = await client.post(url, json=BODY, headers=h)
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    failed += 1
                    if failed <= 3:
                        console.print(f"[red]{r.status_code}[/] {r.text[:200]}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return Result(seconds, n - failed, failed, latencies)


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (Linux), 0 where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settles(db: Database) -> int:
    from sqlalchemy import func, select

    from batchyard.store.tables import ledger_entries

    return db.read_sync(
        lambda c: c.execute(
            select(func.count())
            .select_from(ledger_entries)
            .where(ledger_entries.c.kind == "settle")
        ).scalar_one()
    )


def print_profile(path: Path, top: int) -> None:
    import pstats

    stats = pstats.Stats(str(path))
    total = stats.total_tt  # type: ignore[attr-defined]
    raw = stats.stats  # type: ignore[attr-defined]
    for sort, title in (("tottime", "own time"), ("cumtime", "cumulative time")):
        rows = sorted(raw.items(), key=lambda kv: kv[1][2 if sort == "tottime" else 3])
        table = Table(title=f"server profile: top {top} by {title} (all threads, {total:.1f}s)")
        for col in ("function", "calls", "own s", "cum s"):
            table.add_column(col, justify="right" if col != "function" else "left")
        for (file, line, name), (_, calls, tt, ct, _) in reversed(rows[-top:]):
            short = file.replace(str(ROOT) + "/", "").split("site-packages/")[-1]
            table.add_row(f"{short}:{line} {name}", str(calls), f"{tt:.2f}", f"{ct:.2f}")
        console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--idempotency", action="store_true", help="send an Idempotency-Key each")
    ap.add_argument("--no-worker", action="store_true", help="serve with --no-worker")
    ap.add_argument("--profile", action="store_true", help="cProfile the server")
    ap.add_argument(
        "--profile-clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="what --profile counts: each thread's CPU time, or wall time (waits included)",
    )
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--profile-out", type=Path, help="keep the server's profile (pstats) here")
    args = ap.parse_args()
    n, c = args.requests, args.concurrency

    tmp = Path(tempfile.mkdtemp(prefix="batchyard-bench-"))
    env = {
        **os.environ,
        "BATCHYARD_HOME": str(tmp),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
    }
    for name in ("BATCHYARD_DATABASE_URL", "BATCHYARD_CONFIG", "BATCHYARD_LIMITER_URL"):
        env.pop(name, None)

    upstream = subprocess.Popen(
        [sys.executable, "-c", UPSTREAM], env=env, stdout=subprocess.PIPE, text=True
    )
    assert upstream.stdout is not None
    up_port = int(upstream.stdout.readline())
    up_url = f"http://127.0.0.1:{up_port}/v1"

    db_url = f"sqlite:///{tmp / 'bench.db'}"
    unlimited = 10**9
    config = {
        "database_url": db_url,
        "tiers": [
            {
                "level": 0,
                "requests_per_minute": unlimited,
                "tokens_per_minute": unlimited * 100,
                "estimate_tokens_per_minute": unlimited * 100,
            }
        ],
        "models": [
            {
                "id": "bench-model",
                "input_per_mtok": "1",
                "output_per_mtok": "2",
                "context_window": 8192,
            }
        ],
        "routes": [
            {
                "id": "instant",
                "model": "bench-model",
                "engine": "openai_http",
                "base_url": up_url,
                "upstream_model": "fake",
                "rpm": unlimited,
            }
        ],
    }
    cfg = tmp / "bench.yaml"
    cfg.write_text(yaml.safe_dump(config))

    db = Database(db_url, pool_size=1)
    db.migrate()
    now = SystemClock().now()

    def setup(conn):  # type: ignore[no-untyped-def]
        org = accounts.ensure_org(conn, "bench", now)
        _, secret = accounts.create_key(conn, org.id, Scope.INFERENCE, now)
        ledger.top_up(conn, org.id, to_ticks(Decimal("1000000")), now)
        return secret

    key = db.transact_sync(setup)

    port = free_port()
    serve_args = ["serve", "--port", str(port), "--config", str(cfg), "--log-level", "warning"]
    if args.no_worker:
        serve_args.append("--no-worker")
    prof = tmp / "server.prof"
    cmd = (
        [sys.executable, "-c", PROFILED_SERVE, str(prof), args.profile_clock, *serve_args]
        if args.profile
        else [sys.executable, "-m", "batchyard", *serve_args]
    )
    server = subprocess.Popen(cmd, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server)
        headers = {"Authorization": f"Bearer {key}"}
        # Warm both paths (connections, the tokenizer, SQLite's cache); not measured.
        warm = max(c, 50)
        asyncio.run(drive(f"{up_url}/chat/completions", warm, c, {}, False, "wb"))
        asyncio.run(drive(f"{base}/v1/chat/completions", warm, c, headers, args.idempotency, "wg"))
        before = settles(db)
        bare = asyncio.run(drive(f"{up_url}/chat/completions", n, c, {}, False, "b"))
        cpu0 = cpu_seconds(server.pid)
        gate = asyncio.run(
            drive(f"{base}/v1/chat/completions", n, c, headers, args.idempotency, "g")
        )
        server_cpu = cpu_seconds(server.pid) - cpu0
        after = settles(db)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        upstream.terminate()
        upstream.wait(timeout=10)

    problems = db.read_sync(ledger.audit)
    held = db.read_sync(lambda conn: ledger.balance(conn, _org_id(conn)).held)
    db.close()

    table = Table(title=f"{n} chat completions at concurrency {c}")
    for col in ("path", "completions/s", "p50 ms", "p99 ms", "failed"):
        table.add_column(col, justify="right" if col != "path" else "left")
    table.add_row(
        "bare httpx → upstream",
        f"{bare.rate():,.0f}",
        f"{bare.pct(0.5):.1f}",
        f"{bare.pct(0.99):.1f}",
        str(bare.failed),
    )
    table.add_row(
        "batchyard /v1/chat/completions" + (" (+Idempotency-Key)" if args.idempotency else ""),
        f"{gate.rate():,.0f}",
        f"{gate.pct(0.5):.1f}",
        f"{gate.pct(0.99):.1f}",
        str(gate.failed),
    )
    console.print(table)
    ratio = gate.rate() / bare.rate() if bare.rate() else 0.0
    colour = "green" if ratio >= 0.5 else "yellow"
    console.print(f"ratio gateway / bare: [bold {colour}]{ratio:.2f}[/] (target ≥ 0.50)")
    durable = after - before == gate.ok == n and held == 0 and not problems
    mark = "[green]✓[/]" if durable else "[red]✗[/]"
    console.print(
        f"{mark} ledger: {after - before} new settle entries for {gate.ok} completions, "
        f"{held} ticks held, audit {problems if problems else 'clean'}"
    )
    if server_cpu:
        console.print(
            f"server CPU: {server_cpu * 1000 / n:.2f} ms per completion "
            f"({server_cpu / gate.seconds:.0%} of one core while measured; "
            f"{os.cpu_count()} cores on this machine)"
        )
    if args.profile and prof.exists():
        print_profile(prof, args.top)
        if args.profile_out:
            shutil.copy(prof, args.profile_out)
    shutil.rmtree(tmp, ignore_errors=True)
    if not durable or gate.failed or bare.failed:
        sys.exit(1)


def _org_id(conn) -> str:  # type: ignore[no-untyped-def]
    org = accounts.get_org_by_name(conn, "bench")
    assert org is not None
    return org.id


if __name__ == "__main__":
    main()
