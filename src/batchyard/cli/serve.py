"""``batchyard serve`` and ``batchyard worker``: the same code on SQLite or PostgreSQL.

Both stop gracefully on SIGTERM (or Ctrl-C): nothing more is claimed or sent,
calls in flight get ``--grace`` seconds (``shutdown_grace_s``, 30 by default)
to land, and only calls still in flight then are cut off and become
``uncertain``; claimed work never sent goes back to waiting. ``serve`` also
stops taking requests, lets those in progress finish within the same grace,
and answers ``/readyz`` 503 from the first signal. A second signal stops at
once, and a clean drain exits 0. A store that cannot be opened or written at
start is one line on stderr and exit status 1, not a traceback; a config
mistake or a batch key that does not open the store's sealed data is one line
and exit status 78.

``serve --workers N`` (N > 1) runs N API processes on one port under a
supervisor (uvicorn's), each building its own service from the settings the
parent hands down in the environment (``app.app_from_environment``). It needs
PostgreSQL: SQLite is one process's store. The API processes then run no
background work unless ``--with-worker`` asks: runs, deferred and file
batches belong to ``batchyard worker`` processes, started beside them, as
many as the work needs. ``/metrics`` sums every process through
prometheus-client's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``,
emptied at start, a fresh temporary one when unset). SIGTERM to the parent
reaches every child, and each drains as one ``serve`` does; a child that dies
is replaced.

``batchyard worker --metrics-port P`` serves that worker's own ``/metrics``
(and ``/healthz``): its model calls, charges, recovered leases and uncertain
items are counted in the worker, which serves no API.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from batchyard.cli.options import (
    OperatorError,
    config_errors,
    database_options,
    settings_from,
    store_problem,
)

if TYPE_CHECKING:
    from batchyard.core.config import Settings
    from batchyard.service import Service

__all__ = ["serve", "worker"]

WORKERS_HELP = (
    "API processes sharing the port (PostgreSQL only). With more than one, they run no "
    "background work unless --with-worker: start `batchyard worker` processes for it."
)

console = Console(stderr=True)

GRACE_HELP = (
    "Seconds calls in flight may take to land after SIGTERM before they are cut off "
    "(default: shutdown_grace_s, 30)."
)


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """A store that cannot be opened, migrated or written, or a config mistake: one line."""
    from batchyard.errors import StorageUnavailable

    try:
        with config_errors():
            yield
    except StorageUnavailable as exc:
        raise OperatorError(f"batchyard: {store_problem(exc)}") from None
    except OSError as exc:
        raise OperatorError(f"batchyard: the database cannot be opened: {exc}") from None


def _start(settings: Settings) -> Service:
    """Build, migrate and check the batch key: every refusal before any work starts."""
    from batchyard.app import build_service, verify_batch_key, verify_embedded_model

    with _store_errors():
        service = build_service(settings)
        verify_embedded_model(service)
        service.db.migrate()  # here, so a store that cannot be written is one line, not a trace
        verify_batch_key(service)
    return service


def _settings(config_file: str | None, database_url: str | None, grace: float | None) -> Settings:
    settings = settings_from(config_file, database_url)
    if grace is not None:
        settings = dataclasses.replace(settings, shutdown_grace_s=grace)
    return settings  # type: ignore[no-any-return]


def _report_batch_key(service: Service) -> None:
    """Say where a new batch key went, or why deferred batches are off."""
    key = service.batch_key
    if key.created:
        console.print(
            f"batchyard: created the batch encryption key {key.path} (mode 0600); "
            "back it up with the database: without it waiting batches cannot be read"
        )
    elif key.sealer is None:
        console.print(f"batchyard: {key.reason}")
        console.print(
            "batchyard: without a batch encryption key, dataset rows, run answers and saved "
            "idempotent answers are stored unsealed; set BATCHYARD_BATCH_ENCRYPTION_KEY"
        )


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--no-worker", is_flag=True, help="Serve the API only; run workers separately.")
@click.option(
    "--workers", type=click.IntRange(min=1), default=1, show_default=True, help=WORKERS_HELP
)
@click.option(
    "--with-worker",
    is_flag=True,
    help="With --workers N: each API process runs background work too.",
)
@click.option("--log-level", default="info", show_default=True)
@click.option("--grace", type=float, default=None, help=GRACE_HELP)
@database_options
def serve(
    host: str,
    port: int,
    no_worker: bool,
    workers: int,
    with_worker: bool,
    log_level: str,
    grace: float | None,
    config_file: str | None,
    database_url: str | None,
) -> None:
    """Start the API (and an in-process worker) on SQLite by default."""
    import uvicorn

    from batchyard.app import create_app
    from batchyard.logs import setup_logging

    setup_logging(log_level.upper())
    settings = _settings(config_file, database_url, grace)
    if workers > 1 and settings.is_sqlite:
        raise click.ClickException(
            f"--workers {workers} needs PostgreSQL (--database postgresql://...): "
            "a SQLite file is one process's store"
        )
    service = _start(settings)
    _report_batch_key(service)
    where = settings.sqlite_path or settings.database_url.split("@")[-1]
    console.print(f"batchyard: database {where}; listening on http://{host}:{port}")
    if workers > 1:
        service.db.close()  # each API process opens its own
        _serve_processes(settings, config_file, host, port, workers, with_worker, log_level)
        return
    app = create_app(service, worker=not no_worker)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        log_config=None,  # uvicorn's lines go through setup_logging's JSON handler
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # At the first signal the workers stop claiming and /readyz turns 503,
            # while uvicorn lets the requests in progress finish.
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_soon_threadsafe(service.begin_drain)
            super().handle_exit(sig, frame)

    with _exit_zero_after_drain():
        Server(config).run()


@contextlib.contextmanager
def _exit_zero_after_drain() -> Iterator[None]:
    """Let a clean SIGTERM (or Ctrl-C) drain end with exit status 0, as the worker's does.

    uvicorn re-raises the signal it caught once it has shut down, to the handler
    that was there before it; with the default one the process died of SIGTERM
    (status -15) after a drain that went well. The handler here takes that
    re-raised signal and does nothing, so ``serve`` returns normally.
    """
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda *_: None)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_processes(
    settings: Settings,
    config_file: str | None,
    host: str,
    port: int,
    workers: int,
    with_worker: bool,
    log_level: str,
) -> None:
    """N API processes on one port; the children read their settings from the environment."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from batchyard.app import BACKGROUND_ENV
    from batchyard.service.metrics import MULTIPROC_ENV, mark_dead, prepare_multiprocess

    if settings.limiter_url in (None, "memory", "memory://"):
        console.print(
            "batchyard: warning: the limiter is in-process, so each API process applies the "
            "tier limits on its own; set limiter_url (redis://... or sql) to share them"
        )
    own_dir = not os.environ.get(MULTIPROC_ENV)
    metrics_dir = Path(os.environ.get(MULTIPROC_ENV) or tempfile.mkdtemp(prefix="batchyard-"))
    prepare_multiprocess(metrics_dir)
    os.environ["BATCHYARD_DATABASE_URL"] = settings.database_url
    os.environ["BATCHYARD_SHUTDOWN_GRACE_S"] = str(settings.shutdown_grace_s)
    os.environ["BATCHYARD_LOG_LEVEL"] = log_level
    os.environ[BACKGROUND_ENV] = "1" if with_worker else "0"
    if config_file:
        os.environ["BATCHYARD_CONFIG"] = str(Path(config_file).resolve())

    class Supervisor(Multiprocess):
        """uvicorn's supervisor, telling prometheus-client which children died."""

        def keep_subprocess_alive(self) -> None:
            before = {p.pid for p in self.processes}
            super().keep_subprocess_alive()
            for pid in before - {p.pid for p in self.processes}:
                if pid is not None:
                    mark_dead(pid)

        def join_all(self) -> None:
            super().join_all()
            for p in self.processes:
                if p.pid is not None:
                    mark_dead(p.pid)

    config = uvicorn.Config(
        "batchyard.app:app_from_environment",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        access_log=False,
        log_config=None,  # uvicorn's lines go through setup_logging's JSON handler
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
    )
    background = "each runs background work" if with_worker else "no background work"
    console.print(f"batchyard: {workers} API processes ({background}); SIGTERM stops them all")
    try:
        Supervisor(config, sockets=[config.bind_socket()]).run()
    finally:
        if own_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


