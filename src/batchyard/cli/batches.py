"""``batchyard batches``: submit a JSONL batch file and follow it, list, get, cancel, download.

These talk to a running gateway over HTTP, as any client would (the OpenAI
Files and Batches endpoints): ``submit`` uploads the file, creates the batch
and, with ``--wait``, follows it with a progress bar (answered, failed,
spend, time left) until it ends, then writes its output and error files.
The same file runs unchanged on OpenAI's Batch API and on ``vllm run_batch``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from batchyard.cli.text_runner import client_options
from batchyard.client.retries import Call, ClientSettings, error_from_response
from batchyard.errors import BatchyardError

__all__ = ["batches"]

FINAL = ("completed", "failed", "expired", "cancelled", "canceled")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class _Gateway:
    """A small synchronous client over the Files and Batches endpoints."""

    def __init__(self, base_url: str | None, api_key: str | None) -> None:
        self.settings = ClientSettings.resolve(base_url, api_key, 300.0)
        self.http = httpx.Client(base_url=self.settings.base_url, timeout=300.0)

    def _headers(self) -> dict[str, str]:
        return self.settings.headers(Call("GET", "/"))

    def _check(self, r: httpx.Response) -> httpx.Response:
        if r.status_code >= 400:
            raise error_from_response(r)
        return r

    def get(self, path: str, **params: Any) -> Any:
        return self._check(self.http.get(path, headers=self._headers(), params=params)).json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._check(self.http.post(path, headers=self._headers(), json=body)).json()

    def upload(self, path: Path) -> Any:
        with path.open("rb") as f:
            r = self.http.post(
                "/v1/files",
                headers=self._headers(),
                data={"purpose": "batch"},
                files={"file": (path.name, f, "application/jsonl")},
            )
        return self._check(r).json()

    def download(self, path: str, to: Path) -> int:
        size = 0
        with self.http.stream("GET", path, headers=self._headers()) as r:
            if r.status_code >= 400:
                r.read()
                raise error_from_response(r)
            with to.open("wb") as out:
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    out.write(chunk)
        return size


def _fail(exc: BatchyardError) -> click.ClickException:
    return click.ClickException(f"{exc.code}: {exc.message}")


def _counts(batch: dict[str, Any]) -> tuple[int, int, int]:
    c = batch["request_counts"]
    ended = sum(c.get(k, 0) for k in ("succeeded", "failed", "expired", "canceled", "uncertain"))
    return int(c["total"]), ended, ended - int(c.get("succeeded", 0))


def _follow(gw: _Gateway, batch: dict[str, Any], console: Console, poll_s: float) -> dict[str, Any]:
    """Poll until the batch ends, with a progress bar: answered, failed, spend, time left."""
    total, ended, failed = _counts(batch)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TextColumn("spend ${task.fields[spend]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(
            batch["id"], total=total, completed=ended, failed=failed, spend=batch.get("charge")
        )
        while batch["status"] not in FINAL:
            time.sleep(poll_s)
            batch = gw.get(f"/v1/batches/{batch['id']}")
            total, ended, failed = _counts(batch)
            progress.update(task, completed=ended, failed=failed, spend=batch.get("charge"))
    return batch


def _save(gw: _Gateway, batch: dict[str, Any], output: Path, errors: Path | None) -> list[str]:
    saved = []
    if batch.get("dialect") == "deferred":
        gw.download(f"/v1/batches/{batch['id']}/results", output)
        return [str(output)]
    if batch.get("output_file_id"):
        gw.download(f"/v1/files/{batch['output_file_id']}/content", output)
        saved.append(str(output))
    if batch.get("error_file_id"):
        target = errors or output.with_name(output.stem + ".errors.jsonl")
        gw.download(f"/v1/files/{batch['error_file_id']}/content", target)
        saved.append(str(target))
    return saved


@click.group()
def batches() -> None:
    """Batch files in OpenAI's JSONL format: submit, follow, list, get, cancel, download."""


