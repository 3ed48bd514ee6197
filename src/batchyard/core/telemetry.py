"""What the parts that count say, and to whom: the ``Recorder`` seam of ``/metrics``.

The dispatcher, the limiter, the workers and the API's HTTP envelope count
things (requests, model calls, tokens, credits, admissions, upstream 429s,
leases recovered, items ``uncertain``) through one small protocol, so none of
them imports a metrics library: ``service.metrics`` holds the Prometheus
implementation (the one module that imports ``prometheus_client``), and a
part built without one counts into ``NO_RECORDER``. ``MemoryRecorder`` keeps
the counts in a dict, for tests of the parts themselves.

Each hook is one line at the place it counts, named for the event. Labels are
bounded sets: route IDs from the catalog, route templates (never raw paths),
outcomes that are wire codes, a limiter key's scope (``org``, ``route``),
never an organisation's ID.

``MeteredLimiter`` wraps any ``Limiter`` and counts its verdicts, so the
limiter backends (in-process, SQL, Redis) stay free of metrics code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from decimal import Decimal
from typing import Protocol

from batchyard.core.limits import Admission, Limit, Limiter, RateLimitSignal, SlotGrant

__all__ = [
    "NO_RECORDER",
    "MemoryRecorder",
    "MeteredLimiter",
    "NoRecorder",
    "Recorder",
    "limiter_scope",
]


class Recorder(Protocol):
    """The events the parts count; every method is cheap and never raises."""

    def http_request(self, route: str, method: str, status: int, seconds: float) -> None:
        """One HTTP answer: its route template, method, status and how long it took."""

    def model_call(self, route: str, outcome: str) -> None:
        """One engine call on ``route``: ``ok``, ``upstream_429`` or the failure's code."""

    def tokens(self, route: str, input_tokens: int, output_tokens: int) -> None:
        """The usage an engine call on ``route`` reported."""

    def prompt_tokens_cached(self, route: str, tokens: int) -> None:
        """Prompt tokens an engine call on ``route`` read from its cache instead of evaluating."""

    def charged(self, purpose: str, credits: Decimal, over_hold: Decimal = Decimal(0)) -> None:
        """A reservation settled for ``purpose`` (chat, decide, run, ...): the credits charged,
        and what was asked above the hold (a defect, ``store.billing``), if anything."""

    def admission(self, scope: str, verdict: str, limit: str | None) -> None:
        """A limiter verdict under a key's scope: ``admitted`` or ``refused`` (by ``limit``)."""

    def upstream_429(self, route: str, retry_after_s: float) -> None:
        """An upstream answered 429; the route waits ``retry_after_s`` seconds."""

    def leases_recovered(self, kind: str, count: int) -> None:
        """``count`` lapsed leases of ``kind`` (runs, deferred, file_batches) taken over."""

    def uncertain(self, kind: str, count: int) -> None:
        """``count`` items of ``kind`` became ``uncertain`` (sent, then their worker died)."""

    def work_stuck(self, kind: str, reason: str) -> None:
        """Work of ``kind`` stopped moving, waiting for ``reason`` (once a standstill)."""


class NoRecorder:
    """Counts nothing: the default of every part built without a recorder."""

    def http_request(self, route: str, method: str, status: int, seconds: float) -> None:
        return None

    def model_call(self, route: str, outcome: str) -> None:
        return None

    def tokens(self, route: str, input_tokens: int, output_tokens: int) -> None:
        return None

    def prompt_tokens_cached(self, route: str, tokens: int) -> None:
        return None

    def charged(self, purpose: str, credits: Decimal, over_hold: Decimal = Decimal(0)) -> None:
        return None

    def admission(self, scope: str, verdict: str, limit: str | None) -> None:
        return None

    def upstream_429(self, route: str, retry_after_s: float) -> None:
        return None

    def leases_recovered(self, kind: str, count: int) -> None:
        return None

    def uncertain(self, kind: str, count: int) -> None:
        return None

    def work_stuck(self, kind: str, reason: str) -> None:
        return None


NO_RECORDER: Recorder = NoRecorder()


