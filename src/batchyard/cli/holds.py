"""``batchyard holds``: see and resolve holds that cannot resolve by themselves.

A hold strands only after a fault: a call whose outcome is unknown
(``uncertain``), a request that died between its hold and its settlement.
``batchyard audit`` reports each one with the command that resolves it;
``holds list`` shows them; ``holds release`` voids one (nothing charged) and
``holds settle`` charges an amount up to the hold (what the provider billed).
Both write an activity record naming the operator and the reason, in the
owner's ``GET /v1/activity``, in the same transaction as the ledger entry.
A hold a running worker or request still owns is refused unless ``--force``.
"""

from __future__ import annotations

import getpass
import sys

import click
from rich.console import Console
from rich.table import Table

from batchyard.cli.admin import open_database
from batchyard.cli.options import database_options

__all__ = ["holds"]

console = Console(stderr=True)


@click.group()
def holds() -> None:
    """List and resolve holds that cannot resolve by themselves."""


@holds.command("list")
@database_options
def holds_list(config_file: str | None, database_url: str | None) -> None:
    """Stranded holds: why each is held and the command that resolves it (exit 1 if any)."""
    from batchyard.core.clock import SystemClock
    from batchyard.core.money import format_money
    from batchyard.store import holds as store

    db = open_database(config_file, database_url)
    now = SystemClock().now()
    try:
        found = db.read_sync(lambda c: store.stranded(c, now))
    finally:
        db.close()
    if not found:
        console.print("[green]✓[/] no stranded holds")
        return
    table = Table(title="stranded holds")
    for col in ("reservation", "organisation", "purpose", "ref", "held", "since", "why"):
        table.add_column(col, no_wrap=col in ("reservation", "organisation"))
    for s in found:
        table.add_row(
            s.reservation_id,
            s.org_id,
            s.purpose,
            s.ref or "",
            "$" + format_money(s.amount),
            s.created_at.strftime("%Y-%m-%d %H:%M"),
            s.why,
        )
    out = Console()
    (out if out.is_terminal else Console(width=240)).print(table)
    for s in found:
        console.print(f"{s.reservation_id}: {s.remedy}")
    sys.exit(1)


def _resolve(
    reservation_id: str,
    amount: str | None,
    reason: str,
    force: bool,
    config_file: str | None,
    database_url: str | None,
) -> None:
    from sqlalchemy import Connection

    from batchyard.core.clock import SystemClock
    from batchyard.core.money import format_money, parse_money, to_ticks
    from batchyard.errors import BatchyardError
    from batchyard.store import holds as store
    from batchyard.store import ledger

    charge = None
    if amount is not None:
        try:
            charge = to_ticks(parse_money(amount))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--amount") from None
        if charge < 0:
            raise click.BadParameter("the amount cannot be negative", param_hint="--amount")
    db = open_database(config_file, database_url)
    now = SystemClock().now()
    operator = getpass.getuser()

    def tx(c: Connection) -> ledger.Reservation:
        if not force:
            mine = {s.reservation_id: s for s in store.stranded(c, now)}
            found = mine.get(reservation_id)
            if found is None or found.worker_resolves:
                raise click.ClickException(
                    f"{reservation_id} is not a stranded hold (a request or worker still owns "
                    "it, or it is resolved); see `batchyard holds list`, or pass --force"
                )
        return store.resolve(
            c, reservation_id, now, charge=charge, reason=reason, operator=operator
        )

    try:
        res = db.transact_sync(tx)
    except BatchyardError as exc:
        raise click.ClickException(exc.message) from None
    finally:
        db.close()
    if charge is None:
        console.print(f"released {res.id}: ${format_money(res.amount)} back to {res.org_id}")
    else:
        console.print(
            f"settled {res.id}: charged ${format_money(res.charged or 0)} of "
            f"${format_money(res.amount)} to {res.org_id}"
        )


@holds.command("release")
@click.argument("reservation_id")
@click.option("--reason", required=True, help="Why: kept in the owner's activity log.")
@click.option("--force", is_flag=True, help="Even if a worker or request may still own it.")
@database_options
def holds_release(
    reservation_id: str,
    reason: str,
    force: bool,
    config_file: str | None,
    database_url: str | None,
) -> None:
    """Release a stranded hold: nothing is charged (the call did not run, or is not billed)."""
    _resolve(reservation_id, None, reason, force, config_file, database_url)


@holds.command("settle")
@click.argument("reservation_id")
@click.option("--amount", required=True, help="US dollars to charge, at most the hold.")
@click.option("--reason", required=True, help="Why: kept in the owner's activity log.")
@click.option("--force", is_flag=True, help="Even if a worker or request may still own it.")
@database_options
def holds_settle(
    reservation_id: str,
    amount: str,
    reason: str,
    force: bool,
    config_file: str | None,
    database_url: str | None,
) -> None:
    """Settle a stranded hold to what the call cost (the provider ran it); the rest is released."""
    _resolve(reservation_id, amount, reason, force, config_file, database_url)
