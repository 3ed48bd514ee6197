"""``batchyard run``: answer the same decisions for every text of a file.

A thin shell over ``batchyard.client.text_runner.run_texts``: it reads the files,
shows the estimate, a progress bar and a summary, and turns the runner's
refusals into one message and a non-zero exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from batchyard.client.async_client import AsyncClient
from batchyard.client.fleet import TextRunAborted
from batchyard.client.inputs import InputError, load_decisions, read_texts
from batchyard.client.text_runner import (
    TextRunEstimate,
    TextRunObserver,
    TextRunRefused,
    TextRunSummary,
    run_texts,
)
from batchyard.errors import BatchyardError

__all__ = ["client_options", "command", "duration"]

F = TypeVar("F", bound=Callable[..., Any])


def client_options(fn: F) -> F:
    """Where the gateway is and the key to use; shared with ``batchyard check``."""
    fn = click.option(
        "--api-key",
        envvar="BATCHYARD_API_KEY",
        help="API key. Env: BATCHYARD_API_KEY.",
        show_envvar=False,
    )(fn)
    fn = click.option(
        "--base-url",
        envvar="BATCHYARD_BASE_URL",
        help="Gateway URL (default http://127.0.0.1:8000). Env: BATCHYARD_BASE_URL.",
    )(fn)
    return fn


def pace_options(fn: F) -> F:
    fn = click.option(
        "--max-output-tokens", default=64, show_default=True, type=click.IntRange(min=1)
    )(fn)
    fn = click.option("--key-suffix", help="Version appended to every idempotency key (v2).")(fn)
    fn = click.option(
        "--concurrency", type=click.IntRange(min=1), help="Requests in flight at once."
    )(fn)
    fn = click.option(
        "--rpm",
        type=click.FloatRange(min=0, min_open=True),
        help="Requests a minute (default: the account's limit).",
    )(fn)
    return fn


def duration(seconds: float) -> str:
    s = round(seconds)
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
    )


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed * 60:,.0f}/min" if speed else "-/min")


class RichProgress(TextRunObserver):
    """The estimate, then a live bar: done, failed, skipped, rate, spend, time left."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self._task: Any = None
        self.done = self.failed = 0
        self.spend = 0.0  # display only; the summary's Decimal is the real figure

    def planned(self, estimate: TextRunEstimate, summary: TextRunSummary) -> None:
        c = self.console
        skipped = summary.already_done + summary.skipped_failed
        print_plan(c, estimate, summary)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "done {task.fields[done]} failed {task.fields[failed]} skipped " + str(skipped)
            ),
            _RateColumn(),
            TextColumn("${task.fields[spend]:.4f}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=c,
        )
        self.progress.start()
        self._task = self.progress.add_task(
            "run", total=estimate.texts, done=0, failed=0, spend=0.0
        )

    def result(
        self, item_id: str, answer: dict[str, Any] | None, error: BatchyardError | None
    ) -> None:
        if answer is not None:
            self.done += 1
            self.spend += float(answer.get("charge") or 0)
        else:
            self.failed += 1
        if self.progress is not None:
            self.progress.update(
                self._task, advance=1, done=self.done, failed=self.failed, spend=self.spend
            )

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def print_plan(c: Console, estimate: TextRunEstimate, summary: TextRunSummary) -> None:
    """What a run will send, cost and take, before it sends anything."""
    c.print(
        f"[bold]{estimate.texts:,}[/] texts to send, {summary.already_done:,} already answered"
        + (
            f", {summary.skipped_failed:,} failed before (--retry-failed)"
            if summary.skipped_failed
            else ""
        )
    )
    if estimate.max_cost is not None and estimate.texts:
        once = (
            f" + {estimate.calibration_input_tokens:,} once for calibration"
            if estimate.calibration_input_tokens
            else ""
        )
        c.print(
            f"Estimate from {estimate.sampled} sampled texts: "
            f"~{estimate.input_tokens_per_text:,.0f} input tokens a text{once}, "
            f"at most [bold]${estimate.max_cost}[/] in all"
        )
    credit = (
        f"${estimate.credit_available}"
        if estimate.credit_available is not None
        else "unknown (key cannot read the account)"
    )
    c.print(f"Credit available: {credit}")
    took = (
        f", first text answered in {estimate.measured_latency_s:.1f} s"
        if estimate.measured_latency_s is not None
        else ""
    )
    c.print(
        f"Pace: {estimate.rpm:g} requests/min ({estimate.pace_source}), "
        f"{estimate.concurrency} workers ({estimate.concurrency_source}){took}"
    )
    if estimate.measured_latency_s is None:
        c.print(f"Time: at least {duration(estimate.seconds)} (the limits' pace)")
    else:
        c.print(f"Time: about {duration(estimate.seconds)} (set by {estimate.bound_by})")
    if estimate.zero_data_retention:
        c.print("[yellow]Zero data retention: answers are not saved, so a rerun charges again.[/]")


