"""Write or check a generated reference page: shared by ``gen_cli.py`` and ``gen_config.py``.

A generated page is never edited by hand alone: ``--write`` rewrites it from
the code, ``--check`` (``make docs``) exits 1 with a diff when it is stale.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def check_or_write(page: Path, fresh: str, script: str) -> int:
    """``--write`` the page, or ``--check`` it against ``fresh``; the exit status."""
    name = page.relative_to(ROOT)
    ap = argparse.ArgumentParser(description=f"Generate or check {name}.")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    mode.add_argument("--write", action="store_true", help="rewrite the page")
    args = ap.parse_args()
    if args.write:
        page.write_text(fresh, encoding="utf-8")
        print(f"wrote {name}")
        return 0
    current = page.read_text(encoding="utf-8") if page.exists() else ""
    if current == fresh:
        print(f"{name} is up to date")
        return 0
    diff = difflib.unified_diff(
        current.splitlines(), fresh.splitlines(), str(name), "generated", lineterm=""
    )
    print("\n".join(list(diff)[:60]))
    print(f"\n{name} is stale: run `python docs/{script} --write`")
    return 1
