"""``import batchyard`` exposes exactly the documented client API, and stays light."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import batchyard
from batchyard.errors import BatchyardError

# The public names, as the package docstring and docs/reference/python.md list them.
DOCUMENTED = {
    "AsyncClient",
    "BatchyardError",
    "Client",
    "Conflict",
    "IdempotencyConflict",
    "IdempotencyResponseExpired",
    "InsufficientCredit",
    "InvalidRequest",
    "NotFound",
    "RateLimited",
    "Unauthorized",
    "__version__",
}


def test_all_is_exactly_the_documented_names():
    assert set(batchyard.__all__) == DOCUMENTED
    assert len(batchyard.__all__) == len(DOCUMENTED)


def test_every_public_name_resolves():
    for name in batchyard.__all__:
        assert getattr(batchyard, name) is not None, name
    assert isinstance(batchyard.__version__, str)
    for name in DOCUMENTED - {"Client", "AsyncClient", "__version__"}:
        assert issubclass(getattr(batchyard, name), BatchyardError), name
    from batchyard.client import AsyncClient, Client

    assert batchyard.Client is Client
    assert batchyard.AsyncClient is AsyncClient


def test_an_unknown_attribute_raises_attribute_error():
    try:
        batchyard.NoSuchThing
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("batchyard.NoSuchThing resolved")


def test_the_client_imports_none_of_the_server():
    code = (
        "import sys, batchyard; batchyard.Client; batchyard.AsyncClient; "
        "heavy = [m for m in ('fastapi', 'sqlalchemy', 'uvicorn', 'alembic', 'llama_cpp', "
        "'batchyard.store', 'batchyard.api', 'batchyard.work') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_the_python_reference_lists_exactly_the_public_names():
    assert _documented("name") == DOCUMENTED


def _documented(column: str) -> set[str]:
    """The names in the python reference's table whose first header is ``column``."""
    page = Path(__file__).resolve().parents[2] / "docs" / "reference" / "python.md"
    rows: list[str] = []
    inside = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("| "):
            inside = inside or line.split("|")[1].strip() == column
            if inside:
                rows.append(line.split("|")[1])
        else:
            inside = False
    return {name for row in rows for name in re.findall(r"`(\w+)`", row)}


def test_the_client_package_exposes_exactly_its_documented_names():
    """``batchyard.client``'s names are a promise to users; the modules behind them are not."""
    import batchyard.client

    documented = _documented("`batchyard.client` name")
    assert set(batchyard.client.__all__) == documented
    assert len(batchyard.client.__all__) == len(documented)
    public = {n for n in vars(batchyard.client) if not n.startswith("_")}
    # Submodules are attributes of their package once imported; they are not its names.
    modules = {n for n in public if type(getattr(batchyard.client, n)).__name__ == "module"}
    assert public - modules == documented
