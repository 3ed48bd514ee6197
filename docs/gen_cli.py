"""Generate docs/reference/cli.md from the click help of every ``batchyard`` command.

    python docs/gen_cli.py --write   # rewrite the page
    python docs/gen_cli.py --check   # exit 1 when the page is stale (``make docs``)

The help is rendered at a fixed width so the page does not depend on the
terminal that generated it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pages import check_or_write  # noqa: E402

from batchyard.cli.main import cli  # noqa: E402

PAGE = ROOT / "docs" / "reference" / "cli.md"
WIDTH = 100

HEADER = """# CLI reference

Generated from the commands' own help by `python docs/gen_cli.py --write`; `make docs`
fails when this page and the code disagree. Every operator command reads
`BATCHYARD_DATABASE_URL` and `BATCHYARD_CONFIG` (or `--database` and `--config`), so the
CLI and the server agree on where the data is. See [operate](../how-to/operate.md) for
the commands in use.
"""


def _walk(
    command: click.Command, path: list[str], parent: click.Context | None
) -> Iterator[tuple[str, str]]:
    settings = {**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    ctx = click.Context(command, info_name=path[-1], parent=parent, **settings)
    yield " ".join(path), command.get_help(ctx)
    if isinstance(command, click.Group):
        for name in sorted(command.list_commands(ctx)):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, [*path, name], ctx)


def render() -> str:
    parts = [HEADER]
    for name, text in _walk(cli, ["batchyard"], None):
        parts.append(f"## `{name}`\n\n```text\n{text.rstrip()}\n```\n")
    return "\n".join(parts)


def main() -> int:
    return check_or_write(PAGE, render(), "gen_cli.py")


if __name__ == "__main__":
    sys.exit(main())
