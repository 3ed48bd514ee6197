"""The dispatcher: the only caller of engines.

Every door ends here: reserve the most the call can cost (402 before anything runs),
wait for the route's pace, call the engine, then settle to the real usage in one
transaction with its activity record. A call that fails is released. An upstream 429 was
not processed, so it is waited out and sent again; nothing else is retried here, because
only the caller knows whether a retry is safe. ``on_send`` is awaited right before the
engine is called, so a worker can record "sent" durably: work claimed but not yet sent
when a worker dies goes back to waiting instead of becoming ``uncertain``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict, TypeVar, Unpack

from sqlalchemy import Connection

from batchyard.core.catalog import ModelSpec, RouteSpec
from batchyard.core.clock import Clock
from batchyard.core.limits import Limiter
from batchyard.core.money import from_ticks
from batchyard.core.prices import Price
from batchyard.core.quotes import charge
from batchyard.core.telemetry import NO_RECORDER, Recorder
from batchyard.core.tiers import Tier
from batchyard.engines.protocol import (
    Completion,
    CompletionRequest,
    Delta,
    EmbeddingEngine,
    Embeddings,
    RateLimitSignal,
    ScoringEngine,
    StreamingEngine,
    Usage,
)
from batchyard.errors import (
    CapabilityUnsupported,
    UpstreamError,
    UpstreamRateLimited,
    UpstreamUnreachable,
)
from batchyard.store import billing, ledger
from batchyard.store.database import Database
from batchyard.work.engines import EngineRegistry
from batchyard.work.route_health import RouteHealth
from batchyard.work.route_pacing import RoutePacer

__all__ = ["DispatchResult", "Dispatcher", "OnSend", "Payment", "outcome_of", "usage_of"]

log = logging.getLogger("batchyard.dispatch")
T = TypeVar("T")

#: Awaited just before the engine is called (see the module docstring).
OnSend = Callable[[], Awaitable[None]]


class Deal(TypedDict):
    """What ``paying`` settles at (the model, route and price) and records (``ref``, the key)."""

    model: ModelSpec
    route: RouteSpec
    price: Price
    ref: NotRequired[str | None]
    key_id: NotRequired[str | None]


class Terms(Deal):
    """``Deal`` as a door hands it on, with who pays and the most they pay."""

    org_id: str
    max_cost: int


class Paid(Terms):
    """``Terms`` and what the call is for (an activity record's ``purpose``)."""

    purpose: str


@dataclass(frozen=True, slots=True)
class DispatchResult:
    completion: Completion
    charge: int
    reservation_id: str
    route: str


class Dispatcher:
    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        limiter: Limiter,
        engines: EngineRegistry,
        tiers: tuple[Tier, ...],
        upstream_429_retries: int = 5,
        upstream_unavailable_retries: int = 0,
        metrics: Recorder = NO_RECORDER,
    ) -> None:
        self.db = db
        self.clock = clock
        self.limiter = limiter
        self.engines = engines
        self.tiers = tiers
        self.upstream_429_retries = upstream_429_retries
        #: How many times a batch worker sends a unit again after an upstream 503 that took
        #: nothing (``UpstreamError.not_taken``); the workers' pipelines read it. A door does
        #: not: its caller decides whether to send again.
        self.upstream_unavailable_retries = upstream_unavailable_retries
        self.pacer = RoutePacer(clock, limiter)
        #: Each route's trouble since its last answer (down, limited), for the stuck-work watch.
        self.health = RouteHealth()
        #: What the dispatcher (and the workers that hold it) count for /metrics.
        self.metrics = metrics
        self._concurrency: dict[str, asyncio.Semaphore] = {}

    def _semaphore(self, route: RouteSpec) -> asyncio.Semaphore | None:
        if not route.concurrency:
            return None
        sem = self._concurrency.get(route.id)
        if sem is None:
            sem = self._concurrency[route.id] = asyncio.Semaphore(route.concurrency)
        return sem

    async def reserve(
        self,
        org_id: str,
        amount: int,
        *,
        purpose: str,
        ref: str | None = None,
        key_id: str | None = None,
    ) -> ledger.Reservation:
        """Hold the most a call can cost (``store.billing``); 402 before anything runs.

        ``key_id``: the calling key, whose spend caps the hold counts against.
        """
        now = self.clock.now()
        return await self.db.write(
            lambda c: billing.reserve(
                c, org_id, amount, now, purpose=purpose, ref=ref, tiers=self.tiers, key_id=key_id
            )
        )

    def concurrency(self, route: RouteSpec) -> int | None:
        """How many calls the route runs at once, where it has a bound: the one answer.

        The route's own ``concurrency`` setting, else its engine's (the embedded
        model's slots); ``None`` for an upstream that says nothing. The workers
        keep this many calls in flight (or their own default where it is None),
        ``/v1/models`` shows it.
        """
        return route.concurrency or self.engines.slots(route)

    def can_score(self, route: RouteSpec) -> bool:
        """Whether the route's engine scores candidate replies (decide's per-outcome scoring)."""
        return isinstance(self.engines.for_route(route), ScoringEngine)

    async def _paced(
        self,
        route: RouteSpec,
        cost_tokens: int,
        input_tokens: int,
        send: Callable[[], Awaitable[T]],
        on_send: OnSend | None = None,
        *,
        hold: contextlib.AsyncExitStack | None = None,
    ) -> T:
        """Pace the route, then ``send``; an upstream 429 is waited out and sent again.

        Every engine call goes through here: a chat, a batch line, a score, an
        embedding and a stream. A 429 means the upstream did not process the
        call, so sending it again cannot charge twice. Its Retry-After becomes
        a penalty on the route that every caller of the route waits out, not
        only this one. ``on_send`` runs right before each ``send``, inside the
        concurrency slot.

        ``hold`` is a stream's: ``send`` opens it (up to its first piece, where
        a 429 shows), the route's slots (the cold gate, the concurrency slot)
        stay taken in ``hold`` until the caller closes it, and the caller
        counts the answer when the stream ends.
        """
        sem = self._semaphore(route)
        attempt = 0
        while True:
            async with contextlib.AsyncExitStack() as slot:
                # Until a route without a declared rate first answers, only a few
                # calls go out: its headers (or its 429) say what the rate is.
                await slot.enter_async_context(self.pacer.cold(route))
                await self.pacer.admit(route, input_tokens, cost_tokens)
                if sem is not None:
                    await slot.enter_async_context(sem)
                if on_send is not None:
                    await on_send()
                await self.pacer.send(route)
                try:
                    result = await send()
                except UpstreamRateLimited as exc:
                    self.metrics.model_call(route.id, outcome_of(exc))
                    self.health.failed(route.id, "limits", self.clock.now(), exc.message)
                    attempt += 1
                    wait = exc.retry_after if exc.retry_after is not None else 1.0
                    await self.pacer.refused(route, wait, _signal_of(exc))
                    self.metrics.upstream_429(route.id, wait)
                    if attempt > self.upstream_429_retries:
                        raise
                    log.info("upstream 429", extra={"route": route.id, "retry_after": wait})
                    continue
                except BaseException as exc:
                    self.metrics.model_call(route.id, outcome_of(exc))
                    if isinstance(exc, UpstreamUnreachable):
                        self.health.failed(route.id, "route_down", self.clock.now(), exc.message)
                    raise
                if hold is not None:
                    hold.push_async_exit(slot.pop_all())
                    return result
                await self._answered(route, result)
                return result

    async def _answered(self, route: RouteSpec, result: object) -> None:
        """A call came back: count it and its tokens, and learn from its rate-limit headers."""
        self.metrics.model_call(route.id, "ok")
        self.health.answered(route.id)
        if (usage := usage_of(result)) is not None:
            self.metrics.tokens(route.id, usage.input_tokens, usage.output_tokens)
            if usage.cached_input_tokens:
                self.metrics.prompt_tokens_cached(route.id, usage.cached_input_tokens)
        await self.pacer.answered(route, _signal_of(result))

    async def call(
        self,
        *,
        route: RouteSpec,
        request: CompletionRequest,
        input_tokens: int,
        on_send: OnSend | None = None,
    ) -> Completion:
        """Pace and call one route; an upstream 429 is waited out and retried."""
        engine = self.engines.for_route(route)
        most = request.max_tokens * max(1, request.n)
        return await self._paced(
            route, most, input_tokens, lambda: engine.complete(request), on_send
        )

    @contextlib.asynccontextmanager
    async def paying(
        self, org_id: str, max_cost: int, *, purpose: str, **deal: Unpack[Deal]
    ) -> AsyncIterator[Payment]:
        """Reserve → call → settle or release: the one way a call is paid.

        Holds ``max_cost`` ticks (402 before anything runs), yields the
        ``Payment`` the block settles with what its call used
        (``Payment.settle``), and releases the hold when the block raises (its
        reason the error's code) or ends without settling. Either way the hold
        resolves exactly once.
        """
        ref, key_id = deal.get("ref"), deal.get("key_id")
        res = await self.reserve(org_id, max_cost, purpose=purpose, ref=ref, key_id=key_id)
        pay = Payment(self, res, deal["model"], deal["route"], deal["price"], purpose, ref)
        try:
            yield pay
        except BaseException as exc:
            if pay.charged is None:
                await asyncio.shield(pay.release(str(getattr(exc, "code", type(exc).__name__))))
            raise
        if pay.charged is None:
            await asyncio.shield(pay.release("unanswered"))

    async def execute(
        self, *, requests: Sequence[tuple[CompletionRequest, int]], **terms: Unpack[Paid]
    ) -> DispatchResult:
        """One call to its caller, paid as one: one hold, the calls side by side, one settlement.

        A chat is one ``(request, input_tokens)``; ``/v1/completions`` with a
        list of prompts is several, each sent to the route as its own call,
        paced and bounded by the route's concurrency like any other. The
        answer's choices are each request's choices in order. If any call
        fails, the others are cancelled and the whole hold is released: nothing
        was answered, so nothing is charged.
        """
        route = terms["route"]
        async with self.paying(**terms) as pay:
            if len(requests) == 1:
                ((request, n),) = requests
                completion = await self.call(route=route, request=request, input_tokens=n)
                await pay.settle(completion.usage)
            else:
                try:
                    async with asyncio.TaskGroup() as group:
                        tasks = [
                            group.create_task(self.call(route=route, request=r, input_tokens=n))
                            for r, n in requests
                        ]
                except BaseExceptionGroup as exc:
                    raise exc.exceptions[0] from None
                done = [t.result() for t in tasks]
                usage = sum((c.usage for c in done), Usage(0, 0))
                choices = [ch for c in done for ch in c.choices]
                completion = Completion(done[0].model, choices, usage, done[-1].rate_limit)
                await pay.settle(usage, {"prompts": len(done)})
            return DispatchResult(completion, pay.ticks, pay.reservation.id, route.id)

    async def stream(
        self,
        *,
        request: CompletionRequest,
        input_tokens: int,
        count_tokens: Callable[[str], int],
        on_send: OnSend | None = None,
        **terms: Unpack[Paid],
    ) -> AsyncIterator[Delta | DispatchResult]:
        """Reserve, then the engine's pieces as they come, then the settled result, last.

        The stream is opened through the same paced call as every other call
        (the cold-route gate, the 429 retry, ``on_send``); its route slots stay
        taken until it ends. The charge is the tokens really produced. A
        stream that stops early (the client hung up, an error half-way) is
        settled to what was produced until then, counted with
        ``count_tokens``, and the prompt tokens the engine said so far it read
        from its cache (``Delta.cached_input_tokens``) at their price; one that
        produced nothing is released. Either way the reservation resolves
        exactly once.
        """
        route = terms["route"]
        engine = self.engines.for_route(route)
        if not isinstance(engine, StreamingEngine):
            raise CapabilityUnsupported(f"route {route.id} cannot stream", param="stream")
        seen: dict[int, list[str]] = {}
        opened = False
        cached = 0  # prompt tokens the engine said it read from its cache, so far
        async with self.paying(**terms) as pay:
            try:
                async with contextlib.AsyncExitStack() as slot:
                    pieces = await self._paced(
                        route,
                        request.max_tokens * max(1, request.n),
                        input_tokens,
                        lambda: _opened(engine.stream(request)),
                        on_send,
                        hold=slot,
                    )
                    opened = True
                    slot.push_async_callback(pieces.aclose)
                    async for piece in pieces:
                        if isinstance(piece, Completion):
                            done = piece
                            if done.raw.get("usage_missing"):
                                out = sum(count_tokens(c.text) for c in done.choices)
                                done = Completion(
                                    done.model, done.choices, Usage(input_tokens, out)
                                )
                            await self._answered(route, done)
                            await pay.settle(done.usage)
                            yield DispatchResult(done, pay.ticks, pay.reservation.id, route.id)
                            return
                        seen.setdefault(piece.index, []).append(piece.text)
                        if piece.cached_input_tokens is not None:
                            cached = piece.cached_input_tokens
                        yield piece
            except BaseException as exc:
                if pay.charged is None:
                    if opened:  # a failure before the stream opened was counted where it happened
                        self.metrics.model_call(route.id, outcome_of(exc))
                    text = "".join("".join(parts) for parts in seen.values())
                    if text:  # what was produced is paid; a stream that produced nothing is not
                        used = Usage(input_tokens, count_tokens(text), min(cached, input_tokens))
                        reason = str(getattr(exc, "code", type(exc).__name__))
                        await asyncio.shield(pay.settle(used, {"stopped": reason}))
                raise

    async def call_embed(
        self,
        *,
        route: RouteSpec,
        texts: list[str],
        input_tokens: int,
        on_send: OnSend | None = None,
    ) -> Embeddings:
        """Pace and embed on one route, billing left to the caller (as ``call`` does)."""
        engine = self.engines.for_route(route)
        if not isinstance(engine, EmbeddingEngine):
            raise CapabilityUnsupported(f"route {route.id} serves no embeddings", param="model")
        return await self._paced(
            route, 0, input_tokens, lambda: engine.embed(route.upstream_model, texts), on_send
        )

    async def embed(
        self, *, texts: list[str], input_tokens: int, **terms: Unpack[Terms]
    ) -> tuple[Embeddings, int]:
        """Reserve, embed, settle: the vectors and the charge posted."""
        async with self.paying(purpose="embeddings", **terms) as pay:
            result = await self.call_embed(
                route=terms["route"], texts=texts, input_tokens=input_tokens
            )
            used = Usage(result.usage.input_tokens or input_tokens, 0)
            await pay.settle(used)
            return Embeddings(result.vectors, used), pay.ticks

    async def score(
        self,
        *,
        route: RouteSpec,
        model: str,
        messages: list[dict[str, Any]],
        candidates: list[str],
        input_tokens: int,
    ) -> tuple[list[float], Usage]:
        """Pace and score candidate replies on one route; an upstream 429 is waited out.

        Decide's per-outcome scoring: billing stays with the caller (``reserve``
        before, ``settle`` after), because one decision may take several scoring
        calls and is paid as one.
        """
        engine = self.engines.for_route(route)
        if not isinstance(engine, ScoringEngine):
            raise TypeError(f"the engine of route {route.id!r} cannot score candidates")
        return await self._paced(
            route, len(candidates), input_tokens, lambda: engine.score(model, messages, candidates)
        )


