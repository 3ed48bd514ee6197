"""docs/architecture.md stays true, and the rules it states hold in the code.

The page maps the folders as they are: a module added without a row in its own
folder's table is a part a newcomer cannot place, and a row for a module that is
gone sends them looking for nothing. A stem found anywhere on the page is not
enough (many modules share one with a module of another layer, by design), so
each module must be named by its path under ``src/batchyard`` in the table of
its own folder's section.

Three rules import-linter cannot see are checked here on the syntax tree, so a
change that breaks one fails ``make unit``:

- no module-level registry: a mutable container bound at module scope is state
  every caller shares behind the composition root's back;
- no raw SQL outside ``store/``: statements are built with SQLAlchemy Core, in
  the store, where the tables are;
- nothing reads a clock but ``core/clock.py``: ruff bans ``time.time`` and
  ``datetime.now`` (TID251); ``loop.time()`` and the like it cannot see.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "batchyard"
PAGE = ROOT / "docs" / "architecture.md"

# Alembic's migrations are one folder's row, not a row each.
MIGRATIONS = Path("store/migrations/versions")


def _modules() -> list[Path]:
    """Every module, as its path under ``src/batchyard``."""
    return sorted(
        p.relative_to(PACKAGE)
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts and MIGRATIONS not in p.relative_to(PACKAGE).parents
    )


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(rel, ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))) for rel in _modules()]


def _folder_tables(page: str) -> dict[str, set[str]]:
    """Each ``### `folder/``` section's table: the paths in its first column."""
    tables: dict[str, set[str]] = {}
    folder: str | None = None
    for line in page.splitlines():
        heading = re.fullmatch(r"### `([\w/]+)/`", line.strip())
        if heading:
            folder = heading.group(1)
            tables[folder] = set()
        elif line.startswith("#"):
            folder = None
        elif folder is not None and line.startswith("| `"):
            tables[folder].add(line.split("|")[1].strip().strip("`"))
    return tables


def _section(rel: Path) -> str:
    return "batchyard" if rel.parent == Path(".") else str(rel.parent)


def test_every_module_is_in_its_own_folders_table() -> None:
    tables = _folder_tables(PAGE.read_text(encoding="utf-8"))
    missing = [str(rel) for rel in _modules() if str(rel) not in tables.get(_section(rel), set())]
    assert missing == [], f"docs/architecture.md has no row in its folder's table for {missing}"


def test_every_row_names_a_module_of_its_folder() -> None:
    tables = _folder_tables(PAGE.read_text(encoding="utf-8"))
    real = {(_section(rel), str(rel)) for rel in _modules()}
    stale = sorted(
        f"{folder}: {row}"
        for folder, rows in tables.items()
        for row in rows
        if (folder, row) not in real
    )
    assert stale == [], f"docs/architecture.md lists modules that are not there: {stale}"


def test_every_top_level_folder_is_a_layer_of_the_drawing() -> None:
    page = PAGE.read_text(encoding="utf-8")
    drawing = page.split("```", 2)[1]
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert [f for f in folders if f"{f}/" not in drawing] == []


# -- no module-level registries ------------------------------------------------------

MUTABLE_FACTORIES = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}

#: (module, name): why this module-level container is not a registry.
REGISTRY_ALLOWED = {
    # llama.cpp's finaliser crashes if it runs after the module's teardown, so models
    # still open at exit are closed first; the set only holds what is alive anyway.
    ("engines/llama/models.py", "open_models"),
    # A cache of compiled grammars, a pure function of the schema's text.
    ("engines/llama_sampling.py", "_grammars"),
    # A cache of each GGUF file's vocabulary, a pure function of the file.
    ("engines/tokenizers.py", "_vocabs"),
}


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_constant_name(name: str) -> bool:
    """``UPPER_CASE``: a table written once in the source, never added to."""
    return name.lstrip("_").replace("_", "").isupper()


def registries(rel: Path, tree: ast.Module) -> list[str]:
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        literal = isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp)
        literal = literal or isinstance(value, ast.SetComp)
        made = isinstance(value, ast.Call) and _name(value.func) in MUTABLE_FACTORIES
        for target in targets:
            name = _name(target) or "?"
            if name == "__all__" or (str(rel), name) in REGISTRY_ALLOWED:
                continue
            if made or (literal and not _is_constant_name(name)):
                found.append(f"{rel}:{node.lineno} {name}")
    found += [
        f"{rel}:{n.lineno} global {n.names}" for n in ast.walk(tree) if isinstance(n, ast.Global)
    ]
    return found


def test_the_registry_rule_fails_on_a_registry() -> None:
    tree = ast.parse(
        "import weakref\n"
        "ROUTES = {'a': 1}\n"  # a constant table: allowed
        "_seen = weakref.WeakKeyDictionary()\n"
        "handlers: dict[str, int] = {}\n"
        "def f():\n    global handlers\n"
    )
    assert [hit.split(" ", 1)[1] for hit in registries(Path("work/x.py"), tree)] == [
        "_seen",
        "handlers",
        "global ['handlers']",
    ]


