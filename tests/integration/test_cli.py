"""The operator commands as documented (docs/how-to/operate.md), run as real subprocesses."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.waits import HANG_S

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))


@pytest.fixture
def cli(tmp_path):
    db_file = tmp_path / "ops.db"
    env = {
        **os.environ,
        "BATCHYARD_DATABASE_URL": f"sqlite:///{db_file}",
        "BATCHYARD_HOME": str(tmp_path / "home"),
    }
    env.pop("BATCHYARD_CONFIG", None)

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [BATCHYARD, *args], env=env, capture_output=True, text=True, timeout=HANG_S
        )
        if ok:
            assert out.returncode == 0, (args, out.stdout, out.stderr)
        return out

    run.db_file = db_file
    return run


def test_keys_credit_and_audit_as_an_operator_runs_them(cli):
    created = cli("keys", "create", "--org", "acme", "--scope", "full")
    key = created.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"by_[A-Za-z0-9_-]{43}", key), created.stdout
    assert (
        created.stdout.strip() == key
    )  # the key alone on stdout: `KEY=$(batchyard keys create …)`
    key_id = re.search(r"key\.[0-9a-f-]{36}", created.stderr).group(0)
    read_key = cli("keys", "create", "--org", "acme", "--scope", "read").stdout.strip()

    listed = cli("keys", "list", "--org", "acme").stdout
    assert key_id in listed
    assert "full" in listed and "read" in listed
    assert key not in listed and read_key not in listed
    assert key[-4:] in listed  # the display form: prefix…last four

    revoked = cli("keys", "revoke", key_id)
    assert key_id in revoked.stderr
    listed = cli("keys", "list", "--org", "acme").stdout
    row = next(line for line in listed.splitlines() if key_id in line)
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d\s*│\s*$", row), row  # revoked at

    added = cli("credit", "add", "--org", "acme", "60")
    assert "added $60" in added.stderr and "tier 1" in added.stderr
    auto = cli("credit", "auto-topup", "--org", "acme", "--threshold", "1", "--amount", "5")
    assert "$5" in auto.stderr and "$1" in auto.stderr

    with sqlite3.connect(cli.db_file) as conn:
        (tier, threshold, amount) = conn.execute(
            "SELECT tier, auto_topup_threshold, auto_topup_amount FROM organisations"
        ).fetchone()
        assert (tier, threshold, amount) == (1, 10**10, 5 * 10**10)
        hashes = [r[0] for r in conn.execute("SELECT key_hash FROM api_keys")]
        assert key not in hashes and len(hashes) == 2

    audit = cli("audit")
    assert "ledger sound" in audit.stderr

    with sqlite3.connect(cli.db_file) as conn:
        conn.execute("UPDATE balances SET topups = topups + 1")
    broken = cli("audit", ok=False)
    assert broken.returncode == 1
    assert "cached balance" in broken.stderr and "broken" in broken.stderr


def test_mistakes_are_refused_with_a_message(cli):
    no_org = cli("credit", "add", "--org", "nobody", "5", ok=False)
    assert no_org.returncode != 0 and "no organisation called 'nobody'" in no_org.stderr
    cli("keys", "create", "--org", "acme")
    for amount in ("-5", "0", "lots"):
        bad = cli("credit", "add", "--org", "acme", amount, ok=False)
        assert bad.returncode == 2, (amount, bad.stderr)
    unknown = cli("keys", "revoke", "key.nope", ok=False)
    assert unknown.returncode == 1 and "not found" in unknown.stderr
    scope = cli("keys", "create", "--org", "acme", "--scope", "admin", ok=False)
    assert scope.returncode == 2
