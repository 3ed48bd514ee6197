"""Workers that share one pacer: the sending half of ``run`` and ``check``.

The pace comes from the organisation's own limits (``GET /v1/account``) when
the key may read them, else from flags or tier-0 defaults. Workers only
bound how many requests are in flight; the pacer alone decides when each one
leaves, so the rate is the same with 2 workers or 50.

An error that would fail every remaining text alike (a bad key, no credit,
an unknown model, the gateway gone) stops the run instead of being written
once per text: those texts stay unsent and the next run sends them.

A request the server is still working on is never a failed text: a client
timeout (``read_timeout``) sends it again under the same key, and the server's
409 ``idempotency_in_progress`` means "the first attempt is still running", so
the worker waits and asks again until that attempt's answer is there (for up
to ``IN_PROGRESS_PATIENCE_S``, past the server's own stale-claim limit).

Concurrency comes from the tier (``effective_limits.concurrency``) and from the
model's own route (``concurrency`` in ``GET /v1/models/{id}``: the embedded
model's contexts), whichever is lower: more workers than the engine runs at once
only queue inside the server, where their clocks keep running.

A 429 that outlasts the SDK's retries is not a failure of the text either: it
says "not yet". Such a job goes back into the queue, behind the pacer's
push-back, up to ``RATE_LIMITED_REQUEUES`` times, rather than being written
to the errors file and waiting for a ``--retry-failed`` run.

A 402 ``insufficient_credit`` stops the run, and the server saves that refusal
under the text's key. When the user has bought credit and runs the same
command again, that key only replays the old 402; a replayed 402 therefore
sends the text again at once under its next key (``resend_key``), and only a
fresh 402 (credit still short) stops the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from batchyard.client.async_client import AsyncClient
from batchyard.client.keys import resend_key
from batchyard.client.pacer import PaceClock, Pacer
from batchyard.client.retries import REPLAYED
from batchyard.client.types import Account, DecideResponse, Decision
from batchyard.errors import BatchyardError, Forbidden

__all__ = [
    "DEFAULT_RPM",
    "FATAL_CODES",
    "IN_PROGRESS_PATIENCE_S",
    "RATE_LIMITED_REQUEUES",
    "WAITING_CODES",
    "Pace",
    "ResultHandler",
    "TextJob",
    "TextRunAborted",
    "local_tokens",
    "plan_pace",
    "send_all",
]

#: Tier 0's requests a minute: the pace when nothing better is known.
DEFAULT_RPM = 30
#: Enough workers to keep the pace with answers this many seconds slow.
_LATENCY_ALLOWANCE_S = 4.0
#: How often one text may go back into the queue after 429s past the SDK's retries.
RATE_LIMITED_REQUEUES = 5
#: How many new keys one text may try past 402s that earlier runs left saved.
_REKEYS = 20
#: How long one text waits for a first attempt the server is still working on.
IN_PROGRESS_PATIENCE_S = 15 * 60
#: Answers that say "the server is (maybe) still working on it": wait, same key.
WAITING_CODES = frozenset({"idempotency_in_progress", "read_timeout"})

FATAL_CODES = frozenset(
    {
        "missing_api_key",
        "invalid_api_key",
        "unauthorized",
        "forbidden",
        "insufficient_scope",
        "insufficient_credit",
        "unknown_model",
        "model_unavailable",
        "unsupported_input",
        "no_decisions",
        "too_few_outcomes",
        "duplicate_id",
        "connection_error",
    }
)


class TextRunAborted(Exception):
    """The run stopped early on an error every remaining text would hit."""

    def __init__(self, error: BatchyardError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error
        #: What was done before the stop, where the caller keeps a summary.
        self.summary: Any = None


@dataclass(frozen=True)
class TextJob:
    id: str
    text: str
    key: str
    model: str
    tokens: int = 0


@dataclass(frozen=True)
class Pace:
    rpm: float
    tpm: float | None
    concurrency: int
    account: Account | None
    #: Where the rate came from, for the plan the user sees.
    source: str
    #: Why this many workers (the tier, the model's route, a flag).
    concurrency_source: str = "default"


async def plan_pace(
    client: AsyncClient,
    *,
    rpm: float | None = None,
    concurrency: int | None = None,
    model: str | None = None,
) -> Pace:
    """Limits from the account where readable; the model's own concurrency; flags override."""
    account: Account | None = None
    # An inference key cannot read its account: then go by flags and defaults.
    with contextlib.suppress(Forbidden):
        account = await client.account()
    limits: dict[str, Any] = dict(account["effective_limits"]) if account else {}
    tpm = limits.get("tokens_per_minute")
    if rpm is not None:
        source = "--rpm"
    elif limits.get("requests_per_minute"):
        rpm, source = float(limits["requests_per_minute"]), "account limits"
    else:
        rpm, source = float(DEFAULT_RPM), "tier-0 default"
    route_limit: int | None = None
    if model is not None:
        # An unknown model fails the run later, with its own error.
        with contextlib.suppress(BatchyardError):
            route_limit = (await client.get_model(model)).get("concurrency")
    if concurrency:
        workers, why = concurrency, "--concurrency"
    else:
        workers = max(2, min(64, math.ceil(rpm / 60 * _LATENCY_ALLOWANCE_S)))
        why = "the pace"
        tier_limit = limits.get("concurrency")
        if isinstance(tier_limit, int) and tier_limit < workers:
            workers, why = tier_limit, "your tier's concurrency"
        if isinstance(route_limit, int) and route_limit > 0 and route_limit < workers:
            workers, why = route_limit, f"{model}'s concurrency"
    return Pace(rpm, float(tpm) if tpm else None, max(1, workers), account, source, why)


