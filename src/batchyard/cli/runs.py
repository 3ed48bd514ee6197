"""Operator commands for batch inference runs: ``batchyard runs approve``.

A run whose quote is above ``billing_review_threshold`` waits in ``blocked``
(``billing_review``) until an operator approves it here; it is then funded
from the organisation's credit like any confirmed run (or blocked on
``funds`` if the credit is short) and a worker picks it up.
"""

from __future__ import annotations

import click
from rich.console import Console

from batchyard.cli.admin import open_database
from batchyard.cli.options import database_options, settings_from

__all__ = ["runs"]

console = Console(stderr=True)


@click.group()
def runs() -> None:
    """Look after batch inference runs."""


@runs.command("approve")
@click.argument("run_id")
@database_options
def approve(run_id: str, config_file: str | None, database_url: str | None) -> None:
    """Approve a run held for billing review, and reserve its quote."""
    from batchyard.core.clock import SystemClock
    from batchyard.errors import BatchyardError
    from batchyard.work.runs.funding import approve as approve_run

    settings = settings_from(config_file, database_url)
    db = open_database(config_file, database_url)
    try:
        now = SystemClock().now()
        status = db.transact_sync(lambda c: approve_run(c, run_id, now, tiers=settings.tiers))
    except BatchyardError as exc:
        raise click.ClickException(exc.message) from None
    finally:
        db.close()
    if status == "queued":
        console.print(f"approved [bold]{run_id}[/]: its quote is reserved and it is queued")
    else:
        console.print(
            f"approved [bold]{run_id}[/], but the organisation's credit cannot cover the quote: "
            "it waits on funds and starts once credit is added"
        )
