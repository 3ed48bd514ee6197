"""Real ``batchyard worker`` processes for fault tests: start, watch, SIGKILL or SIGTERM, reap.

Cancelling an asyncio task is not a crash: it runs every ``finally`` block
and every ``except CancelledError``, which a SIGKILL skips. What a crash
leaves behind (open transactions, held leases, calls the provider is still
answering) is only seen when the operating system kills a real process, so
the fault tests start the same ``python -m batchyard worker`` an operator
runs, on a database they share with the test, with a config file whose route
points at a fake upstream the test controls, and kill it with a signal.

``Workers`` (the ``workers`` fixture in tests/faults/conftest.py) owns every
process it starts: each is reaped at the end of the test whether it passed or
not, each dies with the test process if that is killed (``PR_SET_PDEATHSIG``),
and the output of each (stdout and stderr, unbuffered, so a SIGKILL loses none
of it) is attached to the report of a failed test.

Workers read the system clock, so a test gives them short leases in the
config (``runs: {lease_s: ...}``) and waits on conditions with ``until``, a
bounded poll that fails at once, with the worker's output, if a worker it did
not kill has died. The test's own side (``deployment``: the API in-process,
its own workers) runs on a ``ManualClock`` set to the real time, which the
test moves to either side of a dead worker's lease to see what another worker
would do at that instant, without waiting for it (deferred items' leases are
two minutes and not in the config).
"""

from __future__ import annotations

import base64
import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx
import yaml

from batchyard.core.clock import ManualClock, SystemClock
from batchyard.core.config import load_settings
from batchyard.service import Service
from tests.support.fake_upstream import FakeUpstream
from tests.support.server import asgi_client
from tests.support.services import ServiceFactory
from tests.support.waits import HANG_S, until

__all__ = [
    "Deployment",
    "WorkerProcess",
    "Workers",
    "deployment",
    "wait_healthy",
    "worker_config",
]

# Run in the child before batchyard: die with the parent (a test process
# killed by a CI timeout must not leave workers behind), then become
# ``python -m batchyard`` with the rest of the arguments.
_BOOT = """
import ctypes, os, runpy, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass  # not Linux: the test's teardown still reaps
if os.getppid() != parent:
    sys.exit("the test process is gone")
sys.argv = ["batchyard", *sys.argv[2:]]
runpy.run_module("batchyard", run_name="__main__", alter_sys=True)
"""

# Settings of the test's own environment that must not leak into a worker's.
_SCRUB = (
    "BATCHYARD_CONFIG",
    "BATCHYARD_DATABASE_URL",
    "BATCHYARD_LIMITER_URL",
    "BATCHYARD_PRICE_FEED",
    "BATCHYARD_BATCH_ENCRYPTION_KEY",
)

#: What ``batchyard worker`` prints once its workers are started.
RUNNING = "batchyard worker: running"


def wait_healthy(proc: subprocess.Popen[Any], base: str, *, output: Callable[[], str]) -> None:
    """Until a real ``batchyard serve`` at ``base`` answers ``/healthz``.

    A process of its own cannot share a test's ManualClock, so this polls in real
    time, bounded only against a hang (``HANG_S``); a process that exits first
    fails with ``output()``.
    """
    deadline = time.monotonic() + HANG_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(output())
        try:
            if httpx.get(f"{base}/healthz", timeout=HANG_S).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"hung: batchyard serve not healthy in {HANG_S:g} s"
        time.sleep(0.1)


def worker_config(
    path: Path,
    *,
    upstream: str,
    runs: dict[str, Any] | None = None,
    route: dict[str, Any] | None = None,
    **extra: Any,
) -> Path:
    """Write a config file whose one route serves kettei-core from ``upstream``.

    The route (id ``fake``) is offered at 92 % off kettei-core's direct price
    with hard price caps, so deferred batches qualify on it at once, and
    ``route`` overrides its fields (``concurrency``, ...). ``runs`` is the
    ``runs:`` section (leases, polling). A fresh batch encryption key is
    written in, so the test and its workers can read the same sealed bodies
    on SQLite and on PostgreSQL alike.
    """
    data: dict[str, Any] = {
        "batch_encryption_key": base64.b64encode(os.urandom(32)).decode(),
        "routes": [
            {
                "id": "fake",
                "model": "kettei-core",
                "engine": "openai_http",
                "base_url": upstream,
                "upstream_model": "fake-model",
                "input_per_mtok": "0.008",
                "output_per_mtok": "0.03",
                "hard_price_caps": True,
                "timeout_s": 60,
                **(route or {}),
            }
        ],
        **extra,
    }
    if runs is not None:
        data["runs"] = runs
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@dataclass
class Deployment:
    """The test's side of a deployment whose background work runs in worker processes."""

    config: Path  # the config file the worker processes read
    service: Service  # the test's own parts, over the same database
    clock: ManualClock  # the test's clock; starts at the real time the workers read
    http: httpx.AsyncClient  # the API, served in-process


