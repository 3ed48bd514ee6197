"""The text runner: ``run_texts`` scores a file of texts, resumable, paced, priced first.

Not to be confused with a batch inference run (docs/reference/runs.md), which the server
executes over a stored dataset: this one runs on the caller's machine, one
decide request a text, hence the ``TextRun…`` names.

The order is docs/how-to/score-texts.md's advice made mechanical: check every input locally,
price a sample with the free estimate, refuse when credit will not cover it,
then send one text a request at a steady pace, writing each answer the
moment it lands. A rerun of the same command picks up where the last one
stopped, and the server's idempotency makes the texts that were in flight
cost nothing the second time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_UP, Decimal
from pathlib import Path
from typing import Any

from batchyard.client.answers import AnswerFile
from batchyard.client.async_client import AsyncClient
from batchyard.client.fleet import Pace, TextJob, TextRunAborted, local_tokens, plan_pace, send_all
from batchyard.client.inputs import InputError, TextItem
from batchyard.client.keys import decision_set_hash, request_hash, resend_key, text_key
from batchyard.client.pacer import MonotonicClock, PaceClock
from batchyard.client.types import DecideResponse, Decision
from batchyard.errors import BatchyardError, InvalidRequest, Unauthorized

__all__ = [
    "RESENDABLE_CODES",
    "SAMPLE_SIZE",
    "CreditShortfall",
    "TextRunEstimate",
    "TextRunObserver",
    "TextRunRefused",
    "TextRunSummary",
    "estimate_texts",
    "run_texts",
]

#: Texts priced with the free estimate before a run, spread over the whole file.
SAMPLE_SIZE = 20
#: Codes that an unpaid 402 or a busy key left behind: the same key can still succeed.
RESENDABLE_CODES = frozenset({"insufficient_credit", "idempotency_in_progress"})


class TextRunRefused(Exception):
    """The run did not start; nothing was sent or charged."""


class CreditShortfall(TextRunRefused):
    def __init__(self, estimate: TextRunEstimate) -> None:
        super().__init__(
            f"the run may cost up to ${estimate.max_cost} but only ${estimate.credit_available} "
            "is available: buy credit, or pass --yes to start anyway"
        )
        self.estimate = estimate


@dataclass(frozen=True)
class TextRunEstimate:
    texts: int
    sampled: int
    input_tokens_per_text: float
    max_cost_per_text: Decimal | None
    max_cost: Decimal | None
    credit_available: Decimal | None
    rpm: float
    tpm: float | None
    concurrency: int
    pace_source: str
    zero_data_retention: bool
    #: Seconds the first text took to answer, measured before the rest were sent.
    measured_latency_s: float | None = None
    concurrency_source: str = "default"
    #: The one-off calibration prompts (content-free, docs/explanation/calibration.md) the
    #: run's first call sends
    #: where the organisation has no prior for this decision set yet: paid once, not a text.
    calibration_input_tokens: int = 0
    calibration_cost: Decimal = Decimal(0)

    @property
    def rate_seconds(self) -> float:
        """Time the run takes at the limits' pace (the tighter of requests and tokens)."""
        per_text = 60.0 / self.rpm
        if self.tpm:
            per_text = max(per_text, self.input_tokens_per_text * 60.0 / self.tpm)
        return self.texts * per_text

    @property
    def seconds(self) -> float:
        """Time the run really takes: the limits' pace, or the model's measured pace if slower.

        A CPU model that answers a text in 6 s with 2 workers does 20 texts a
        minute, whatever the tier allows.
        """
        if self.measured_latency_s is None:
            return self.rate_seconds
        by_engine = self.texts * self.measured_latency_s / max(1, self.concurrency)
        return max(self.rate_seconds, by_engine)

    @property
    def bound_by(self) -> str:
        """What sets the pace: the limits, or how fast the model answers."""
        if self.measured_latency_s is not None and self.seconds > self.rate_seconds:
            return "model speed"
        return "limits"


@dataclass
class TextRunSummary:
    total: int
    already_done: int = 0
    skipped_failed: int = 0
    to_send: int = 0
    answered: int = 0
    failed: int = 0
    spend: Decimal = Decimal(0)
    elapsed_s: float = 0.0
    fallback_ids: list[str] = field(default_factory=list)
    output: Path | None = None
    errors_path: Path | None = None
    aborted: str | None = None
    estimate: TextRunEstimate | None = None


class TextRunObserver:
    """Hooks for a progress display; every method is optional."""

    def planned(self, estimate: TextRunEstimate, summary: TextRunSummary) -> None:
        """The run will start: the estimate and what is skipped."""

    def result(
        self, item_id: str, answer: dict[str, Any] | None, error: BatchyardError | None
    ) -> None:
        """One text finished (answered or failed)."""


