"""``batchyard demo``: what batchyard is for, shown with real calls in under a minute.

It starts a real server on a throwaway SQLite home with the embedded
SmolLM2-135M, makes an organisation, a key and credit, and then shows the
product's point in four steps, each a real request to that server:

1. a price before anything runs: decide's estimate for every comment, counted
   with the model's own tokenizer, nothing charged;
2. decide: two questions about each of five short comments, one call a
   comment, every answer with its calibrated probabilities;
3. a file batch (OpenAI's format) of three requests, submitted and followed
   with ``batchyard batches submit --wait`` and its progress bar, then its
   answers;
4. what it cost: each charge from the activity log, the credit left, and
   ``batchyard audit`` on the ledger.

The comments and prompts are ones a 135M model answers sensibly; the test
(``tests/integration/test_demo.py``) runs the demo and reads what it prints.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.table import Table

from batchyard.core.clock import SystemClock

__all__ = ["COMMENTS", "DECISIONS", "PROMPTS", "demo"]

console = Console()

MODEL = "kettei-core"

#: Five short comments about a pair of earbuds: (id, text).
COMMENTS: tuple[tuple[str, str], ...] = (
    ("c1", "Battery lasted the whole flight. Seriously impressed."),
    ("c2", "Way too expensive for what you get."),
    ("c3", "Arrived a day early and nicely packed."),
    ("c4", "The sound is crisp and clear, I love it."),
    ("c5", "The battery died after two hours. Really disappointing."),
)

#: The two questions asked about every comment, in one call a comment.
DECISIONS: list[dict[str, Any]] = [
    {
        "id": "sentiment",
        "question": "How does the writer feel about the earbuds?",
        "outcomes": [
            {"id": "positive", "description": "pleased"},
            {"id": "negative", "description": "unhappy"},
        ],
    },
    {
        "id": "topic",
        "question": "What is the comment about?",
        "outcomes": [{"id": "battery"}, {"id": "sound"}, {"id": "price"}, {"id": "delivery"}],
    },
]

#: The file batch's requests: (custom_id, prompt).
PROMPTS: tuple[tuple[str, str], ...] = (
    ("battery-tip", "Give one tip to make earbud batteries last longer."),
    ("noise", "What does noise cancelling do? Answer in one sentence."),
    ("bluetooth", "What is Bluetooth? Answer in one sentence."),
)
MAX_TOKENS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _batchyard(*args: str, env: dict[str, str], capture: bool = True) -> str:
    """Run a ``batchyard`` command as a user would; its last line of output."""
    out = subprocess.run(  # noqa: S603 - runs batchyard itself
        [sys.executable, "-m", "batchyard", *args],
        env=env,
        check=False,
        capture_output=capture,
        text=True,
    )
    if out.returncode != 0:
        raise click.ClickException(
            f"batchyard {' '.join(args)} failed: {(out.stderr or '').strip()}"
        )
    text = (out.stdout or "").strip()
    return text.splitlines()[-1] if text else ""


def _probabilities(answer: dict[str, Any]) -> str:
    """``negative 0.93 positive 0.07``: every outcome, the answer first and in bold."""
    (best, p), *rest = sorted(answer["probabilities"].items(), key=lambda kv: -kv[1])
    return f"[bold]{best} {p:.2f}[/] " + " ".join(f"{o} {q:.2f}" for o, q in rest)


def _check(r: httpx.Response) -> Any:
    if r.status_code != 200:
        raise click.ClickException(f"{r.request.url.path} answered {r.status_code}: {r.text}")
    return r.json()


def _wait_ready(client: httpx.Client, server: subprocess.Popen[bytes], log: Path) -> None:
    clock = SystemClock()
    deadline = clock.time() + 300
    while True:
        try:
            if client.get("/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if clock.time() > deadline or server.poll() is not None:
            raise click.ClickException(f"the server did not start: {log.read_text().strip()}")
        time.sleep(0.2)


def _quote(client: httpx.Client) -> None:
    console.rule("1. A price before anything runs")
    total = Decimal(0)
    tokens = once = 0
    for _, text in COMMENTS:
        body = {"model": MODEL, "input": {"text": text}, "decisions": DECISIONS}
        estimate = _check(client.post("/v1/decide/estimate", json=body))
        total += Decimal(estimate["max_cost"])
        once = int(estimate["calibration_input_tokens"])
        tokens += int(estimate["input_tokens"]) - once
    credit = _check(client.get("/v1/account"))["credit"]["available"]
    console.print(
        f"POST /v1/decide/estimate for each of {len(COMMENTS)} comments × {len(DECISIONS)} "
        f"questions: {tokens:,} input tokens, counted with the model's own tokenizer, "
        f"+ {once:,} once for calibration"
    )
    console.print(
        f"at most [bold]${total}[/] in all (each estimate counts calibration, which only the "
        f"first call pays), of ${credit} available; nothing charged yet"
    )


def _decide(client: httpx.Client, labels: dict[str, str]) -> None:
    console.rule("2. Decide: every question about a text in one call")
    console.print(
        "POST /v1/decide, one call a comment: "
        + "; ".join(f"{d['id']}: {d['question']}" for d in DECISIONS)
    )
    table = Table(caption="each answer with its calibrated probabilities, most probable first")
    table.add_column("comment")
    for d in DECISIONS:
        table.add_column(d["id"])
    for comment_id, text in COMMENTS:
        body = {"model": MODEL, "input": {"text": text}, "decisions": DECISIONS}
        r = client.post("/v1/decide", json=body, headers={"Idempotency-Key": f"demo-{comment_id}"})
        answer = _check(r)
        labels[answer["id"]] = f"decide: {text}"
        table.add_row(text, *(_probabilities(a) for a in answer["answers"]))
    console.print(table)


def _batch(home: Path, env: dict[str, str]) -> None:
    console.rule("3. A batch: OpenAI's file format, priced and held before it runs")
    requests = home / "requests.jsonl"
    output = home / "answers.jsonl"
    with requests.open("w", encoding="utf-8") as f:
        for custom_id, prompt in PROMPTS:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps({**line, "body": body}) + "\n")
    console.print(f"$ batchyard batches submit requests.jsonl --wait --output {output.name}")
    console.file.flush()
    # Its own output (the hold, the progress bar, the result) goes straight to the terminal.
    submit = ["batches", "submit", str(requests), "--wait", "--output", str(output)]
    _batchyard(*submit, "--poll", "0.5", env=env, capture=False)
    answers = {}
    for raw in output.read_text(encoding="utf-8").splitlines():
        line = json.loads(raw)
        reply = line["response"]["body"]["choices"][0]["message"]["content"]
        answers[line["custom_id"]] = " ".join(reply.split())
    table = Table(show_lines=True)
    table.add_column("request")
    table.add_column("answer")
    for custom_id, prompt in PROMPTS:
        table.add_row(prompt, answers.get(custom_id, "(no answer)"))
    console.print(table)


def _charges(client: httpx.Client, labels: dict[str, str]) -> None:
    console.rule("4. What it cost: every charge, and a ledger that adds up")
    activity = _check(client.get("/v1/activity", params={"limit": 100}))["data"]
    table = Table()
    table.add_column("charged for")
    table.add_column("tokens in / cached / out", justify="right")
    table.add_column("amount", justify="right")
    total = Decimal(0)
    for item in activity:
        if item["kind"] != "charge":
            continue
        detail = item.get("detail") or {}
        what = labels.get(item["ref"]) or f"{detail.get('purpose', 'call')} {item['ref']}"
        if item["ref"].startswith("bat."):  # a file batch is charged once, for every line
            what = f"the file batch, {len(PROMPTS)} chat requests"
        tokens = (
            f"{detail.get('input_tokens', 0)} / {detail.get('cached_input_tokens', 0)} / "
            f"{detail.get('output_tokens', 0)}"
        )
        table.add_row(what, tokens, f"${item['amount']}")
        total += Decimal(item["amount"])
    console.print(table)
    credit = _check(client.get("/v1/account"))["credit"]
    console.print(
        f"charged ${total} in all; credit ${credit['available']} available, ${credit['held']} held"
    )


@click.command()
@click.option("--keep", is_flag=True, help="Keep the demo's data directory.")
def demo(keep: bool) -> None:
    """Show what batchyard is for, on a throwaway server with the embedded model."""
    clock = SystemClock()
    started = clock.time()
    home = Path(tempfile.mkdtemp(prefix="batchyard-demo-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHYARD_")}
    env["BATCHYARD_HOME"] = str(home)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    console.rule("batchyard demo")
    key = _batchyard("keys", "create", "--org", "demo", "--scope", "full", env=env)
    _batchyard("credit", "add", "--org", "demo", "50", env=env)
    log = home / "serve.log"
    with log.open("wb") as sink:
        server = subprocess.Popen(  # noqa: S603 - runs batchyard itself
            [sys.executable, "-m", "batchyard", "serve", "--port", str(port)],
            env=env,
            stdout=sink,
            stderr=sink,
        )
    try:
        with httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600
        ) as client:
            _wait_ready(client, server, log)
            console.print(
                f"a server at {base} (data in {home}): organisation [bold]demo[/], "
                f"a key, $50 of credit; {MODEL} is SmolLM2-135M-Instruct on this CPU"
            )
            labels: dict[str, str] = {}  # what each charge's ref was
            _quote(client)
            _decide(client, labels)
            _batch(home, {**env, "BATCHYARD_API_KEY": key, "BATCHYARD_BASE_URL": base})
            _charges(client, labels)
    finally:
        server.terminate()
        server.wait(timeout=60)
    audit = subprocess.run(
        [sys.executable, "-m", "batchyard", "audit"], env=env, capture_output=True, text=True
    )
    console.print(f"$ batchyard audit\n{(audit.stderr or audit.stdout).strip()}")
    console.rule(f"done in {clock.time() - started:.0f} s")
    if not keep:
        shutil.rmtree(home, ignore_errors=True)
    if audit.returncode != 0:
        sys.exit(audit.returncode)
