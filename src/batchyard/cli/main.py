"""The ``batchyard`` command group."""

from __future__ import annotations

import click

from batchyard.cli.admin import audit, credit, keys, orgs
from batchyard.cli.batches import batches
from batchyard.cli.check import command as check_command
from batchyard.cli.demo import demo
from batchyard.cli.holds import holds
from batchyard.cli.runs import runs
from batchyard.cli.serve import serve, worker
from batchyard.cli.stuck import stuck
from batchyard.cli.text_runner import command as run_command

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchyard")
def cli() -> None:
    """batchyard: a self-hostable batch inference gateway for LLMs."""


for command in (serve, worker, keys, credit, audit, orgs, holds, stuck, runs, batches, demo):
    cli.add_command(command)

cli.add_command(run_command, "run")
cli.add_command(check_command, "check")


def main() -> None:
    cli()