def _sample(items: Sequence[TextItem], size: int) -> list[TextItem]:
    """``size`` items spread over the whole list, not its first rows."""
    if len(items) <= size:
        return list(items)
    step = (len(items) - 1) / (size - 1)
    return [items[round(i * step)] for i in range(size)]


async def estimate_texts(
    client: AsyncClient,
    items: Sequence[TextItem],
    decisions: Sequence[Decision],
    *,
    model: str,
    pace: Pace,
    max_output_tokens: int = 64,
    fallback: str = "base",
) -> tuple[TextRunEstimate, float]:
    """Price a sample, scale it to ``items``; also the tokens-per-local-token ratio.

    The sample is priced without calibration, so each text's tokens and cost are its
    own; one more estimate of the first sampled text with the run's calibration tells
    what the one-off calibration prompts add (nothing once the organisation has a prior
    for these decisions). Spread over the sample, they would make every text look
    several times its size.
    """
    sample = _sample(items, SAMPLE_SIZE)
    gate = asyncio.Semaphore(4)

    async def one(
        item: TextItem, calibration: str | None
    ) -> tuple[TextItem, dict[str, Any]] | None:
        async with gate:
            try:
                est = await client.estimate(
                    model=model,
                    decisions=decisions,
                    text=item.text,
                    max_output_tokens=max_output_tokens,
                    fallback=fallback,
                    calibration=calibration,
                )
            except (Unauthorized, InvalidRequest) as exc:
                if isinstance(exc, InvalidRequest) and exc.code == "context_window_exceeded":
                    return None  # that text will fail on its own; the rest still run
                raise TextRunRefused(
                    f"the server refuses this run: {exc.code}: {exc.message}"
                ) from exc
            except BatchyardError:
                return None  # no estimate for this one; price from the others
            return item, dict(est)

    got = await asyncio.gather(
        *(one(i, "none") for i in sample), *(one(i, None) for i in sample[:1])
    )
    calibrated = got[-1] if sample else None
    priced = [r for r in got[: len(sample)] if r is not None]
    one_off_tokens, one_off_cost = 0, Decimal(0)
    if calibrated is not None and got[0] is not None:
        plain, with_prior = got[0][1], calibrated[1]
        one_off_tokens = max(0, int(with_prior["input_tokens"]) - int(plain["input_tokens"]))
        one_off_cost = max(
            Decimal(0), Decimal(str(with_prior["max_cost"])) - Decimal(str(plain["max_cost"]))
        )
    ratio = 1.0
    per_text_cost: Decimal | None = None
    if priced:
        local = sum(local_tokens(i.text) for i, _ in priced)
        ratio = sum(int(e["input_tokens"]) for _, e in priced) / max(1, local)
        per_text_cost = sum((Decimal(str(e["max_cost"])) for _, e in priced), Decimal(0)) / len(
            priced
        )
    avg_tokens = sum(math.ceil(local_tokens(i.text) * ratio) for i in items) / max(1, len(items))
    account = pace.account
    estimate = TextRunEstimate(
        texts=len(items),
        sampled=len(priced),
        input_tokens_per_text=avg_tokens,
        max_cost_per_text=per_text_cost,
        max_cost=(per_text_cost * len(items) + one_off_cost).quantize(
            Decimal("0.0000001"), ROUND_UP
        )
        if per_text_cost is not None
        else None,
        credit_available=Decimal(account["credit"]["available"]) if account else None,
        rpm=pace.rpm,
        tpm=pace.tpm,
        concurrency=pace.concurrency,
        pace_source=pace.source,
        zero_data_retention=bool(account and account.get("zero_data_retention")),
        concurrency_source=pace.concurrency_source,
        calibration_input_tokens=one_off_tokens,
        calibration_cost=one_off_cost,
    )
    return estimate, ratio


def _is_fallback(row: dict[str, Any]) -> bool:
    fb = row.get("fallback")
    return isinstance(fb, dict) and fb.get("reason") == "model_warming"