# -- no raw SQL outside store/ -------------------------------------------------------

SQL = re.compile(r"\b(SELECT\b[\s\S]+\bFROM|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM)\b")


def _docstrings(tree: ast.Module) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, nodes) and n.body and isinstance(n.body[0], ast.Expr)
    }


def raw_sql(rel: Path, tree: ast.Module) -> list[str]:
    if rel.parts[0] == "store":
        return []
    sql_text = {
        alias.asname or alias.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sqlalchemy")
        for alias in n.names
        if alias.name == "text"
    }
    docstrings = _docstrings(tree)
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name) and f.id in sql_text:
                found.append(f"{rel}:{n.lineno} text()")
            elif (
                isinstance(f, ast.Attribute)
                and f.attr == "text"
                and _name(f.value) in ("sa", "sqlalchemy")
            ):
                found.append(f"{rel}:{n.lineno} {ast.unparse(f)}()")
            elif isinstance(f, ast.Attribute) and f.attr == "exec_driver_sql":
                found.append(f"{rel}:{n.lineno} exec_driver_sql()")
        elif (
            isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and id(n) not in docstrings
            and SQL.search(n.value)
        ):
            found.append(f"{rel}:{n.lineno} {n.value[:40]!r}")
    return found


def test_the_sql_rule_fails_on_raw_sql() -> None:
    tree = ast.parse(
        "from sqlalchemy import text\n"
        "import sqlalchemy as sa\n"
        "def f(c, reply):\n"
        "    reply.text()\n"  # not SQLAlchemy's
        "    c.execute(text('x'))\n"
        "    c.execute(sa.text('x'))\n"
        "    c.exec_driver_sql('x')\n"
        "    q = 'UPDATE runs SET status = 1'\n"
    )
    assert len(raw_sql(Path("work/x.py"), tree)) == 4
    assert raw_sql(Path("store/x.py"), tree) == []


# -- one clock -----------------------------------------------------------------------

#: Modules that may read a clock, and why.
CLOCK_ALLOWED = {
    # The one place that reads the wall clock for the server.
    "core/clock.py",
    # The standalone client's own pacer clocks: the client imports nothing of core.
    "client/pacer.py",
    "client/sync_pacer.py",
}

TIME_READS = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"}


def clock_reads(rel: Path, tree: ast.Module) -> list[str]:
    if str(rel) in CLOCK_ALLOWED:
        return []
    found = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            continue
        attr, owner = n.func.attr, ast.unparse(n.func.value)
        if (
            (attr in TIME_READS and owner == "time")
            or (attr in ("now", "utcnow", "today") and owner.split(".")[-1] in ("datetime", "date"))
            or (
                attr == "time"
                and re.search(r"loop\b|get_running_loop\(\)|get_event_loop\(\)", owner)
            )
        ):
            found.append(f"{rel}:{n.lineno} {ast.unparse(n.func)}()")
    return found


def test_the_clock_rule_fails_on_a_clock_read() -> None:
    tree = ast.parse(
        "import asyncio, time, datetime\n"
        "def f(self, clock):\n"
        "    clock.time()\n"  # the injected clock: allowed
        "    asyncio.get_running_loop().time()\n"
        "    self._loop.time()\n"
        "    time.monotonic()\n"
        "    datetime.datetime.now()\n"
    )
    assert len(clock_reads(Path("work/x.py"), tree)) == 4


# -- the three rules over every module ---------------------------------------------

RULES = {
    "module-level mutable state (hand it in from app.build_service)": registries,
    "SQL belongs in store/, built with SQLAlchemy Core": raw_sql,
    "read time through an injected core.clock.Clock": clock_reads,
}


@pytest.mark.parametrize("rule", RULES, ids=["no registry", "no raw SQL", "one clock"])
def test_every_module_keeps_the_rule(rule: str) -> None:
    found = [hit for rel, tree in _trees() for hit in RULES[rule](rel, tree)]
    assert found == [], f"{rule}: {found}"


# -- the unit tier needs no server ---------------------------------------------------

#: What only the integration and fault tiers may use: the servers and the embedded model.
OUTSIDE_THE_UNIT_TIER = re.compile(
    r"pytest\.mark\.(model|postgres|redis|browser)\b|\b(pg_url|pg_empty_url|pg_database)\b"
)


def test_the_unit_tier_uses_no_server_and_no_model() -> None:
    """``make unit`` runs tests/unit alone, on a machine with no PostgreSQL, Redis or model."""
    here = Path(__file__).resolve()
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "tests" / "unit").rglob("*.py"))
        if p != here
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE_THE_UNIT_TIER.search(line)
    ]
    assert found == [], f"move these to tests/integration: {found}"
