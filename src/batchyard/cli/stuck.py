"""``batchyard stuck``: batches and runs with work left whose progress stopped, and why.

Work is stuck when none of its units has ended for ``stuck_after_s`` (see
``store.stuck``). Every worker's stuck-work watch explains each standstill in
its owner's activity (``work_stuck``); this command lists the work from the
database with the reason from there (``work.stuck_watch.listing``):
``route_down``, ``limits``, ``market`` or ``unknown``, or ``no_worker`` when
no worker has watched lately (none is running, so nothing will move it). Work
a running worker has not looked at yet (it looks every quarter of
``stuck_after_s``, at most a minute) says ``checking``. Exit status 1 when
anything is stuck, so a cron job or a probe can alert on it.
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from batchyard.cli.admin import open_database
from batchyard.cli.options import database_options, settings_from

__all__ = ["stuck"]

console = Console(stderr=True)


@click.command()
@database_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line, for scripts.")
def stuck(config_file: str | None, database_url: str | None, as_json: bool) -> None:
    """Batches and runs that stopped moving, and why they wait (exit 1 if any)."""
    from batchyard.core.clock import SystemClock
    from batchyard.work.stuck_watch import listing

    settings = settings_from(config_file, database_url)
    after = settings.stuck_after_s
    db = open_database(config_file, database_url)
    now = SystemClock().now()
    try:
        found = db.read_sync(lambda c: listing(c, now, after))
    finally:
        db.close()
    if as_json:
        for row in found:
            click.echo(json.dumps(row))
    elif not found:
        console.print(f"[green]✓[/] nothing stuck (no work stood still for {after:g} s)")
    else:
        table = Table(title=f"stuck: no progress for {after:g} s")
        for col in ("kind", "id", "organisation", "since", "left", "reason", "why"):
            table.add_column(col, no_wrap=col in ("id", "organisation"))
        for row in found:
            table.add_row(
                row["kind"],
                row["id"],
                row["org_id"],
                row["since"],
                str(row["left"]),
                row["reason"],
                row["detail"],
            )
        out = Console()
        (out if out.is_terminal else Console(width=240)).print(table)
    if found:
        sys.exit(1)