async def run_texts(
    client: AsyncClient,
    items: Sequence[TextItem],
    decisions: Sequence[Decision],
    *,
    model: str,
    output: str | Path,
    max_output_tokens: int = 64,
    fallback: str = "base",
    rpm: float | None = None,
    concurrency: int | None = None,
    key_suffix: str | None = None,
    retry_failed: bool = False,
    resend_fallbacks: bool = False,
    yes: bool = False,
    estimate_only: bool = False,
    observer: TextRunObserver | None = None,
    clock: PaceClock | None = None,
) -> TextRunSummary:
    """Answer every text in ``items`` into ``output``; see the module docstring.

    Raises ``InputError`` or ``TextRunRefused`` before sending anything, and
    ``TextRunAborted`` (after writing what was answered) when an error stops all
    remaining texts alike. ``estimate_only`` stops after pricing what a run
    would send (``summary.estimate``), having sent no decide and written nothing.
    """
    observer = observer or TextRunObserver()
    clock = clock or MonotonicClock()
    req_hash = request_hash(decisions, model, max_output_tokens, fallback)
    meta = {
        "decision_set_hash": decision_set_hash(decisions),
        "model": model,
        "request_hash": req_hash,
        "decision_ids": [d["id"] for d in decisions],
    }
    answers_file = AnswerFile(output)
    answers_file.check_meta(meta)
    try:
        text_key("x", req_hash, key_suffix)
    except ValueError as exc:
        raise InputError(str(exc)) from exc

    summary = TextRunSummary(
        total=len(items), output=answers_file.path, errors_path=answers_file.errors_path
    )
    done = answers_file.read_answers()
    failed = answers_file.read_errors(answered=done.keys())
    todo: list[tuple[TextItem, str]] = []
    for item in items:
        key = text_key(item.id, req_hash, key_suffix)
        if item.id in done:
            if resend_fallbacks and _is_fallback(done[item.id]):
                todo.append((item, resend_key(str(done[item.id].get("key") or key))))
            else:
                summary.already_done += 1
        elif item.id in failed:
            err = failed[item.id]
            resendable = err.get("retryable") or err.get("code") in RESENDABLE_CODES
            if retry_failed and (resendable or err.get("key") != key):
                todo.append((item, key))
            else:
                summary.skipped_failed += 1
        else:
            todo.append((item, key))
    summary.to_send = len(todo)
    fallback_ids = {i for i, row in done.items() if _is_fallback(row)}

    pace = await plan_pace(client, rpm=rpm, concurrency=concurrency, model=model)
    estimate, ratio = await estimate_texts(
        client,
        [item for item, _ in todo],
        decisions,
        model=model,
        pace=pace,
        max_output_tokens=max_output_tokens,
        fallback=fallback,
    )
    summary.estimate = estimate
    if estimate_only:
        return summary
    if (
        not yes
        and estimate.max_cost is not None
        and estimate.credit_available is not None
        and estimate.max_cost > estimate.credit_available
    ):
        raise CreditShortfall(estimate)

    jobs = iter(
        [
            TextJob(item.id, item.text, key, model, math.ceil(local_tokens(item.text) * ratio))
            for item, key in todo
        ]
    )

    # Results of the timed first text reach the observer once the plan is shown.
    deferred: list[tuple[str, dict[str, Any] | None, BatchyardError | None]] = []
    planned = False

    def report(item_id: str, row: dict[str, Any] | None, error: BatchyardError | None) -> None:
        if planned:
            observer.result(item_id, row, error)
        else:
            deferred.append((item_id, row, error))

    def on_result(
        job: TextJob, answer: DecideResponse | None, error: BatchyardError | None
    ) -> None:
        if answer is not None:
            row: dict[str, Any] = {
                "id": job.id,
                "answers": answer.get("answers"),
                "usage": answer.get("usage"),
                "charge": answer.get("charge"),
                "fallback": answer.get("fallback"),
                "key": job.key,
            }
            answers_file.write_answer(row)
            summary.answered += 1
            summary.spend += Decimal(str(answer.get("charge") or "0"))
            if _is_fallback(row):
                fallback_ids.add(job.id)
            else:
                fallback_ids.discard(job.id)
            report(job.id, row, None)
        else:
            assert error is not None
            answers_file.write_error(
                {
                    "id": job.id,
                    "code": error.code,
                    "message": error.message,
                    "retryable": error.retryable,
                    "status": error.status,
                    "key": job.key,
                }
            )
            summary.failed += 1
            report(job.id, None, error)

    started = clock.time()
    answers_file.open(meta)

    async def send(batch: Any) -> None:
        await send_all(
            client,
            batch,
            decisions=decisions,
            pace=pace,
            on_result=on_result,
            max_output_tokens=max_output_tokens,
            fallback=fallback,
            clock=clock,
        )

    try:
        # The first text alone, timed: the plan then says how long the run
        # will really take on this model, not only what the limits allow.
        first = next(jobs, None)
        if first is not None:
            await send([first])
            estimate = dataclasses.replace(estimate, measured_latency_s=clock.time() - started)
            summary.estimate = estimate
        observer.planned(estimate, summary)
        for args in deferred:
            observer.result(*args)
        deferred.clear()
        planned = True
        await send(jobs)
    except TextRunAborted as exc:
        summary.aborted = str(exc)
        exc.summary = summary
        raise
    finally:
        answers_file.close()
        summary.elapsed_s = clock.time() - started
        wanted = {item.id for item in items}
        summary.fallback_ids = sorted(fallback_ids & wanted)
    return summary
