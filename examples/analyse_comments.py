"""Analyse every comment on a post: price it, check it on labelled comments, run it, sum it up.

The advice of docs/how-to/score-texts.md for a long run, end to end, on the comments under a
product launch post (``examples/data/comments.jsonl``) and two decisions,
sentiment and topic (``examples/data/decisions.yaml``):

1. **Estimate** with the free ``/v1/decide/estimate``: tokens a comment and
   the most the whole run can cost, against the credit available.
2. **Check** the model on the comments whose answers are known
   (``examples/data/comments_labels.jsonl``) before trusting it with the rest.
3. **Run** every comment, one request each, at the tier's pace, written to
   an answers file as they arrive (rerunning resumes; nothing is paid twice).
4. **Summarise**: how many comments per outcome of each decision, and the spend.

With no ``--base-url`` it starts its own server as ``batchyard demo`` does (a
temporary ``BATCHYARD_HOME``, SQLite, the embedded SmolLM2 model), creates a
key and buys $50 of credit, which moves the organisation to tier 1::

    python examples/analyse_comments.py                 # its own server
    python examples/analyse_comments.py --limit 10      # a smaller slice
    python examples/analyse_comments.py --base-url http://127.0.0.1:8000 --api-key $KEY

The labelled comments are sent with the same idempotency keys the run uses,
so the run gets their answers back from the check without paying again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from batchyard.cli.check import report_table
from batchyard.client import AsyncClient
from batchyard.client.answers import AnswerFile
from batchyard.client.check import CheckReport, check_models
from batchyard.client.fleet import plan_pace
from batchyard.client.inputs import load_decisions, read_labels, read_texts
from batchyard.client.text_runner import TextRunEstimate, TextRunSummary, estimate_texts, run_texts

DATA = Path(__file__).resolve().parent / "data"
MODEL = "kettei-core"
ORG = "comments"
CREDIT = "50"

console = Console()


# --- a server of its own --------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _batchyard(*args: str, env: dict[str, str]) -> str:
    """Run the ``batchyard`` CLI; the last line it printed (a new key is printed alone)."""
    out = subprocess.run(
        [sys.executable, "-m", "batchyard", *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    lines = (out.stdout.strip() or out.stderr.strip()).splitlines()
    return lines[-1] if lines else ""


@contextlib.contextmanager
def own_server() -> Iterator[tuple[str, str]]:
    """``batchyard serve`` on a free port with a fresh home; yields (base URL, key)."""
    home = Path(tempfile.mkdtemp(prefix="batchyard-comments-"))
    env = {**os.environ, "BATCHYARD_HOME": str(home)}
    env.pop("BATCHYARD_DATABASE_URL", None)
    env.pop("BATCHYARD_CONFIG", None)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    key = _batchyard("keys", "create", "--org", ORG, "--scope", "full", env=env)
    console.print(_batchyard("credit", "add", "--org", ORG, CREDIT, env=env))
    server = subprocess.Popen(
        [sys.executable, "-m", "batchyard", "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the batchyard server did not start")
            time.sleep(0.2)
        console.print(f"server up at {base} (data in {home})")
        yield base, key
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(home, ignore_errors=True)


# --- the analysis ---------------------------------------------------------------------


@dataclass
class Analysis:
    estimate: TextRunEstimate
    check: CheckReport
    run: TextRunSummary
    #: Per decision, how many comments got each outcome.
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    #: What every answer in the file cost, including those answered by the check.
    spend: Decimal = Decimal(0)
    credit_before: Decimal = Decimal(0)
    credit_after: Decimal = Decimal(0)


async def analyse(
    base_url: str,
    api_key: str,
    *,
    comments: Path = DATA / "comments.jsonl",
    labels: Path = DATA / "comments_labels.jsonl",
    decisions_file: Path = DATA / "decisions.yaml",
    output: Path,
    limit: int | None = None,
) -> Analysis:
    decisions = load_decisions(decisions_file)
    items = read_texts(comments)[:limit]
    labelled = read_labels(labels, decisions)[:limit]

    async with AsyncClient(base_url, api_key) as client:
        account = await client.account()
        credit_before = Decimal(account["credit"]["available"])

        # 1. Price it: the free estimate of a sample, scaled to every comment.
        pace = await plan_pace(client)
        estimate, _ = await estimate_texts(client, items, decisions, model=MODEL, pace=pace)
        console.rule("1. estimate")
        console.print(
            f"{estimate.texts} comments, ~{estimate.input_tokens_per_text:.0f} input tokens each; "
            f"at most ${estimate.max_cost} in all, ${estimate.credit_available} available; "
            f"tier {account['tier']}: {pace.rpm:g} requests a minute"
        )

        # 2. Check the model where the answers are known.
        console.rule("2. check on labelled comments")
        report = await check_models(client, labelled, decisions, [MODEL])
        console.print(report_table(report))

        # 3. Run every comment; the labelled ones come back from the check, unpaid.
        console.rule("3. run")
        summary = await run_texts(client, items, decisions, model=MODEL, output=output)
        console.print(
            f"answered {summary.answered} ({summary.already_done} already in {output}), "
            f"failed {summary.failed}, in {summary.elapsed_s:.1f} s"
        )
        account = await client.account()
        credit_after = Decimal(account["credit"]["available"])

    # 4. Summarise from the answers file: the record that survives a crash.
    answers = AnswerFile(output).read_answers()
    counts: dict[str, Counter[str]] = {d["id"]: Counter() for d in decisions}
    spend = Decimal(0)
    for row in answers.values():
        for answer in row["answers"]:
            counts[answer["decision"]][answer["outcome"]] += 1
        spend += Decimal(str(row["charge"]))
    return Analysis(estimate, report, summary, counts, spend, credit_before, credit_after)


def summary_table(analysis: Analysis, decisions: Sequence[dict[str, object]]) -> Table:
    table = Table(title="Comments per outcome")
    table.add_column("decision")
    table.add_column("outcome")
    table.add_column("comments", justify="right")
    table.add_column("share", justify="right")
    for decision in decisions:
        did = str(decision["id"])
        counts = analysis.counts.get(did, Counter())
        total = sum(counts.values()) or 1
        for n, (outcome, count) in enumerate(counts.most_common()):
            table.add_row(did if n == 0 else "", outcome, str(count), f"{count / total:.0%}")
        table.add_section()
    return table


def main(argv: Sequence[str] | None = None) -> Analysis:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running gateway (default: start one)")
    parser.add_argument("--api-key", default=os.environ.get("BATCHYARD_API_KEY"))
    parser.add_argument("--limit", type=int, help="only the first N comments and labels")
    parser.add_argument(
        "--output", type=Path, help="answers JSONL (default: a new file in a temp directory)"
    )
    args = parser.parse_args(argv)
    output = args.output or Path(tempfile.mkdtemp(prefix="comments-")) / "answers.jsonl"
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.base_url:
            if not args.api_key:
                parser.error("--base-url needs --api-key (or BATCHYARD_API_KEY)")
            base, key = args.base_url, args.api_key
        else:
            base, key = stack.enter_context(own_server())
        analysis = asyncio.run(analyse(base, key, output=output, limit=args.limit))
    console.rule("4. summary")
    decisions = load_decisions(DATA / "decisions.yaml")
    console.print(summary_table(analysis, [dict(d) for d in decisions]))
    console.print(
        f"spend: ${analysis.spend} for {sum(analysis.counts[decisions[0]['id']].values())} "
        f"comments (credit ${analysis.credit_before} -> ${analysis.credit_after}); "
        f"answers in {output}; {time.monotonic() - started:.0f} s in all"
    )
    return analysis


if __name__ == "__main__":
    main()