@batches.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--endpoint",
    type=click.Choice(ENDPOINTS),
    help="The endpoint every line names (default: read from the file's first line).",
)
@click.option(
    "--window",
    type=click.Choice(["1h", "6h", "24h", "48h", "72h", "168h"]),
    default="24h",
    show_default=True,
    help="Longer than 24h: the lines wait for a lower price until 24h are left.",
)
@click.option("--min-discount", type=click.FloatRange(0, 100), help="Wait for this % off.")
@click.option("--wait", is_flag=True, help="Follow the batch with a progress bar until it ends.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="With --wait.")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), help="With --wait.")
@click.option("--poll", "poll_s", type=float, default=2.0, show_default=True, hidden=True)
@client_options
def submit(
    file: Path,
    endpoint: str | None,
    window: str,
    min_discount: float | None,
    wait: bool,
    output: Path | None,
    errors: Path | None,
    poll_s: float,
    base_url: str | None,
    api_key: str | None,
) -> None:
    """Upload FILE (one request a line) and create a batch over it."""
    if output is not None and not wait:
        raise click.UsageError("--output needs --wait")
    console = Console()
    gw = _Gateway(base_url, api_key)
    if endpoint is None:
        with file.open("rb") as f:
            first = next((ln for ln in f if ln.strip()), b"{}")
        try:
            endpoint = str(json.loads(first).get("url") or ENDPOINTS[0])
        except (ValueError, AttributeError):
            endpoint = ENDPOINTS[0]
    try:
        uploaded = gw.upload(file)
        body: dict[str, Any] = {
            "input_file_id": uploaded["id"],
            "endpoint": endpoint,
            "completion_window": window,
        }
        if min_discount is not None:
            body["metadata"] = {"min_discount": f"{min_discount:g}"}
        batch = gw.post("/v1/batches", body)
    except BatchyardError as exc:
        raise _fail(exc) from None
    console.print(
        f"{batch['id']}: {batch['status']}, {batch['request_counts']['total']} requests, "
        f"at most ${batch.get('max_cost')} held"
    )
    if batch["status"] == "failed":
        for err in (batch.get("errors") or {}).get("data", []):
            console.print(f"[red]{err.get('code')}[/red]: {err.get('message')}")
        raise SystemExit(1)
    if not wait:
        return
    try:
        batch = _follow(gw, batch, console, poll_s)
        total, ended, failed = _counts(batch)
        console.print(
            f"{batch['id']}: {batch['status']}, {ended - failed}/{total} answered, "
            f"{failed} failed, charged ${batch.get('charge')}"
        )
        if output is not None:
            for path in _save(gw, batch, output, errors):
                console.print(f"wrote {path}")
    except BatchyardError as exc:
        raise _fail(exc) from None
    if batch["status"] != "completed":
        raise SystemExit(1)


@batches.command("list")
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True)
@click.option("--after", help="The last ID of the previous page.")
@client_options
def list_(limit: int, after: str | None, base_url: str | None, api_key: str | None) -> None:
    """The newest batches of both dialects."""
    params: dict[str, Any] = {"limit": limit}
    if after:
        params["after"] = after
    try:
        page = _Gateway(base_url, api_key).get("/v1/batches", **params)
    except BatchyardError as exc:
        raise _fail(exc) from None
    table = Table("id", "dialect", "status", "done", "failed", "total", "charge")
    for b in page["data"]:
        total, ended, failed = _counts(b)
        table.add_row(
            b["id"],
            b.get("dialect", ""),
            b["status"],
            str(ended),
            str(failed),
            str(total),
            str(b.get("charge") or ""),
        )
    Console().print(table)


@batches.command()
@click.argument("batch_id")
@client_options
def get(batch_id: str, base_url: str | None, api_key: str | None) -> None:
    """One batch as JSON."""
    try:
        click.echo(json.dumps(_Gateway(base_url, api_key).get(f"/v1/batches/{batch_id}"), indent=2))
    except BatchyardError as exc:
        raise _fail(exc) from None


@batches.command()
@click.argument("batch_id")
@client_options
def cancel(batch_id: str, base_url: str | None, api_key: str | None) -> None:
    """Stop a batch: requests not yet sent are cancelled."""
    try:
        batch = _Gateway(base_url, api_key).post(f"/v1/batches/{batch_id}/cancel")
    except BatchyardError as exc:
        raise _fail(exc) from None
    click.echo(f"{batch['id']}: {batch['status']}")


@batches.command()
@click.argument("batch_id")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where the answers go (JSONL).",
)
@click.option(
    "--errors",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where the error lines go (default: OUTPUT.errors.jsonl).",
)
@client_options
def download(
    batch_id: str, output: Path, errors: Path | None, base_url: str | None, api_key: str | None
) -> None:
    """Write a batch's output and error files (a deferred batch: its NDJSON results)."""
    gw = _Gateway(base_url, api_key)
    try:
        batch = gw.get(f"/v1/batches/{batch_id}")
        saved = _save(gw, batch, output, errors)
    except BatchyardError as exc:
        raise _fail(exc) from None
    for path in saved:
        click.echo(f"wrote {path}")
