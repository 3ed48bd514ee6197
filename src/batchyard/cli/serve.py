"""``batchyard serve`` and ``batchyard worker``: the same code on SQLite or PostgreSQL."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

import click
from rich.console import Console

from batchyard.cli.options import database_options, settings_from

if TYPE_CHECKING:
    from batchyard.service import Service

__all__ = ["serve", "worker"]

console = Console(stderr=True)


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


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--no-worker", is_flag=True, help="Serve the API only; run workers separately.")
@click.option("--log-level", default="info", show_default=True)
@database_options
def serve(
    host: str,
    port: int,
    no_worker: bool,
    log_level: str,
    config_file: str | None,
    database_url: str | None,
) -> None:
    """Start the API (and an in-process worker) on SQLite by default."""
    import uvicorn

    from batchyard.app import build_service, create_app
    from batchyard.logs import setup_logging

    setup_logging(log_level.upper())
    settings = settings_from(config_file, database_url)
    service = build_service(settings)
    _report_batch_key(service)
    where = settings.sqlite_path or settings.database_url.split("@")[-1]
    console.print(f"batchyard: database {where}; listening on http://{host}:{port}")
    app = create_app(service, worker=not no_worker)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


@click.command()
@click.option("--log-level", default="info", show_default=True)
@database_options
def worker(log_level: str, config_file: str | None, database_url: str | None) -> None:
    """Run background work (runs, deferred batches) without serving HTTP."""
    from batchyard.app import build_service
    from batchyard.logs import setup_logging

    setup_logging(log_level.upper())
    settings = settings_from(config_file, database_url)

    async def main() -> None:
        service = build_service(settings)
        _report_batch_key(service)
        await service.start(worker=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        console.print("batchyard worker: running; Ctrl-C stops")
        await stop.wait()
        await service.stop()

    asyncio.run(main())