@dataclass(eq=False)
class Payment:
    """One hold of ``Dispatcher.paying``, resolved once: settled or released."""

    dispatcher: Dispatcher
    reservation: ledger.Reservation
    model: ModelSpec
    route: RouteSpec
    price: Price
    purpose: str
    ref: str | None
    #: The ticks posted once settled (0 once released); ``None`` while held.
    charged: int | None = None

    @property
    def ticks(self) -> int:
        """The charge posted (0 before the hold resolved, or when it was released)."""
        return self.charged or 0

    async def settle(
        self,
        usage: Usage,
        detail: dict[str, Any] | None = None,
        *,
        model: ModelSpec | None = None,
        route: RouteSpec | None = None,
        price: Price | None = None,
    ) -> int:
        """Charge what the call used at the route's price (``core.quotes.charge``);
        ``model``, ``route`` and ``price``: where a call was answered by another
        (decide's fallback to the base model)."""
        self.model, self.route = model or self.model, route or self.route
        self.price = price or self.price
        priced = charge(self.price, self.route, usage)
        record = {
            "purpose": self.purpose,
            "model": self.model.id,
            "route": self.route.id,
            **priced.detail(),
            **(detail or {}),
        }
        d, res_id, now = self.dispatcher, self.reservation.id, self.dispatcher.clock.now()

        def tx(c: Connection) -> billing.Resolved:
            return billing.settle(c, res_id, priced.ticks, now, ref=self.ref, detail=record)

        # In one transaction with its activity record; a charge above the hold is recorded
        # and counted there (``store.billing``).
        settled = await asyncio.shield(d.db.write_through(tx))
        d.metrics.charged(self.purpose, from_ticks(settled.charged), from_ticks(settled.over))
        self.charged = settled.charged
        return self.charged

    async def release(self, reason: str) -> None:
        """Charge nothing: the hold is released, its record saying why."""
        self.charged = 0
        now, why = self.dispatcher.clock.now(), {"reason": reason}

        def tx(c: Connection) -> None:
            billing.release(c, self.reservation.id, now, ref=self.ref, detail=why)

        await self.dispatcher.db.write_through(tx)


