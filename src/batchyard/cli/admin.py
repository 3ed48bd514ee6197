"""Operator commands: ``keys``, ``credit``, ``audit``, ``orgs``.

They work on the database directly (migrating it first), so an operator can
create the first key before any server is running. Server modules are
imported inside the commands, so the client-only install can still load the
CLI for ``batchyard run``. A database that cannot be opened or written is one
line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import sys
from decimal import Decimal
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from batchyard.cli.options import (
    OperatorError,
    config_errors,
    database_options,
    settings_from,
    store_problem,
)

if TYPE_CHECKING:
    from batchyard.store.database import Database

__all__ = ["audit", "credit", "keys", "orgs"]

console = Console(stderr=True)


def open_database(config_file: str | None, database_url: str | None) -> Database:
    from batchyard.errors import StorageUnavailable
    from batchyard.store.database import Database

    settings = settings_from(config_file, database_url)
    try:
        db = Database(settings.database_url, pool_size=2)
        with config_errors():
            db.migrate()
    except StorageUnavailable as exc:
        # Not the API's "send it again with the same Idempotency-Key": the operator's fix.
        raise OperatorError(f"batchyard: {store_problem(exc)}") from None
    except OSError as exc:
        raise OperatorError(f"batchyard: the database cannot be opened: {exc}") from None
    return db


@click.group()
def keys() -> None:
    """Create, list and revoke API keys."""


@keys.command("create")
@click.option(
    "--org", "org_name", required=True, help="Organisation name (created at tier 0 if new)."
)
@click.option(
    "--scope",
    type=click.Choice(["full", "read", "inference"]),
    default="full",
    show_default=True,
    help="What the key may do.",
)
@database_options
def keys_create(
    org_name: str, scope: str, config_file: str | None, database_url: str | None
) -> None:
    """Create a key; the key itself is printed alone on the last line, once."""
    from sqlalchemy import Connection

    from batchyard.core.accounts import ApiKey, Organisation, Scope
    from batchyard.core.clock import SystemClock
    from batchyard.store import accounts

    db = open_database(config_file, database_url)
    now = SystemClock().now()

    def tx(conn: Connection) -> tuple[Organisation, ApiKey, str]:
        org = accounts.ensure_org(conn, org_name, now)
        key, secret = accounts.create_key(conn, org.id, Scope(scope), now)
        return org, key, secret

    try:
        org, key, secret = db.transact_sync(tx)
    finally:
        db.close()
    console.print(f"created key [bold]{key.id}[/] ({scope}) for {org.name} ({org.id}); shown once:")
    click.echo(secret)


@keys.command("list")
@click.option("--org", "org_name", required=True)
@database_options
def keys_list(org_name: str, config_file: str | None, database_url: str | None) -> None:
    """List an organisation's keys (never the secrets)."""
    from batchyard.store import accounts

    db = open_database(config_file, database_url)
    try:
        org = db.read_sync(lambda c: accounts.get_org_by_name(c, org_name))
        if org is None:
            raise click.ClickException(f"no organisation called {org_name!r}")
        rows = db.read_sync(lambda c: accounts.list_keys(c, org.id))
    finally:
        db.close()
    table = Table(title=f"keys of {org.name} ({org.id})")
    # The id is what `keys revoke` takes: never cut it short.
    table.add_column("id", no_wrap=True)
    for col in ("scope", "key", "created", "revoked"):
        table.add_column(col)
    for k in rows:
        table.add_row(
            k.id,
            k.scope.value,
            k.display,
            k.created_at.strftime("%Y-%m-%d %H:%M"),
            k.revoked_at.strftime("%Y-%m-%d %H:%M") if k.revoked_at else "",
        )
    out = Console()
    # Piped output (scripts, grep) gets room for whole rows rather than Rich's 80 columns.
    (out if out.is_terminal else Console(width=200)).print(table)