def print_summary(console: Console, s: TextRunSummary) -> None:
    console.print(
        f"Answered [bold]{s.answered:,}[/] this run for ${s.spend} in {duration(s.elapsed_s)}; "
        f"{s.already_done:,} were already in {s.output}"
    )
    if s.failed or s.skipped_failed:
        console.print(
            f"[red]{s.failed:,} failed[/] this run, {s.skipped_failed:,} failed before: "
            f"see {s.errors_path}; rerun with --retry-failed to send the retryable ones again"
        )
    if s.fallback_ids:
        console.print(
            f"[yellow]{len(s.fallback_ids):,} answered by the base model while the model warmed up "
            "(fallback model_warming)[/]: rerun with --resend-fallbacks to score them again"
        )
    if s.aborted:
        console.print(
            f"[red]Stopped early: {s.aborted}[/]. Fix it and rerun the same command to continue."
        )


@click.command("run")
@click.argument("texts", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--decisions",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML or JSON decisions.",
)
@click.option("--model", required=True)
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Answers JSONL.",
)
@click.option("--id-field", default="id", show_default=True)
@click.option("--text-field", default="text", show_default=True)
@pace_options
@click.option("--retry-failed", is_flag=True, help="Send failed texts again (see the errors file).")
@click.option(
    "--resend-fallbacks", is_flag=True, help="Score again the texts a base model answered."
)
@click.option(
    "--yes", "-y", is_flag=True, help="Start even when credit may not cover the estimate."
)
@click.option(
    "--estimate",
    "estimate_only",
    is_flag=True,
    help="Only price what a run would send (free: no model runs, nothing is charged).",
)
@client_options
def command(
    texts: Path,
    decisions: Path,
    model: str,
    output: Path,
    id_field: str,
    text_field: str,
    rpm: float | None,
    concurrency: int | None,
    key_suffix: str | None,
    max_output_tokens: int,
    retry_failed: bool,
    resend_fallbacks: bool,
    yes: bool,
    estimate_only: bool,
    base_url: str | None,
    api_key: str | None,
) -> None:
    """Answer DECISIONS for every text in TEXTS (JSONL, CSV or Parquet), resumably."""
    console = Console()
    try:
        decision_list = load_decisions(decisions)
        items = read_texts(texts, id_field=id_field, text_field=text_field)
    except InputError as exc:
        raise click.ClickException(str(exc)) from exc
    progress = RichProgress(console)

    async def go() -> TextRunSummary:
        async with AsyncClient(base_url, api_key) as client:
            return await run_texts(
                client,
                items,
                decision_list,
                model=model,
                output=output,
                max_output_tokens=max_output_tokens,
                rpm=rpm,
                concurrency=concurrency,
                key_suffix=key_suffix,
                retry_failed=retry_failed,
                resend_fallbacks=resend_fallbacks,
                yes=yes,
                estimate_only=estimate_only,
                observer=progress,
            )

    try:
        summary = asyncio.run(go())
    except (InputError, TextRunRefused) as exc:
        raise click.ClickException(str(exc)) from exc
    except TextRunAborted as exc:
        progress.stop()
        print_summary(console, exc.summary)
        raise SystemExit(1) from exc
    except BatchyardError as exc:
        raise click.ClickException(f"{exc.code}: {exc.message}") from exc
    except KeyboardInterrupt:
        progress.stop()
        console.print(
            "Interrupted. Everything answered is saved; rerun the same command to continue."
        )
        raise SystemExit(130) from None
    finally:
        progress.stop()
    if estimate_only:
        assert summary.estimate is not None
        print_plan(console, summary.estimate, summary)
        est = summary.estimate
        if (
            est.max_cost is not None
            and est.credit_available is not None
            and est.max_cost > est.credit_available
        ):
            console.print("[red]Credit may not cover it:[/] buy credit before the run.")
        return
    print_summary(console, summary)
    if summary.failed:
        raise SystemExit(1)