def usage_of(result: object) -> Usage | None:
    """The usage an engine's answer reports: a completion's, embeddings', or a score's."""
    usage = getattr(result, "usage", None)
    if usage is None and isinstance(result, tuple) and result:
        usage = result[-1]
    return usage if isinstance(usage, Usage) else None


def outcome_of(exc: BaseException) -> str:
    """A failed call's outcome label: its wire code, ``canceled``, or ``error``."""
    if isinstance(exc, asyncio.CancelledError):
        return "canceled"
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) else "error"


def _signal_of(answer: object) -> RateLimitSignal | None:
    """The upstream's ``x-ratelimit-*`` signal an answer or a raised error carries, if any."""
    signal = getattr(answer, "rate_limit", None)
    return signal if isinstance(signal, RateLimitSignal) else None


async def _opened(
    pieces: AsyncIterator[Delta | Completion],
) -> AsyncGenerator[Delta | Completion, None]:
    """A stream opened: its first piece read (an upstream's refusal shows there), then the rest.

    Returned as a stream of its own, so the paced call that opens it can retry
    a 429 before anything reached the caller.
    """
    try:
        first = await anext(pieces)
    except StopAsyncIteration:
        raise UpstreamError("the engine's stream ended without an answer") from None
    except BaseException:
        await pieces.aclose()  # type: ignore[attr-defined]
        raise

    async def rest() -> AsyncGenerator[Delta | Completion, None]:
        try:
            yield first
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]

    return rest()