@keys.command("revoke")
@click.argument("key_id")
@database_options
def keys_revoke(key_id: str, config_file: str | None, database_url: str | None) -> None:
    """Revoke a key at once; what it started and was not sent yet is canceled."""
    from sqlalchemy import Connection

    from batchyard.core.accounts import ApiKey
    from batchyard.core.clock import SystemClock
    from batchyard.store import accounts
    from batchyard.store import deferred_batches as batch_store
    from batchyard.work.runs.canceling import stop_runs_of_revoked_keys

    db = open_database(config_file, database_url)
    now = SystemClock().now()

    def tx(c: Connection) -> tuple[ApiKey, int, list[str]]:
        key = accounts.revoke_key(c, key_id, now)
        # The same transaction stops its work; workers would also find it on their next round.
        return key, batch_store.cancel_for_revoked_keys(c, now), stop_runs_of_revoked_keys(c, now)

    try:
        key, items, runs = db.transact_sync(tx)
    except Exception as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        db.close()
    console.print(
        f"revoked {key.id}; canceled {items} waiting deferred item(s) and stopped "
        f"{len(runs)} run(s) it started"
    )


@keys.command("cap")
@click.argument("key_id")
@click.option("--total", default=None, help="The most the key may ever spend, in dollars.")
@click.option("--monthly", default=None, help="The most it may spend in a calendar month (UTC).")
@database_options
def keys_cap(
    key_id: str,
    total: str | None,
    monthly: str | None,
    config_file: str | None,
    database_url: str | None,
) -> None:
    """Cap what a key may spend (no option: remove its caps); every hold it takes checks them."""
    from sqlalchemy import Connection, select

    from batchyard.core.clock import SystemClock
    from batchyard.core.money import to_ticks
    from batchyard.store import spend_caps
    from batchyard.store.tables import api_keys

    caps = [None if v is None else to_ticks(_amount(v)) for v in (total, monthly)]
    db = open_database(config_file, database_url)
    now = SystemClock().now()

    def tx(c: Connection) -> spend_caps.CapRow | None:
        org_id = c.execute(select(api_keys.c.org_id).where(api_keys.c.id == key_id)).scalar()
        if org_id is None:
            raise click.ClickException(
                f"no key {key_id}; `batchyard keys list --org NAME` lists them"
            )
        return spend_caps.set_cap(
            c, org_id, f"key:{key_id}", total=caps[0], monthly=caps[1], now=now
        )

    try:
        row = db.transact_sync(tx)
    finally:
        db.close()
    if row is None:
        console.print(f"{key_id} has no spend cap")
        return
    view = row.view()
    for kind in ("total", "monthly"):
        part = view[kind]
        assert isinstance(part, dict)
        if part["cap"] is not None:
            console.print(
                f"{key_id} {kind} cap ${part['cap']}: ${part['charged']} charged, "
                f"${part['held']} held, ${part['left']} left"
            )


@click.group()
def credit() -> None:
    """Add credit and set automatic top-ups (no payment processor: the operator adds it)."""