def local_tokens(text: str) -> int:
    """A deliberately high token count (3 bytes a token) when no estimate is at hand."""
    return max(1, math.ceil(len(text.encode("utf-8")) / 3))


ResultHandler = Callable[[TextJob, DecideResponse | None, BatchyardError | None], None]


async def send_all(
    client: AsyncClient,
    jobs: Iterable[TextJob],
    *,
    decisions: Sequence[Decision],
    pace: Pace,
    on_result: ResultHandler,
    max_output_tokens: int = 64,
    fallback: str = "base",
    clock: PaceClock | None = None,
) -> None:
    """Send every job under one shared pace; ``on_result`` sees each outcome once."""
    pacer = Pacer(pace.rpm, pace.tpm, clock=clock)
    paced = client.with_pacer(pacer)
    fresh = iter(jobs)
    again: deque[TextJob] = deque()
    requeued: Counter[str] = Counter()
    rekeyed: Counter[str] = Counter()
    waiting_since: dict[str, float] = {}
    wait_clock = pacer.clock
    fatal: list[BatchyardError] = []

    def next_job() -> TextJob | None:
        if again:
            return again.popleft()
        return next(fresh, None)

    async def worker() -> None:
        while (job := next_job()) is not None:
            if fatal:
                return
            try:
                answer: DecideResponse | None = await paced.decide(
                    model=job.model,
                    decisions=decisions,
                    text=job.text,
                    max_output_tokens=max_output_tokens,
                    fallback=fallback,
                    idempotency_key=job.key,
                    tokens=job.tokens,
                )
                error: BatchyardError | None = None
            except BatchyardError as exc:
                if (
                    exc.code == "insufficient_credit"
                    and exc.details.get(REPLAYED)
                    and rekeyed[job.id] < _REKEYS
                ):
                    rekeyed[job.id] += 1
                    again.appendleft(dataclasses.replace(job, key=resend_key(job.key)))
                    continue
                if exc.code in WAITING_CODES:
                    now = wait_clock.time()
                    since = waiting_since.setdefault(job.key, now)
                    if now - since < IN_PROGRESS_PATIENCE_S:
                        # The first attempt is (maybe) still running: its answer
                        # will be saved under this key; ask for it again shortly.
                        await wait_clock.sleep(exc.retry_after or 1.0)
                        again.appendleft(job)
                        continue
                if exc.code in FATAL_CODES:
                    fatal.append(exc)
                    return
                if (
                    exc.status == 429
                    and exc.retryable
                    and requeued[job.key] < RATE_LIMITED_REQUEUES
                ):
                    requeued[job.key] += 1
                    again.append(job)  # the pacer already holds everyone back
                    continue
                answer, error = None, exc
            on_result(job, answer, error)

    tasks: list[asyncio.Task[Any]] = [
        asyncio.create_task(worker()) for _ in range(max(1, pace.concurrency))
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if fatal:
        raise TextRunAborted(fatal[0])
