"""Options every operator command shares, and the settings they produce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["database_options", "settings_from"]


def database_options(fn: F) -> F:
    fn = click.option(
        "--config",
        "config_file",
        envvar="BATCHYARD_CONFIG",
        type=click.Path(exists=True, dir_okay=False),
        help="Config file (YAML or TOML). Env: BATCHYARD_CONFIG.",
    )(fn)
    fn = click.option(
        "--database",
        "database_url",
        envvar="BATCHYARD_DATABASE_URL",
        help="Database URL (sqlite:///PATH or postgresql://...). Env: BATCHYARD_DATABASE_URL.",
    )(fn)
    return fn


def settings_from(config_file: str | None, database_url: str | None) -> Any:
    from batchyard.core.config import load_settings

    return load_settings(config_file=config_file, database_url=database_url)