@click.command()
@click.option("--log-level", default="info", show_default=True)
@click.option("--grace", type=float, default=None, help=GRACE_HELP)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="Serve /metrics and /healthz for Prometheus on this port (off by default).",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@database_options
def worker(
    log_level: str,
    grace: float | None,
    metrics_port: int | None,
    metrics_host: str,
    config_file: str | None,
    database_url: str | None,
) -> None:
    """Run background work (runs, deferred batches, file batches) without serving the API."""
    from batchyard.logs import setup_logging

    setup_logging(log_level.upper())
    settings = _settings(config_file, database_url, grace)
    service = _start(settings)

    async def main() -> None:
        _report_batch_key(service)
        await service.start(worker=True)
        scrape = _metrics_server(service, metrics_host, metrics_port, log_level)
        signals = 0
        stop = asyncio.Event()
        draining: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                service.begin_drain()  # claim and send nothing more, at once
                stop.set()
            elif draining is not None:
                draining.cancel()  # a second signal: stop now

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        console.print("batchyard worker: running; Ctrl-C or SIGTERM stops gracefully")
        await stop.wait()
        console.print(
            f"batchyard worker: stopping; calls in flight have {settings.shutdown_grace_s:g} s"
        )
        draining = asyncio.create_task(service.drain(settings.shutdown_grace_s))
        with contextlib.suppress(asyncio.CancelledError):
            await draining
        if scrape is not None:
            server, serving = scrape
            server.should_exit = True
            await serving
        await service.stop()
        console.print("batchyard worker: stopped")

    with _store_errors():
        asyncio.run(main())


def _metrics_server(
    service: Service, host: str, port: int | None, log_level: str
) -> tuple[Any, asyncio.Task[None]] | None:
    """Start the worker's ``/metrics`` port (``app.create_metrics_app``), if one was asked for.

    uvicorn's own signal handling is turned off: the worker's handlers decide when to drain.
    """
    if port is None:
        return None
    import uvicorn

    from batchyard.app import create_metrics_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    config = uvicorn.Config(
        create_metrics_app(service),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        log_config=None,  # uvicorn's lines go through setup_logging's JSON handler
        lifespan="off",
    )
    server = Server(config)
    console.print(f"batchyard worker: metrics on http://{host}:{port}/metrics")
    return server, asyncio.create_task(server.serve())
