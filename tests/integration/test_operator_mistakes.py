"""Operator mistakes, as an operator makes them: real ``batchyard`` processes.

Each broken config (or environment variable) must stop ``serve``, ``worker``
and ``audit`` with a non-zero status and exactly one line on stderr that names
where the value came from and the field, never a traceback (issue 22, items
11 to 14). A lost or wrong batch key is refused before anything reads sealed
data, and never replaced by a new key; a clean SIGTERM drain of ``serve``
exits 0.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.processes import wait_healthy
from tests.support.server import free_port
from tests.support.waits import HANG_S

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))
COMMANDS = ("serve", "worker", "audit")
EX_CONFIG = 78

# (case, file name, file text, what the one line must name)
BROKEN_FILES: list[tuple[str, str, str, str]] = [
    ("yaml syntax", "config.yaml", "routes: [\n  - id: a\n", "not valid YAML at line"),
    ("toml syntax", "config.toml", "routes = [ {id = 'a' \n", "not valid TOML"),
    ("not a mapping", "config.yaml", "- a\n- b\n", "not settings"),
    ("routes: 5", "config.yaml", "routes: 5\n", "routes: expected a list"),
    (
        "unknown engine",
        "config.yaml",
        "routes:\n  - {id: a, model: kettei-core, engine: warp_drive, base_url: http://x}\n",
        "routes[0].engine: unknown engine 'warp_drive' (known: llama_cpp, openai_http, memory)",
    ),
    (
        "route names an unknown model",
        "config.yaml",
        "routes:\n  - {id: a, model: kettei-huge, engine: memory}\n",
        "routes[0].model: unknown model 'kettei-huge'",
    ),
    (
        "requests_per_minute: x",
        "config.yaml",
        "tiers:\n  - {level: 0, requests_per_minute: x, tokens_per_minute: 40000}\n",
        "tiers[0].requests_per_minute: expected a whole number, got 'x'",
    ),
    (
        "route without its id",
        "config.yaml",
        "routes:\n  - {model: kettei-core, engine: memory}\n",
        "routes[0].id: required",
    ),
    (
        "openai_http route without base_url",
        "config.yaml",
        "routes:\n  - {id: a, model: kettei-core, engine: openai_http}\n",
        "routes[0].base_url",
    ),
    (
        "fallback to an unknown route",
        "config.yaml",
        "routes:\n  - {id: a, model: kettei-core, engine: memory, fallbacks: [b]}\n",
        "routes[0].fallbacks[0]: falls back to unknown route 'b'",
    ),
    (
        "a route listed twice",
        "config.yaml",
        "routes:\n  - {id: a, model: kettei-core, engine: memory}\n"
        "  - {id: a, model: kettei-core, engine: memory}\n",
        "routes[1].id: route 'a' is listed twice",
    ),
    (
        "a misspelt setting",
        "config.yaml",
        "shutdown_grace: 5\n",
        "shutdown_grace: is not a setting batchyard knows — did you mean 'shutdown_grace_s'?",
    ),
    ("a number that is not", "config.yaml", "market_interval_s: soon\n", "market_interval_s"),
    (
        "a negative price",
        "config.yaml",
        "models:\n  - {id: m, input_per_mtok: '-1', output_per_mtok: 1}\n",
        "models[0].input_per_mtok: must be at least 0",
    ),
    (
        "a new model without its price",
        "config.yaml",
        "models:\n  - {id: m, context_window: 4096}\n",
        "models[0].input_per_mtok: a new model ('m') needs its price",
    ),
    (
        "tiers out of order",
        "config.yaml",
        "tiers:\n  - {level: 1, requests_per_minute: 30, tokens_per_minute: 40000}\n",
        "tiers[0].level",
    ),
    ("unknown market policy", "config.yaml", "market_policy: cheapest\n", "market_policy"),
    ("unknown limiter", "config.yaml", "limiter_url: mysql://db\n", "limiter_url: unknown limiter"),
    (
        "a database batchyard cannot use",
        "config.yaml",
        "database_url: mysql://db/batchyard\n",
        "database_url",
    ),
    (
        "a batch key that is not base64",
        "config.yaml",
        "batch_encryption_key: not*base64!\n",
        "batch_encryption_key: the batch encryption key is not valid base64",
    ),
    (
        "a batch key that is not 32 bytes",
        "config.yaml",
        f"batch_encryption_key: {base64.b64encode(b'short').decode()}\n",
        "batch_encryption_key: the batch encryption key must decode to 32 bytes, not 5",
    ),
    ("embedded_slots out of range", "config.yaml", "embedded_slots: 0\n", "embedded_slots"),
    (
        "embedded_contexts (the old name) out of range",
        "config.yaml",
        "embedded_contexts: 1000\n",
        "embedded_contexts: must be at most 256",
    ),
    ("embedded_n_ctx too small", "config.yaml", "embedded_n_ctx: 64\n", "embedded_n_ctx"),
    (
        "a cache smaller than one sequence",
        "config.yaml",
        "embedded_n_ctx: 4096\nembedded_cache_tokens: 1024\n",
        "embedded_cache_tokens: is 1024, less than one sequence",
    ),
    ("runs section typo", "config.yaml", "runs: {lease_s: x}\n", "runs.lease_s"),
    (
        "privacy_default unknown",
        "config.yaml",
        "privacy_default: hide\n",
        "privacy_default: unknown privacy mode",
    ),
]

# (case, variable, value, what the one line must name)
BROKEN_ENV: list[tuple[str, str, str, str]] = [
    (
        "grace that is not a number",
        "BATCHYARD_SHUTDOWN_GRACE_S",
        "soon",
        "environment variable BATCHYARD_SHUTDOWN_GRACE_S: shutdown_grace_s: expected a number",
    ),
    (
        "slots out of range",
        "BATCHYARD_EMBEDDED_SLOTS",
        "0",
        "environment variable BATCHYARD_EMBEDDED_SLOTS: embedded_slots: must be at least 1",
    ),
    (
        "a key of the wrong length",
        "BATCHYARD_BATCH_ENCRYPTION_KEY",
        base64.b64encode(b"x" * 16).decode(),
        "environment variable BATCHYARD_BATCH_ENCRYPTION_KEY: batch_encryption_key",
    ),
    (
        "a config file that does not exist",
        "BATCHYARD_CONFIG",
        "/nonexistent/batchyard.yaml",
        "/nonexistent/batchyard.yaml: the config file does not exist",
    ),
]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHYARD_")}
    env["BATCHYARD_HOME"] = str(tmp / "home")
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BATCHYARD, *args], env=env, capture_output=True, text=True, timeout=HANG_S, check=False
    )


def _refused(out: subprocess.CompletedProcess[str], *names: str, code: int = EX_CONFIG) -> str:
    """The one stderr line of a refusal, checked: status, no traceback, the names."""
    lines = out.stderr.splitlines()
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == code, (out.returncode, out.stderr)
    assert len(lines) == 1, out.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("case", "name", "text", "expected"), BROKEN_FILES, ids=[c[0] for c in BROKEN_FILES]
)
def test_a_broken_config_file_is_one_line_naming_the_file_and_field(
    tmp_path, command, case, name, text, expected
):
    config = tmp_path / name
    config.write_text(text, encoding="utf-8")
    db = f"sqlite:///{tmp_path / 'by.db'}"
    out = _run([command, "--config", str(config), "--database", db], _env(tmp_path))
    line = _refused(out, f"config error in {config}", expected)
    assert line.startswith("batchyard: config error in ")
    assert " — " in line  # and the fix
    assert not (tmp_path / "batch.key").exists()  # refused before anything was made


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("case", "variable", "value", "expected"), BROKEN_ENV, ids=[c[0] for c in BROKEN_ENV]
)
def test_a_broken_environment_variable_is_one_line_naming_it(
    tmp_path, command, case, variable, value, expected
):
    db = f"sqlite:///{tmp_path / 'by.db'}"
    out = _run([command, "--database", db], _env(tmp_path, **{variable: value}))
    _refused(out, expected)


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_route_whose_key_variable_is_unset_is_refused_at_start(tmp_path, command):
    config = tmp_path / "config.yaml"
    config.write_text(
        "routes:\n  - id: remote\n    model: kettei-core\n    base_url: http://127.0.0.1:9/v1\n"
        "    api_key_env: BY_TEST_UNSET_KEY\n",
        encoding="utf-8",
    )
    db = f"sqlite:///{tmp_path / 'by.db'}"
    out = _run([command, "--config", str(config), "--database", db], _env(tmp_path))
    _refused(out, str(config), "routes[0].api_key_env", "BY_TEST_UNSET_KEY is not set")


# --- the batch key -------------------------------------------------------------------------


def _serve(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [BATCHYARD, "serve", "--port", str(port), "--log-level", "warning", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, output=lambda: str(proc.communicate()))
    return proc, base


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_a_lost_or_wrong_batch_key_is_refused_and_never_replaced(tmp_path):
    """Sealed data in the store, then the key goes: serve, worker and audit refuse to start."""
    folder = tmp_path / "data"
    db = f"sqlite:///{folder / 'by.db'}"
    key_file = folder / "batch.key"
    config = tmp_path / "config.yaml"
    # The scripted engine: a real chat call whose answer is saved (sealed) under its key.
    config.write_text(
        "routes:\n  - {id: scripted, model: kettei-core, engine: memory}\n", encoding="utf-8"
    )
    env = _env(tmp_path)
    common = ["--config", str(config), "--database", db]
    made = _run(["keys", "create", "--org", "acme", *common], env)
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip().splitlines()[-1]
    assert _run(["credit", "add", "--org", "acme", "5", *common], env).returncode == 0

    proc, base = _serve(common, env)
    try:
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "kettei-core", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {secret}", "Idempotency-Key": "k-1"},
            timeout=HANG_S,
        )
        assert r.status_code == 200, r.text
    finally:
        code, err = _stop(proc)
    # Item 14: a clean SIGTERM drain is a clean exit.
    assert code == 0, err
    assert "Traceback" not in err, err
    assert key_file.is_file()
    good = key_file.read_text(encoding="ascii")
    assert _run(["audit", *common], env).returncode == 0

    key_file.unlink()
    for command in COMMANDS:
        out = _run([command, *common], env)
        _refused(out, str(key_file), "sealed data")
        assert not key_file.exists(), f"{command} made a new key over sealed data"

    key_file.write_text(base64.b64encode(os.urandom(32)).decode() + "\n", encoding="ascii")
    for command in COMMANDS:
        out = _run([command, *common], env)
        _refused(out, str(key_file), "is not the one this database's data is sealed with")

    other = base64.b64encode(os.urandom(32)).decode()
    out = _run(["worker", *common], {**env, "BATCHYARD_BATCH_ENCRYPTION_KEY": other})
    _refused(out, "environment variable BATCHYARD_BATCH_ENCRYPTION_KEY", "is not the one")

    key_file.write_text("not a key\n", encoding="ascii")
    out = _run(["serve", *common], env)
    _refused(out, str(key_file), "the key file cannot be used")

    key_file.write_text(good, encoding="ascii")
    audited = _run(["audit", *common], env)
    assert audited.returncode == 0, audited.stderr
    proc, base = _serve(common, env)
    try:
        again = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "kettei-core", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {secret}", "Idempotency-Key": "k-1"},
            timeout=HANG_S,
        )
        assert again.status_code == 200, again.text  # the sealed answer opens again
        assert again.json() == r.json()
    finally:
        code, err = _stop(proc)
    assert code == 0, err


PG_ADMIN = os.environ.get(
    "BATCHYARD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture
def read_only_postgres(tmp_path):
    """A PostgreSQL database made by batchyard, then turned read-only (every write: 25006)."""
    from sqlalchemy import create_engine, text

    name = f"by_test_ro_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"postgresql://postgres@127.0.0.1:5432/{name}"

    def read_only() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))

    try:
        yield url, read_only
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_audit_on_a_read_only_database_speaks_to_the_operator(tmp_path, read_only_postgres):
    """Not the API's "send it again with the same Idempotency-Key": the cause and the fix."""
    from sqlalchemy import create_engine, text

    from batchyard.core.config import normalise_database_url

    url, read_only = read_only_postgres
    env = _env(tmp_path)
    assert _run(["keys", "create", "--org", "acme", "--database", url], env).returncode == 0
    read_only()
    # At the current schema the audit only reads: it runs on a read-only copy.
    fine = _run(["audit", "--database", url], env)
    assert fine.returncode == 0, fine.stderr
    # Behind the code (here: no migration applied), it must write first, and cannot: one
    # line for the operator.
    engine = create_engine(normalise_database_url(url))
    with engine.begin() as conn:
        conn.execute(text("SET TRANSACTION READ WRITE"))
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    out = _run(["audit", "--database", url], env)
    line = _refused(out, "the database cannot be used", "read-only", code=1)
    assert "Idempotency-Key" not in line
    assert "writable" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_database_another_batchyard_migrated_is_one_line_naming_it_and_the_fix(tmp_path, command):
    """A revision this code does not know (a newer release's, or one folded into 0.1.0's)."""
    import sqlite3

    env = _env(tmp_path)
    assert _run(["keys", "create", "--org", "acme"], env).returncode == 0
    path = tmp_path / "home" / "batchyard.db"
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0017'")
    out = _run([command], env)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == EX_CONFIG, (out.returncode, out.stderr)
    # serve and worker log the batch key they made first, as JSON; then the one line.
    (line,) = [ln for ln in out.stderr.splitlines() if not ln.startswith("{")]
    for name in ("revision 0017", "does not know", f"move {path} aside", "that migrated it"):
        assert name in line, (name, line)
