"""docs/architecture.md stays true: every module it should name, it names.

The page maps the folders as they are; a module added without a word there is a
part a newcomer cannot place. Each module's name must appear in the page as code
(`name`), in its folder's row or in the text.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "batchyard"
PAGE = ROOT / "docs" / "architecture.md"

# Plumbing a reader never looks for: entry points and Alembic's own files.
UNLISTED = {"__init__", "__main__", "env", "logs"}


def _modules() -> list[Path]:
    return [
        p
        for p in PACKAGE.rglob("*.py")
        if p.stem not in UNLISTED and "versions" not in p.parts and "privacy" not in p.parts
    ]


def test_every_module_is_named_in_the_architecture_page() -> None:
    page = PAGE.read_text()
    named = set(re.findall(r"`([a-z_]+)(?:\.py)?`", page))
    named |= {m.rstrip("/") for m in re.findall(r"`([a-z_]+/)`", page)}
    missing = sorted(str(p.relative_to(PACKAGE)) for p in _modules() if p.stem not in named)
    assert missing == [], f"docs/architecture.md does not name: {missing}"


def test_every_top_level_folder_is_a_layer_of_the_drawing() -> None:
    page = PAGE.read_text()
    drawing = page.split("```", 2)[1]
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert [f for f in folders if f"{f}/" not in drawing] == []
