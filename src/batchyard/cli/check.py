"""``batchyard check``: accuracy of one or more models on texts with known answers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from batchyard.cli.text_runner import client_options, pace_options
from batchyard.client.async_client import AsyncClient
from batchyard.client.check import CheckReport, DecisionQuality, ModelScore, check_models
from batchyard.client.fleet import TextRunAborted
from batchyard.client.inputs import InputError, load_decisions, read_labels
from batchyard.errors import BatchyardError

__all__ = ["command", "quality_table", "report_table"]


def _cell(score: ModelScore, decision: str | None) -> str:
    if decision is None:
        acc, n, hit = score.overall, sum(score.labelled.values()), sum(score.correct.values())
    else:
        acc, n, hit = (
            score.accuracy(decision),
            score.labelled.get(decision, 0),
            score.correct.get(decision, 0),
        )
    return "-" if acc is None else f"{acc:.1%} ({hit}/{n})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ece(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def quality_table(score: ModelScore, decision: str, quality: DecisionQuality) -> Table:
    """Raw beside calibrated for one model and decision, then both confusion matrices."""
    table = Table(title=f"{score.model} · {decision}: raw beside calibrated")
    table.add_column("")
    table.add_column("raw", justify="right")
    table.add_column("calibrated", justify="right")
    raw, cal = quality.raw, quality.calibrated
    table.add_row("accuracy", _pct(raw.accuracy), _pct(cal.accuracy))
    table.add_row("balanced accuracy", _pct(raw.balanced_accuracy), _pct(cal.balanced_accuracy))
    table.add_row("expected calibration error", _ece(raw.ece), _ece(cal.ece), end_section=True)
    outcomes = cal.outcomes
    table.add_row("[bold]label ↓ / answer →[/]", "raw", "calibrated")
    for i, label in enumerate(outcomes):
        if not any(cal.matrix[i]) and not any(raw.matrix[i]):
            continue
        table.add_row(
            label,
            " ".join(f"{o}:{n}" for o, n in zip(outcomes, raw.matrix[i], strict=True) if n),
            " ".join(f"{o}:{n}" for o, n in zip(outcomes, cal.matrix[i], strict=True) if n),
        )
    return table


def report_table(report: CheckReport) -> Table:
    table = Table(title="Accuracy against the labels")
    table.add_column("decision")
    for score in report.models:
        table.add_column(score.model, justify="right")
    for decision in report.decisions:
        table.add_row(decision, *(_cell(s, decision) for s in report.models))
    table.add_row("[bold]all[/]", *(_cell(s, None) for s in report.models), end_section=True)
    table.add_row("answered / failed", *(f"{s.answered} / {s.failed}" for s in report.models))
    table.add_row("fallback answers", *(str(s.fallbacks) for s in report.models))
    table.add_row("cost", *(f"${s.cost}" for s in report.models))
    return table


@click.command("check")
@click.option(
    "--labels",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='JSONL lines {"id", "text", "labels": {decision: outcome}}.',
)
@click.option(
    "--decisions", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--model", "models", required=True, multiple=True, help="A model to score; repeat to compare."
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the report here.",
)
@pace_options
@client_options
def command(
    labels: Path,
    decisions: Path,
    models: tuple[str, ...],
    json_path: Path | None,
    rpm: float | None,
    concurrency: int | None,
    key_suffix: str | None,
    max_output_tokens: int,
    base_url: str | None,
    api_key: str | None,
) -> None:
    """Score labelled texts with each --model and compare accuracy and cost."""
    console = Console()
    try:
        decision_list = load_decisions(decisions)
        labelled = read_labels(labels, decision_list)
    except InputError as exc:
        raise click.ClickException(str(exc)) from exc
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console
    )

    async def go() -> CheckReport:
        task = progress.add_task("check", total=len(labelled) * len(models))
        async with AsyncClient(base_url, api_key) as client:
            return await check_models(
                client,
                labelled,
                decision_list,
                list(dict.fromkeys(models)),
                max_output_tokens=max_output_tokens,
                rpm=rpm,
                concurrency=concurrency,
                key_suffix=key_suffix,
                on_result=lambda _m, _i, _e: progress.advance(task),
            )

    try:
        with progress:
            report = asyncio.run(go())
    except TextRunAborted as exc:
        raise click.ClickException(f"stopped: {exc}") from exc
    except BatchyardError as exc:
        raise click.ClickException(f"{exc.code}: {exc.message}") from exc
    console.print(report_table(report))
    for score in report.models:
        for decision in report.decisions:
            if decision in score.quality:
                console.print(quality_table(score, decision, score.quality[decision]))
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
        console.print(f"Report written to {json_path}")
