"""``batchyard serve`` and ``batchyard worker``: the same code on SQLite or PostgreSQL.

Both stop gracefully on SIGTERM (or Ctrl-C): nothing more is claimed or sent,
calls in flight get ``--grace`` seconds (``shutdown_grace_s``, 30 by default)
to land, and only calls still in flight then are cut off and become
``uncertain``; claimed work never sent goes back to waiting. ``serve`` also
stops taking requests, lets those in progress finish within the same grace,
and answers ``/readyz`` 503 from the first signal. A second signal stops at
once. A store that cannot be opened or written at start is one line on
stderr and exit status 1, not a traceback.
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

from batchyard.cli.options import database_options, settings_from

if TYPE_CHECKING:
    from batchyard.core.config import Settings
    from batchyard.service import Service

__all__ = ["serve", "worker"]

console = Console(stderr=True)

GRACE_HELP = (
    "Seconds calls in flight may take to land after SIGTERM before they are cut off "
    "(default: shutdown_grace_s, 30)."
)


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """A store that cannot be opened, migrated or written: one clear line, exit 1."""
    from batchyard.errors import StorageUnavailable

    try:
        yield
    except StorageUnavailable as exc:
        raise click.ClickException(f"the database cannot be used: {exc.message}") from None
    except OSError as exc:
        raise click.ClickException(f"the database cannot be opened: {exc}") from None


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
@click.option("--log-level", default="info", show_default=True)
@click.option("--grace", type=float, default=None, help=GRACE_HELP)
@database_options
def serve(
    host: str,
    port: int,
    no_worker: bool,
    log_level: str,
    grace: float | None,
    config_file: str | None,
    database_url: str | None,
) -> None:
    """Start the API (and an in-process worker) on SQLite by default."""
    import uvicorn

    from batchyard.app import build_service, create_app
    from batchyard.logs import setup_logging

    setup_logging(log_level.upper())
    settings = _settings(config_file, database_url, grace)
    with _store_errors():
        service = build_service(settings)
        service.db.migrate()  # here, so a store that cannot be written is one line, not a trace
    _report_batch_key(service)
    where = settings.sqlite_path or settings.database_url.split("@")[-1]
    console.print(f"batchyard: database {where}; listening on http://{host}:{port}")
    app = create_app(service, worker=not no_worker)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # At the first signal the workers stop claiming and /readyz turns 503,
            # while uvicorn lets the requests in progress finish.
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_soon_threadsafe(service.begin_drain)
            super().handle_exit(sig, frame)

    Server(config).run()


@click.command()
@click.option("--log-level", default="info", show_default=True)
@click.option("--grace", type=float, default=None, help=GRACE_HELP)
@database_options
def worker(
    log_level: str, grace: float | None, config_file: str | None, database_url: str | None
) -> None:
    """Run background work (runs, deferred batches) without serving HTTP."""
    from batchyard.app import build_service
    from batchyard.logs import setup_logging

    setup_logging(log_level.upper())
    settings = _settings(config_file, database_url, grace)

    async def main() -> None:
        service = build_service(settings)
        _report_batch_key(service)
        await service.start(worker=True)
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
        await service.stop()
        console.print("batchyard worker: stopped")

    with _store_errors():
        asyncio.run(main())