class MemoryRecorder:
    """Every event summed in ``counts``, keyed by ``(event, *labels)``: for tests."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, ...]] = Counter()
        self.credits: dict[str, Decimal] = {}

    def http_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.counts["http_request", route, method, str(status)] += 1

    def model_call(self, route: str, outcome: str) -> None:
        self.counts["model_call", route, outcome] += 1

    def tokens(self, route: str, input_tokens: int, output_tokens: int) -> None:
        self.counts["tokens", route, "input"] += input_tokens
        self.counts["tokens", route, "output"] += output_tokens

    def prompt_tokens_cached(self, route: str, tokens: int) -> None:
        self.counts["prompt_tokens_cached", route] += tokens

    def charged(self, purpose: str, credits: Decimal, over_hold: Decimal = Decimal(0)) -> None:
        self.credits[purpose] = self.credits.get(purpose, Decimal(0)) + credits
        if over_hold:
            self.counts["over_hold", purpose] += 1

    def admission(self, scope: str, verdict: str, limit: str | None) -> None:
        self.counts["admission", scope, verdict, limit or ""] += 1

    def upstream_429(self, route: str, retry_after_s: float) -> None:
        self.counts["upstream_429", route] += 1

    def leases_recovered(self, kind: str, count: int) -> None:
        self.counts["leases_recovered", kind] += count

    def uncertain(self, kind: str, count: int) -> None:
        self.counts["uncertain", kind] += count

    def work_stuck(self, kind: str, reason: str) -> None:
        self.counts["work_stuck", kind, reason] += 1


def limiter_scope(key: str) -> str:
    """A limiter key's scope (``org:…`` → ``org``): a label with few values."""
    return key.split(":", 1)[0] if ":" in key else "other"


class MeteredLimiter:
    """Any ``Limiter``, its verdicts counted; everything else passes straight through.

    A look that spends nothing (every cost zero: the answer's
    ``x-ratelimit-*`` headers) is not counted. ``acquire`` waits until it is
    admitted, so it counts one admission; a refusal there is its
    ``RateLimited``, counted as refused.
    """

    def __init__(self, inner: Limiter, recorder: Recorder) -> None:
        self.inner = inner
        self._recorder = recorder

    async def try_acquire(
        self,
        key: str,
        limits: Sequence[tuple[Limit, float]],
        *,
        max_delay: float = 0.0,
        hold_s: float = 0.0,
    ) -> Admission:
        admission = await self.inner.try_acquire(key, limits, max_delay=max_delay, hold_s=hold_s)
        if any(cost for _, cost in limits):
            verdict = "admitted" if admission.allowed else "refused"
            self._recorder.admission(limiter_scope(key), verdict, admission.limit)
        return admission

    async def acquire(
        self, key: str, limits: Sequence[tuple[Limit, float]], *, max_wait: float | None = None
    ) -> None:
        try:
            await self.inner.acquire(key, limits, max_wait=max_wait)
        except Exception:
            self._recorder.admission(limiter_scope(key), "refused", None)
            raise
        self._recorder.admission(limiter_scope(key), "admitted", None)

    async def adjust(self, key: str, limit: Limit, delta: float) -> None:
        await self.inner.adjust(key, limit, delta)

    async def penalize(self, key: str, until: float) -> None:
        await self.inner.penalize(key, until)

    async def observe(self, key: str, signal: RateLimitSignal) -> None:
        await self.inner.observe(key, signal)

    async def take_slot(self, key: str, capacity: int, lease_s: float) -> SlotGrant:
        return await self.inner.take_slot(key, capacity, lease_s)

    async def renew_slot(self, key: str, token: str, lease_s: float) -> None:
        await self.inner.renew_slot(key, token, lease_s)

    async def free_slot(self, key: str, token: str) -> None:
        await self.inner.free_slot(key, token)

    async def occupy(
        self, key: str, capacity: int, lease_s: float, *, max_wait: float = 0.0
    ) -> SlotGrant:
        grant = await self.inner.occupy(key, capacity, lease_s, max_wait=max_wait)
        if grant.token is None:
            self._recorder.admission(limiter_scope(key), "refused", "concurrency")
        return grant

    async def close(self) -> None:
        await self.inner.close()