def _amount(text: str) -> Decimal:
    from batchyard.core.money import parse_money

    try:
        value = parse_money(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if value <= 0:
        raise click.BadParameter("the amount must be positive")
    return value


@credit.command("add")
@click.option("--org", "org_name", required=True)
@click.argument("amount")
@database_options
def credit_add(
    org_name: str, amount: str, config_file: str | None, database_url: str | None
) -> None:
    """Add AMOUNT US dollars of credit; buying credit can move the organisation up a tier."""
    from batchyard.core.clock import SystemClock
    from batchyard.core.money import format_money, to_ticks
    from batchyard.store import accounts, ledger

    value = _amount(amount)
    settings = settings_from(config_file, database_url)
    db = open_database(config_file, database_url)
    now = SystemClock().now()
    try:
        org = db.read_sync(lambda c: accounts.get_org_by_name(c, org_name))
        if org is None:
            raise click.ClickException(f"no organisation called {org_name!r}; create a key first")
        bal = db.transact_sync(
            lambda c: ledger.top_up(c, org.id, to_ticks(value), now, tiers=settings.tiers)
        )
        tier = db.read_sync(lambda c: accounts.get_org(c, org.id).tier)
    finally:
        db.close()
    console.print(
        f"added ${format_money(value)} to {org.name}: available ${format_money(bal.available)}, "
        f"tier {tier}"
    )


@credit.command("auto-topup")
@click.option("--org", "org_name", required=True)
@click.option(
    "--threshold", required=True, help="Top up when available credit would fall below this."
)
@click.option("--amount", "amount", required=True, help="How much each automatic top-up adds.")
@database_options
def credit_auto_topup(
    org_name: str, threshold: str, amount: str, config_file: str | None, database_url: str | None
) -> None:
    """Record an automatic top-up rule: threshold + amount."""
    from batchyard.store import accounts

    t, a = _amount(threshold), _amount(amount)
    db = open_database(config_file, database_url)
    try:
        org = db.read_sync(lambda c: accounts.get_org_by_name(c, org_name))
        if org is None:
            raise click.ClickException(f"no organisation called {org_name!r}")
        db.transact_sync(lambda c: accounts.set_auto_topup(c, org.id, t, a))
    finally:
        db.close()
    console.print(f"{org_name}: top up ${a} whenever available credit would fall below ${t}")


@click.command()
@database_options
def audit(config_file: str | None, database_url: str | None) -> None:
    """Check every ledger invariant and look for stranded holds; exit 0 only when all is well."""
    from batchyard.app import verify_key_of
    from batchyard.core.clock import SystemClock
    from batchyard.store import billing, holds, ledger

    db = open_database(config_file, database_url)
    now = SystemClock().now()
    try:
        # A wrong or lost batch key is refused here too, before the audit says all is well.
        with config_errors():
            verify_key_of(settings_from(config_file, database_url), db, SystemClock())
        problems = db.read_sync(ledger.audit) + db.read_sync(billing.audit_charges)
        stranded = db.read_sync(lambda c: holds.stranded(c, now))
    finally:
        db.close()
    for p in problems:
        console.print(f"[red]✗[/] {p}")
    for s in stranded:
        console.print(f"[red]✗[/] stranded hold {s.describe()}")
    if problems or stranded:
        console.print(
            f"[red]{len(problems)} ledger invariant(s) broken, {len(stranded)} stranded "
            "hold(s)[/] (see docs/how-to/operate.md#holds)"
        )
        sys.exit(1)
    console.print(
        "[green]✓[/] ledger sound: balance = top-ups − settled charges − held reservations; "
        "every charge is its usage at its price; no stranded holds"
    )


@click.group()
def orgs() -> None:
    """Show an organisation and set its zero data retention."""


@orgs.command("show")
@click.option("--org", "org_name", required=True)
@database_options
def orgs_show(org_name: str, config_file: str | None, database_url: str | None) -> None:
    """The organisation's tier and whether it has zero data retention."""
    from batchyard.store import accounts

    db = open_database(config_file, database_url)
    try:
        org = db.read_sync(lambda c: accounts.get_org_by_name(c, org_name))
    finally:
        db.close()
    if org is None:
        raise click.ClickException(f"no organisation called {org_name!r}")
    click.echo(f"{org.name} ({org.id}): tier {org.tier}, zero data retention {_on(org)}")


def _on(org: object) -> str:
    return "on" if getattr(org, "zero_data_retention", False) else "off"


@orgs.command("retention")
@click.option("--org", "org_name", required=True)
@click.argument("setting", type=click.Choice(["zero", "standard"]))
@database_options
def orgs_retention(
    org_name: str, setting: str, config_file: str | None, database_url: str | None
) -> None:
    """Set zero data retention on (``zero``) or off (``standard``) for the organisation.

    With zero data retention no answer is saved for replay: a rerun under the same
    Idempotency-Key runs and charges again, and decide's batch calibration keeps
    nothing of the texts. Submissions (deferred and file batches) still keep their
    keys, since their answers hold no text. See docs/reference/privacy.md.
    """
    from batchyard.store import accounts

    on = setting == "zero"
    db = open_database(config_file, database_url)
    try:
        found = db.read_sync(lambda c: accounts.get_org_by_name(c, org_name))
        if found is None:
            raise click.ClickException(f"no organisation called {org_name!r}")
        org_id = found.id
        db.transact_sync(lambda c: accounts.set_zero_data_retention(c, org_id, on))
        after = db.read_sync(lambda c: accounts.get_org(c, org_id))
    finally:
        db.close()
    console.print(f"{org_name}: zero data retention {_on(after)}")
