"""Options every operator command shares, the settings they produce, and how they refuse.

An operator's mistake (a bad config value, a wrong batch key, a database that
cannot be written) is one line on stderr and a non-zero exit status, never a
traceback: ``OperatorError`` prints its message as it is. A config error exits
78 (``EX_CONFIG``, which systemd's ``RestartPreventExitStatus=`` can name, so a
unit does not restart into the same mistake); a store that cannot be used exits 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any, ClassVar, TypeVar

import click

if TYPE_CHECKING:
    from batchyard.errors import StorageUnavailable

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "EX_CONFIG",
    "ConfigRefused",
    "OperatorError",
    "config_errors",
    "database_options",
    "settings_from",
    "store_problem",
]

#: sysexits.h's "configuration error".
EX_CONFIG = 78


class OperatorError(click.ClickException):
    """One line on stderr, as is (click's own adds "Error: "), and an exit status."""

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(self.format_message(), err=True)


class ConfigRefused(OperatorError):
    """A config mistake: its one line, and exit status 78."""

    exit_code: ClassVar[int] = EX_CONFIG


def database_options(fn: F) -> F:
    fn = click.option(
        "--config",
        "config_file",
        envvar="BATCHYARD_CONFIG",
        # Not exists=True: a missing file is the config error's one line, not click's usage text.
        type=click.Path(dir_okay=False),
        help="Config file (YAML or TOML). Env: BATCHYARD_CONFIG.",
    )(fn)
    fn = click.option(
        "--database",
        "database_url",
        envvar="BATCHYARD_DATABASE_URL",
        help="Database URL (sqlite:///PATH or postgresql://...). Env: BATCHYARD_DATABASE_URL.",
    )(fn)
    return fn


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """A ``ConfigError`` inside becomes its one line and exit status 78."""
    from batchyard.core.config_errors import ConfigError

    try:
        yield
    except ConfigError as exc:
        raise ConfigRefused(exc.line()) from None


def settings_from(config_file: str | None, database_url: str | None) -> Any:
    from batchyard.core.config import load_settings

    with config_errors():
        return load_settings(config_file=config_file, database_url=database_url)


def store_problem(exc: StorageUnavailable) -> str:
    """What the driver said about the store, without the advice meant for API callers.

    ``StorageUnavailable``'s message tells a client to resend its request under
    the same Idempotency-Key; an operator needs the cause and what to check.
    """
    cause = exc.__cause__
    orig = getattr(cause, "orig", None) or cause
    reason = str(orig).strip().splitlines()[0][:200] if orig is not None else exc.message
    return (
        f"the database cannot be used: {reason} — check that the store is up and "
        "writable by this user (a full disk, a read-only file or mount, PostgreSQL down), "
        "then run the command again"
    )