@asynccontextmanager
async def deployment(
    make_service: ServiceFactory,
    tmp_path: Path,
    database_url: str,
    *,
    upstream: FakeUpstream,
    **config: Any,
) -> AsyncIterator[Deployment]:
    """Write the workers' config (``worker_config(**config)``) and serve the API over it.

    The test's service reads the same file as its workers, through the test's
    ``make_service`` (so its ledger is audited at the end). Its clock is a
    ``ManualClock`` set to the real time, so what the API writes agrees with
    what the workers read; the test moves it only to ask "what would another
    worker do at this instant?".
    """
    path = worker_config(tmp_path / "config.yaml", upstream=upstream.base_url, **config)
    loaded = load_settings(config_file=path, database_url=database_url)
    clock = ManualClock(SystemClock().now())
    svc = make_service(clock=clock, **{f.name: getattr(loaded, f.name) for f in fields(loaded)})
    async with asgi_client(svc, worker=False) as http:
        yield Deployment(path, svc, clock, http)


@dataclass(eq=False)
class WorkerProcess:
    """One ``batchyard worker`` process; its output goes to ``log``."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    #: The signal this test sent it, if any: a worker that exits without one has crashed.
    signalled: int | None = field(default=None, init=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def output(self) -> str:
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> int:
        """SIGKILL: no handler, no ``finally``, no flush; then reap. Returns the exit status."""
        return self.signal(signal.SIGKILL)

    def terminate(self) -> int:
        """SIGTERM, then wait for the worker to exit on its own; the exit status.

        A worker still alive after ``HANG_S`` seconds has hung: it is killed and the
        test fails.
        """
        return self.signal(signal.SIGTERM)

    def signal(self, sig: int) -> int:
        if self.alive:
            self.signalled = sig
            os.kill(self.pid, sig)
        try:
            return self.popen.wait(HANG_S)
        except subprocess.TimeoutExpired:
            self.reap()
            raise AssertionError(
                f"hung: {self.name} (pid {self.pid}) did not exit within {HANG_S:g} s of "
                f"signal {signal.Signals(sig).name}\n{self.output()}"
            ) from None

    def pause(self) -> None:
        """SIGSTOP: every thread stops where it is (a long GC, a frozen VM); ``resume`` goes on."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: a paused worker goes on as if no time had passed, leases and all."""
        os.kill(self.pid, signal.SIGCONT)

    def reap(self) -> None:
        """Kill if still running, and wait for it: never leave a zombie or an orphan."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(HANG_S)

    def describe(self) -> str:
        rc = self.returncode
        state = "running" if rc is None else f"exit status {rc}"
        return f"--- {self.name} (pid {self.pid}, {state}) ---\n{self.output()}"


class Workers:
    """Starts worker processes for one test and reaps them all at ``close``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[WorkerProcess] = []

    def start(
        self,
        *,
        config: Path,
        database_url: str,
        name: str | None = None,
        env: dict[str, str] | None = None,
        log_level: str = "info",
        command: str = "worker",
        args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
    ) -> WorkerProcess:
        """Start ``python -m batchyard worker --config CONFIG --database URL``.

        ``command`` runs another command the same way (``serve``, with ``args``
        such as ``--port``), so a test can signal a real server too; ``prefix``
        runs it through a wrapper that execs it (``unshare ...``).
        """
        name = name or f"worker-{len(self.started) + 1}"
        log = self.tmp_path / f"{name}.log"
        child_env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        child_env.update(
            PYTHONUNBUFFERED="1",
            BATCHYARD_HOME=str(self.tmp_path / f"{name}-home"),
            **(env or {}),
        )
        argv = [
            *prefix,
            sys.executable,
            "-c",
            _BOOT,
            str(os.getpid()),
            command,
            *args,
            "--config",
            str(config),
            "--database",
            database_url,
            "--log-level",
            log_level,
        ]
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=self.tmp_path,
                # Its own session: a Ctrl-C at the terminal reaches the test, which
                # then reaps its workers, and never races the test's own signals.
                start_new_session=True,
            )
        proc = WorkerProcess(name, popen, log)
        self.started.append(proc)
        return proc

    def check(self) -> None:
        """Fail now if a worker exited although the test sent it no signal."""
        for proc in self.started:
            if proc.signalled is None and not proc.alive:
                raise AssertionError(f"{proc.name} exited by itself\n{proc.describe()}")

    async def until(self, condition: Callable[[], bool | Awaitable[bool]], what: str) -> None:
        """Poll ``condition`` (sync or async) until true (``tests.support.waits.until``).

        Fails at once, with every worker's output, if a worker the test did not
        signal has died, and after ``HANG_S`` seconds as a hang; nothing is asserted
        about how long it took.
        """

        async def holds() -> bool:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            if not result:
                self.check()
            return bool(result)

        await until(holds, what, interval=0.02, detail=self.report)

    async def running(self, proc: WorkerProcess) -> None:
        """Wait until ``proc`` says its workers are started (its signal handlers are set)."""
        await self.until(lambda: RUNNING in proc.output(), f"{proc.name} runs")

    def report(self) -> str:
        return "\n".join(p.describe() for p in self.started)

    def close(self) -> None:
        """Reap every worker still running (SIGKILL); called at the end of every test."""
        for proc in self.started:
            proc.reap()
