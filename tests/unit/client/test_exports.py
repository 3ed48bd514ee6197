"""Every client module's ``__all__`` lists exactly its public names (as httpx tests its own).

``__all__`` is what ``from module import *``, the docs and readers take as the
module's surface; a public function missing from it (``calls.py`` once listed
2 of its 23) reads as private, and a listed name that no longer exists breaks
star-imports. Public means defined at the module's top level without a
leading underscore; ``__init__`` re-exports, so there the imported names count.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import batchyard.client

MODULES = sorted(
    ["batchyard.client"]
    + [f"batchyard.client.{m.name}" for m in pkgutil.iter_modules(batchyard.client.__path__)]
)


def _public_names(path: Path, *, package: bool) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif package and isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_every_public_name_and_nothing_else(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None
    path = Path(module.__file__)
    listed = module.__all__
    assert len(listed) == len(set(listed)), "a name is listed twice"
    assert set(listed) == _public_names(path, package=path.name == "__init__.py")
    for public in listed:
        assert hasattr(module, public), public


def test_the_client_package_modules_are_all_checked() -> None:
    assert {"batchyard.client.calls", "batchyard.client.sync_client"} <= set(MODULES)
