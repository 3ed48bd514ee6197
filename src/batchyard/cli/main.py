"""The ``batchyard`` command group."""

from __future__ import annotations

import click

from batchyard.cli.admin import audit, credit, keys
from batchyard.cli.demo import demo
from batchyard.cli.serve import serve, worker

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchyard")
def cli() -> None:
    """batchyard: a self-hostable batch inference gateway for LLMs."""


for command in (serve, worker, keys, credit, audit, demo):
    cli.add_command(command)

try:  # the client commands, present once the client package is installed
    from batchyard.cli import check as _check
    from batchyard.cli import run as _run

    cli.add_command(_run.command, "run")
    cli.add_command(_check.command, "check")
except ImportError:  # pragma: no cover - only while the client is being built
    pass


def main() -> None:
    cli()
