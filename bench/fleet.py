"""What does one more process buy, and what does each item cost the database?

For 1, 2 and 4 processes (``--processes``), on PostgreSQL, against an instant
upstream (a loopback ``FakeUpstream`` in its own process, never the
bottleneck), this bench starts N real ``batchyard serve --no-worker``
processes on N ports (the client round-robins over them) and N real
``batchyard worker`` processes, all on one fresh database, and measures:

- **rows per second of batch inference runs** (docs/reference/runs.md, end to end over
  HTTP): a project, ``--runs`` datasets uploaded, a run on each, quoted,
  confirmed, every row answered by the workers, outputs written, settled;
- **completions per second** of ``POST /v1/chat/completions`` from
  ``--concurrency`` client connections;
- **the database's own cost per item**: statements, and milliseconds of
  database time (execution plus planning), from ``pg_stat_statements``, and
  the CPU time of the PostgreSQL server's processes, per row and per
  completion; the top statements by total time.

``pg_stat_statements`` must be preloaded, which the shared server is not, so
the bench starts a private PostgreSQL (``initdb`` into a temporary directory,
as the ``postgres`` user when run as root) on a free port, and drops it at the
end; each configuration gets a fresh database on it. ``--shared-pg URL``
measures on an existing server instead, with ``pg_stat_database``'s
transaction counts and no per-statement figures.

Limits are shared through the store (``limiter_url: sql``) by default, as a
deployment without Redis runs; ``--limiter redis://…`` or ``memory`` to compare.

    PYTHONPATH=src python bench/fleet.py [--quick] [--processes 1,2,4] [--rows N]

The JSON result goes to ``bench/results/fleet.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from batchyard.app import build_service  # noqa: E402
from batchyard.core.accounts import Scope  # noqa: E402
from batchyard.core.clock import SystemClock  # noqa: E402
from batchyard.core.config import load_settings  # noqa: E402

console = Console()
SHARED_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
_TEXT = (
    "my order arrived late and the box was damaged please refund the shipping cost "
    "I tried to reset my password but the email never came can you help"
)
WORDS = _TEXT.split()
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}
CHAT = {
    "model": "kettei-core",
    "messages": [{"role": "user", "content": "Say hi"}],
    "max_tokens": 4,
}
# Settings of the bench's own environment that must not leak into its processes.
_SCRUB = (
    "BATCHYARD_CONFIG",
    "BATCHYARD_DATABASE_URL",
    "BATCHYARD_LIMITER_URL",
    "BATCHYARD_PRICE_FEED",
    "BATCHYARD_BATCH_ENCRYPTION_KEY",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(check: Any, what: str, timeout: float = 120.0, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what}: the process exited ({proc.returncode})")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


# --- PostgreSQL and what it spends ------------------------------------------------------


def _bindir() -> Path:
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True)
        if (Path(out.stdout.strip()) / "initdb").exists():
            return Path(out.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        raise SystemExit("no initdb found: install PostgreSQL, or pass --shared-pg URL")
    return found[-1].parent


@contextmanager
def private_postgres(tmp: Path) -> Any:
    """A PostgreSQL of the bench's own, with pg_stat_statements preloaded; its admin URL."""
    bindir = _bindir()
    data = tmp / "pg"
    data.mkdir()
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as postgres
        shutil.chown(tmp, "postgres")
        shutil.chown(data, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run(
        [*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
         "-E", "UTF8", "--locale=C", "--no-sync"],
        stdout=subprocess.DEVNULL, check=True,
    )  # fmt: skip
    options = " ".join(
        f"-c {o}"
        for o in (
            f"port={port}",
            "listen_addresses=127.0.0.1",
            f"unix_socket_directories={data}",
            "shared_preload_libraries=pg_stat_statements",
            "pg_stat_statements.track=all",
            "pg_stat_statements.track_planning=on",
            "max_connections=400",
        )
    )
    ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(data / "log")]
    subprocess.run([*ctl, "-w", "-o", options, "start"], stdout=subprocess.DEVNULL, check=True)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        _admin(url, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        yield url, data
    finally:
        subprocess.run([*ctl, "-m", "fast", "-w", "stop"], stdout=subprocess.DEVNULL, check=False)


def _admin(url: str, *statements: str) -> list[Any]:
    import psycopg

    out: list[Any] = []
    with psycopg.connect(url, autocommit=True) as conn:
        for sql in statements:
            cur = conn.execute(sql)
            out.append(cur.fetchall() if cur.description else None)
    return out


def _cpu_ticks(pid: int) -> int:
    """utime + stime (+ those of reaped children) of one process, in clock ticks."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime


def _server_cpu_s(data: Path) -> float:
    """CPU seconds of the whole server: the postmaster, its children and the reaped ones."""
    master = int((data / "postmaster.pid").read_text().split()[0])
    pids = [master]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) == master:
                    pids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return sum(_cpu_ticks(p) for p in pids) / os.sysconf("SC_CLK_TCK")


@dataclass
class DbCost:
    """What one phase cost the database."""

    statements: int | None = None
    nested: int | None = None
    db_ms: float | None = None
    transactions: int = 0
    server_cpu_s: float | None = None
    wal_bytes: int | None = None
    top: list[dict[str, Any]] = field(default_factory=list)


class Meter:
    """Resets and reads the database's counters around a phase."""

    def __init__(self, admin_url: str, db: str, data: Path | None) -> None:
        self.admin_url, self.db, self.data = admin_url, db, data
        self.statements = data is not None  # pg_stat_statements only on the private server
        self._xacts = 0
        self._cpu = 0.0
        self._wal = 0

    def _xact_count(self) -> int:
        (rows,) = _admin(
            self.admin_url,
            f"SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{self.db}'",
        )
        return int(rows[0][0])

    def _wal_bytes(self) -> int | None:
        """WAL written by the whole server: only the bench's on a private one."""
        if self.data is None:
            return None
        (rows,) = _admin(self.admin_url, "SELECT wal_bytes FROM pg_stat_wal")
        return int(rows[0][0])

    def reset(self) -> None:
        if self.statements:
            _admin(self.admin_url, "SELECT pg_stat_statements_reset()")
        # pg_stat_database is flushed by backends at most once a second.
        time.sleep(1.1)
        self._xacts = self._xact_count()
        self._cpu = _server_cpu_s(self.data) if self.data else 0.0
        self._wal = self._wal_bytes() or 0

    def read(self) -> DbCost:
        cpu = _server_cpu_s(self.data) - self._cpu if self.data else None
        time.sleep(1.1)
        cost = DbCost(transactions=self._xact_count() - self._xacts, server_cpu_s=cpu)
        wal = self._wal_bytes()
        cost.wal_bytes = None if wal is None else wal - self._wal
        if not self.statements:
            return cost
        mine = f"dbid = (SELECT oid FROM pg_database WHERE datname = '{self.db}')"
        (every,) = _admin(
            self.admin_url,
            "SELECT calls, total_exec_time + total_plan_time AS ms, rows, toplevel, query "
            f"FROM pg_stat_statements WHERE {mine} ORDER BY ms DESC",
        )
        # Nested statements are the ones PostgreSQL runs itself (foreign key checks).
        cost.statements = sum(int(c) for c, _, _, top, _ in every if top)
        cost.nested = sum(int(c) for c, _, _, top, _ in every if not top)
        cost.db_ms = sum(float(ms) for _, ms, _, top, _ in every if top)
        cost.top = [
            {
                "calls": int(c),
                "ms": round(float(ms), 3),
                "rows": int(n),
                "toplevel": bool(top),
                "query": " ".join(q.split()),
            }
            for c, ms, n, top, q in every
        ]
        return cost


# --- the upstream, in its own process ---------------------------------------------------


def serve_upstream() -> None:
    """Child: an instant FakeUpstream; prints its URL, lives until stdin closes."""
    from tests.support.fake_upstream import FakeUpstream

    with FakeUpstream(mode="instant") as up:
        print(up.base_url, flush=True)
        sys.stdin.read()


@contextmanager
def upstream() -> Any:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--upstream-child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the fleet --------------------------------------------------------------------------


def write_config(path: Path, upstream_url: str, limiter: str) -> Path:
    unlimited = {
        "level": 0,
        "requests_per_minute": 100_000_000,
        "tokens_per_minute": 100_000_000_000,
        "concurrency": 100_000,
    }
    data = {
        "batch_encryption_key": base64.b64encode(os.urandom(32)).decode(),
        "limiter_url": limiter,
        "tiers": [unlimited],
        "routes": [
            {
                "id": "fake",
                "model": "kettei-core",
                "engine": "openai_http",
                "base_url": upstream_url,
                "upstream_model": "fake-model",
                "timeout_s": 60,
            }
        ],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


class Fleet:
    """N API processes on N ports and N worker processes; all reaped at ``close``."""

    def __init__(self, tmp: Path, config: Path, url: str) -> None:
        self.tmp, self.config, self.url = tmp, config, url
        self.procs: list[subprocess.Popen[bytes]] = []
        self.bases: list[str] = []
        self.env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
        self.env.update(PYTHONUNBUFFERED="1", BATCHYARD_HOME=str(tmp / "home"), PYTHONPATH=path)

    def _start(self, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"{name}.log"
        argv = [sys.executable, "-m", "batchyard", *args, "--config", str(self.config)]
        argv += ["--database", self.url, "--log-level", "warning"]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, cwd=self.tmp, start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc, log

    def start(self, n: int) -> None:
        servers = []
        for i in range(n):
            port = free_port()
            proc, _ = self._start(f"api-{i}", "serve", "--no-worker", "--port", str(port))
            servers.append((proc, f"http://127.0.0.1:{port}"))
        workers = [self._start(f"worker-{i}", "worker") for i in range(n)]
        for proc, base in servers:
            wait_until(lambda b=base: _healthy(b), f"the API at {base}", proc=proc)
            self.bases.append(base)
        for proc, log in workers:
            wait_until(lambda lg=log: b"worker: running" in lg.read_bytes(), "a worker", proc=proc)

    def check(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise SystemExit(f"a fleet process exited ({proc.returncode}); logs in {self.tmp}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def make_account(config: Path, url: str) -> str:
    """Migrate the fresh database and give the bench an organisation with credit; its key."""
    from tests.support.accounts import make_account as account

    svc = build_service(load_settings(config_file=config, database_url=url), clock=SystemClock())
    try:
        svc.db.migrate()
        return account(svc, "fleet-bench", credit="10000000", scope=Scope.FULL).key
    finally:
        svc.db.close()


# --- the client -------------------------------------------------------------------------


class Clients:
    """One HTTP client per API process; ``next()`` round-robins over them."""

    def __init__(self, bases: list[str], key: str, connections: int) -> None:
        per = max(4, connections // len(bases) + 1)
        # Below uvicorn's 5 s keep-alive, so the client never sends on a connection
        # the server is closing (a ReadError between the phases).
        limits = httpx.Limits(
            max_connections=per, max_keepalive_connections=per, keepalive_expiry=2.0
        )
        headers = {"Authorization": f"Bearer {key}"}
        self.all = [
            httpx.AsyncClient(base_url=b, headers=headers, timeout=120, limits=limits)
            for b in bases
        ]
        self._turn = itertools.cycle(self.all)

    def next(self) -> httpx.AsyncClient:
        return next(self._turn)

    async def aclose(self) -> None:
        for c in self.all:
            await c.aclose()


def dataset(rows: int, offset: int) -> bytes:
    return b"".join(
        json.dumps(
            {"text": f"Ticket {offset + i}: " + " ".join(WORDS[(offset + i + j) % len(WORDS)]
                                                          for j in range(24))}
        ).encode()
        + b"\n"
        for i in range(rows)
    )  # fmt: skip


def _ok(r: httpx.Response, status: int = 200) -> Any:
    if r.status_code != status:
        raise SystemExit(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:300]}")
    return r.json()


async def run_phase(clients: Clients, rows: int, runs: int) -> dict[str, Any]:
    """Upload, create, quote, confirm, answer, write: rows of ``runs`` runs, end to end."""
    start = time.perf_counter()
    project = _ok(await clients.next().post("/v1/projects", json={"name": "fleet"}), 201)["id"]
    base = f"/v1/projects/{project}"
    sizes = [rows // runs + (i < rows % runs) for i in range(runs)]
    offsets = [sum(sizes[:i]) for i in range(runs)]

    async def upload(i: int) -> str:
        r = await clients.next().post(
            f"{base}/datasets",
            params={"name": f"tickets-{i}"},
            content=dataset(sizes[i], offsets[i]),
            headers={"Content-Type": "application/x-ndjson", "Idempotency-Key": f"ds-{i}"},
        )
        return str(_ok(r, 201)["id"])

    datasets = await asyncio.gather(*(upload(i) for i in range(runs)))
    uploaded = time.perf_counter()

    async def create(i: int, ds: str) -> str:
        r = await clients.next().post(
            f"{base}/batch-inference-runs",
            json={**RUN, "datasetId": ds},
            headers={"Idempotency-Key": f"run-{i}"},
        )
        return str(_ok(r, 201)["id"])

    ids = set(await asyncio.gather(*(create(i, ds) for i, ds in enumerate(datasets))))
    confirmed: set[str] = set()
    last_confirm = 0.0
    while True:
        listing = _ok(await clients.next().get(f"{base}/batch-inference-runs?limit=100"))
        runs_now = {r["id"]: r for r in listing["data"] if r["id"] in ids}
        bad = [r for r in runs_now.values() if r["status"] in ("failed", "canceled", "blocked")]
        if bad:
            raise SystemExit(f"a run ended badly: {bad[0]['status']}: {bad[0]['message']}")
        ready = [i for i, r in runs_now.items() if r["status"] == "awaiting_confirmation"]
        for rid in ready:
            r = await clients.next().post(f"{base}/batch-inference-runs/{rid}/confirm")
            _ok(r)
            confirmed.add(rid)
            last_confirm = time.perf_counter()
        if all(r["status"] == "completed" for r in runs_now.values()) and len(runs_now) == len(ids):
            break
        await asyncio.sleep(0.2)
    end = time.perf_counter()
    done = sum(r["results"]["rowsSucceeded"] for r in runs_now.values())
    if done != rows:
        raise SystemExit(f"{done} of {rows} rows succeeded")
    return {
        "rows": rows,
        "runs": runs,
        "seconds": end - start,
        "upload_s": uploaded - start,
        "quoted_and_confirmed_s": last_confirm - uploaded,
        "answered_s": end - last_confirm,
        "rows_per_s": rows / (end - start),
    }


async def chat_phase(clients: Clients, n: int, concurrency: int) -> dict[str, Any]:
    """``n`` chat completions from ``concurrency`` loops, round-robin over the API processes."""
    statuses: Counter[int] = Counter()
    left = iter(range(n))

    async def loop() -> None:
        for _ in left:
            r = await clients.next().post("/v1/chat/completions", json=CHAT)
            statuses[r.status_code] += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    if statuses[200] != n:
        raise SystemExit(f"chat completions: {dict(statuses)}")
    return {"completions": n, "seconds": seconds, "completions_per_s": n / seconds}


async def warm_up(clients: Clients) -> None:
    for c in clients.all:
        for _ in range(5):
            _ok(await c.post("/v1/chat/completions", json=CHAT))


# --- one configuration ------------------------------------------------------------------


def measure(
    n: int, args: argparse.Namespace, admin_url: str, data: Path | None, up: str, tmp: Path
) -> dict[str, Any]:
    db = f"bench_fleet_{os.getpid()}_{n}"
    _admin(admin_url, f'DROP DATABASE IF EXISTS "{db}"', f'CREATE DATABASE "{db}"')
    url = admin_url.rsplit("/", 1)[0] + f"/{db}"
    home = tmp / f"p{n}"
    home.mkdir()
    config = write_config(home / "config.yaml", up, args.limiter)
    fleet = Fleet(home, config, url)
    meter = Meter(admin_url, db, data)
    try:
        key = make_account(config, url)
        fleet.start(n)

        async def go() -> tuple[dict[str, Any], DbCost, dict[str, Any], DbCost]:
            clients = Clients(fleet.bases, key, args.concurrency)
            try:
                await warm_up(clients)
                await asyncio.to_thread(meter.reset)
                run = await run_phase(clients, args.rows, args.runs)
                run_cost = await asyncio.to_thread(meter.read)
                fleet.check()
                await asyncio.to_thread(meter.reset)
                chat = await chat_phase(clients, args.chats, args.concurrency)
                chat_cost = await asyncio.to_thread(meter.read)
                fleet.check()
                return run, run_cost, chat, chat_cost
            finally:
                await clients.aclose()

        run, run_cost, chat, chat_cost = asyncio.run(go())
    finally:
        fleet.close()
        _admin(admin_url, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    return {
        "processes": n,
        "run": run,
        "run_db": asdict(run_cost),
        "chat": chat,
        "chat_db": asdict(chat_cost),
    }


# --- reporting --------------------------------------------------------------------------


def _per(value: float | int | None, items: int, fmt: str) -> str:
    return "n/a" if value is None else format(value / items, fmt)


def report(results: list[dict[str, Any]], args: argparse.Namespace, private: bool) -> None:
    base = results[0]
    table = Table(
        title=f"fleet on PostgreSQL: {args.rows:,} rows in {args.runs} runs, {args.chats:,} "
        f"chat completions from {args.concurrency} connections; limiter {args.limiter}; "
        f"{os.cpu_count()} cores"
    )
    cols = (
        "processes", "rows/s", "ratio", "completions/s", "ratio", "statements/row",
        "DB ms/row", "PG CPU ms/row", "statements/completion", "DB ms/completion",
        "PG CPU ms/completion",
    )  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for r in results:
        rows, chats = r["run"]["rows"], r["chat"]["completions"]
        rd, cd = r["run_db"], r["chat_db"]
        statements = "statements" if private else "transactions"
        table.add_row(
            f"{r['processes']} API + {r['processes']} workers",
            f"{r['run']['rows_per_s']:,.0f}",
            f"{r['run']['rows_per_s'] / base['run']['rows_per_s']:.2f}",
            f"{r['chat']['completions_per_s']:,.0f}",
            f"{r['chat']['completions_per_s'] / base['chat']['completions_per_s']:.2f}",
            _per(rd[statements], rows, ".2f"),
            _per(rd["db_ms"], rows, ".3f"),
            _per(None if rd["server_cpu_s"] is None else rd["server_cpu_s"] * 1000, rows, ".3f"),
            _per(cd[statements], chats, ".2f"),
            _per(cd["db_ms"], chats, ".3f"),
            _per(None if cd["server_cpu_s"] is None else cd["server_cpu_s"] * 1000, chats, ".3f"),
        )
    console.print(table)
    if not private:
        console.print("the statements columns count transactions: no pg_stat_statements here")
        return
    for phase, unit in (("run", "rows"), ("chat", "completions")):
        cost = base[f"{phase}_db"]
        items = base[phase][unit]
        top = Table(title=f"top statements by time, {phase}, 1 process (per {unit[:-1]})")
        for col in ("calls", "ms", "share", "query"):
            top.add_column(col, justify="left" if col == "query" else "right")
        for s in [s for s in cost["top"] if s["toplevel"]][:8]:
            top.add_row(
                f"{s['calls'] / items:.2f}",
                f"{s['ms'] / items:.3f}",
                f"{s['ms'] / cost['db_ms']:.0%}" if cost["db_ms"] else "",
                s["query"][:110],
            )
        console.print(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run: fewer rows and chats")
    parser.add_argument("--processes", default="1,2,4", help="API + worker process counts")
    parser.add_argument("--rows", type=int, help="rows over all runs (default 16000; quick 2000)")
    parser.add_argument("--runs", type=int, default=8, help="runs the rows are split into")
    parser.add_argument("--chats", type=int, help="chat completions (default 3000; quick 600)")
    parser.add_argument("--concurrency", type=int, default=64, help="client connections for chat")
    parser.add_argument("--limiter", default="sql", help="limiter_url: sql, memory or redis://…")
    parser.add_argument("--shared-pg", metavar="URL", help="measure on this server instead")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "fleet.json")
    parser.add_argument("--upstream-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.upstream_child:
        serve_upstream()
        return
    args.rows = args.rows or (2000 if args.quick else 16000)
    args.chats = args.chats or (600 if args.quick else 3000)
    counts = [int(x) for x in args.processes.split(",")]
    results: list[dict[str, Any]] = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchyard-fleet-")))
        if args.shared_pg:
            admin_url, data = args.shared_pg, None
        else:
            admin_url, data = stack.enter_context(private_postgres(tmp))
        up = stack.enter_context(upstream())
        for n in counts:
            console.print(f"[dim]measuring {n} API + {n} worker processes…[/dim]")
            results.append(measure(n, args, admin_url, data, up, tmp))
    report(results, args, private=data is not None)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "rows": args.rows,
        "runs": args.runs,
        "chats": args.chats,
        "concurrency": args.concurrency,
        "limiter": args.limiter,
        "database": "private PostgreSQL with pg_stat_statements" if data else args.shared_pg,
    }
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    console.print(f"written to {args.json}")


if __name__ == "__main__":
    main()
