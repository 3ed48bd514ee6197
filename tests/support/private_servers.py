"""A PostgreSQL cluster and a Redis server of the test's own, to stop and start at will.

The shared servers on 5432 and 6379 serve every engineer's tests at once, so an
outage test never touches them: it starts its own. ``PrivatePostgres`` runs
``initdb`` into a temporary directory owned by the ``postgres`` OS user (the
server refuses to run as root), then ``pg_ctl`` on a free loopback port with
its socket in that directory; ``PrivateRedis`` runs ``redis-server`` on a free
port with no persistence. Both stop and start again on the same port, so a
client's URL stays valid across the outage. The fixtures (in
tests/faults/conftest.py) are session-scoped, since ``initdb`` costs a couple
of seconds, and each test leaves its server running.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.support.server import free_port
from tests.support.waits import HANG_S

__all__ = ["PrivatePostgres", "PrivateRedis"]

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PrivatePostgres:
    """A throwaway PostgreSQL cluster: ``start``, ``stop``, ``restart``, ``new_database``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="batchyard-pg-"))
        self.data = self.root / "data"
        self.logfile = self.root / "server.log"
        self._user = pwd.getpwnam("postgres")
        os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self._as_postgres(
            str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
            "--no-sync", "--no-instructions",
        )  # fmt: skip

    def _as_postgres(self, *argv: str) -> None:
        result = subprocess.run(
            ["runuser", "-u", "postgres", "--", *argv],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {result.stdout}{result.stderr}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c full_page_writes=off"
        )
        self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.logfile),
            "-o", options, "-w", "-t", f"{HANG_S:.0f}", "start",
        )  # fmt: skip

    def stop(self) -> None:
        """A fast shutdown: open connections are cut, as in a real outage."""
        self._as_postgres(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast",
            "-w", "-t", f"{HANG_S:.0f}", "stop",
        )  # fmt: skip

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def new_database(self) -> str:
        """An empty database of its own for one test; its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        admin = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as c:
                c.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()
        return self.url(name)

    def close(self) -> None:
        if self.running:
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateRedis:
    """A throwaway ``redis-server`` on a free port, no persistence: ``start``, ``stop``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="batchyard-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.root),
            ],
            stdout=(self.root / "server.log").open("ab"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + HANG_S
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(HANG_S)
        self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
