"""``batchyard demo``: the whole first hour of a newcomer, in one command.

It starts a real server on a fresh SQLite file with the embedded model,
creates an organisation and a key, adds credit, asks for a real completion
from SmolLM2, and prints it with its charge and the ledger audit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import httpx
from rich.console import Console
from rich.panel import Panel

from batchyard.core.clock import SystemClock

__all__ = ["demo"]

console = Console()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cli(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run(  # noqa: S603 - runs batchyard itself
        [sys.executable, "-m", "batchyard", *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


@click.command()
@click.option("--prompt", default="Name three uses for a paperclip, briefly.", show_default=True)
@click.option("--keep", is_flag=True, help="Keep the demo's data directory.")
def demo(prompt: str, keep: bool) -> None:
    """Serve, create a key, add credit, and get a real completion from the embedded model."""
    home = Path(tempfile.mkdtemp(prefix="batchyard-demo-"))
    env = {**os.environ, "BATCHYARD_HOME": str(home)}
    env.pop("BATCHYARD_DATABASE_URL", None)
    env.pop("BATCHYARD_CONFIG", None)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    console.rule("batchyard demo")
    console.print(f"data in {home}")
    key = _cli("keys", "create", "--org", "demo", "--scope", "full", env=env)
    console.print("✓ created organisation [bold]demo[/] and a full-scope key")
    _cli("credit", "add", "--org", "demo", "5", env=env)
    console.print("✓ added $5 of credit")
    server = subprocess.Popen(  # noqa: S603 - runs batchyard itself
        [sys.executable, "-m", "batchyard", "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
    )
    try:
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base, headers=headers, timeout=300) as client:
            clock = SystemClock()
            deadline = clock.time() + 120
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if clock.time() > deadline or server.poll() is not None:
                    raise click.ClickException("the server did not start")
                time.sleep(0.2)
            console.print(f"✓ server up at {base}")
            started = clock.time()
            r = client.post(
                "/v1/chat/completions",
                json={
                    "model": "kettei-core",
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 64,
                    "temperature": 0,
                },
                headers={"Idempotency-Key": "demo-chat-1"},
            )
            if r.status_code != 200:
                raise click.ClickException(f"completion failed: {r.status_code} {r.text}")
            body = r.json()
            elapsed = clock.time() - started
            console.print(
                Panel(
                    body["choices"][0]["message"]["content"].strip(),
                    title=f"kettei-core (SmolLM2-135M-Instruct) · {elapsed:.1f}s",
                )
            )
            usage = body["usage"]
            console.print(
                f"usage: {usage['prompt_tokens']} input + "
                f"{usage['completion_tokens']} output tokens"
            )
            console.print(f"charge: [bold]${body['charge']}[/]")
            account = client.get("/v1/account").json()
            credit = account["credit"]
            console.print(
                f"credit: available ${credit['available']} (held ${credit['held']}); "
                f"tier {account['tier']}: {account['effective_limits']['requests_per_minute']} "
                "requests a minute"
            )
    finally:
        server.terminate()
        server.wait(timeout=30)
    audit = subprocess.run(
        [sys.executable, "-m", "batchyard", "audit"], env=env, capture_output=True, text=True
    )
    console.print(audit.stderr.strip() or audit.stdout.strip())
    if not keep:
        import shutil

        shutil.rmtree(home, ignore_errors=True)
    if audit.returncode != 0:
        sys.exit(audit.returncode)
