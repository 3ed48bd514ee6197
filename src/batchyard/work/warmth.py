"""Whether a fine-tuned model version is loaded, and waiting for it when it is not.

A version that has been idle may need to load before it can answer
(docs/how-to/model-versions.md). How long that takes is *observed*, never
assumed: the load starts as a task (the engine's ``load_version`` where it has
one, otherwise the first call itself) and the caller waits on the injected
clock for at most its budget. Decide then either answers with the base model
(``fallback: base``, after ``warm_fallback_after_s``) or keeps waiting, bounded,
and fails retryably. The load goes on in the background either way, so the
next call finds the version warm.

Where the engine can say what it holds (the embedded engine: ``is_loaded``),
its word is the state: a version is warm while loaded, and the engine itself
counts every request on it (every door, not only decide), unloads it once it
has been idle for ``idle_s`` past any keep-warm window (``evict_idle``, called
by the background sweep), and unloads idle ones to keep its versions within
its memory budget. A remote version counts as warm until it has been idle for
``idle_s`` and any keep-warm window has passed. The state is per server
process: each process loads its own copy of an embedded model, and a remote
route's load is only seen by the process that waited for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.core.clock import Clock, isoformat
from batchyard.engines.protocol import CompletionRequest
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.engines import EngineRegistry

__all__ = [
    "IDLE_S",
    "SWEEP_EVERY_S",
    "Serving",
    "WarmView",
    "Warmth",
    "serving",
]

log = logging.getLogger("batchyard.warmth")

T = TypeVar("T")

# How long a version stays loaded after its last call, without a keep-warm window.
IDLE_S = 15 * 60.0
SWEEP_EVERY_S = 60.0
MAX_KEEP_WARM_MINUTES = 24 * 60

State = Literal["cold", "loading", "warm"]


@dataclass(frozen=True, slots=True)
class Serving:
    """Who answers a model: its route, the name the engine knows it by."""

    route: RouteSpec
    upstream_model: str


def serving(catalog: Catalog, model: ModelSpec) -> Serving:
    """The route that serves ``model``: its own route, or a base route listing the version."""
    route, name = catalog.serving(model.id)
    return Serving(route, name)


@dataclass(frozen=True, slots=True)
class WarmView:
    state: State
    until: datetime | None
    last_load_seconds: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "until": isoformat(self.until) if self.until is not None else None,
            "last_load_seconds": self.last_load_seconds,
        }


@dataclass
class _Version:
    serving: Serving
    loading: asyncio.Task[Any] | None = None
    loaded: bool = False
    last_used: float = 0.0
    keep_until: float = 0.0
    last_load_seconds: float | None = None


class Warmth:
    """The warm state of every model version this process has been asked for."""

    def __init__(
        self,
        *,
        clock: Clock,
        engines: EngineRegistry,
        dispatcher: Dispatcher,
        idle_s: float = IDLE_S,
    ) -> None:
        self.clock = clock
        self.engines = engines
        self.dispatcher = dispatcher
        self.idle_s = idle_s
        self._versions: dict[str, _Version] = {}

    # -- state ------------------------------------------------------------------

    def _version(self, model_id: str, where: Serving) -> _Version:
        v = self._versions.get(model_id)
        if v is None:
            v = self._versions[model_id] = _Version(where)
        v.serving = where
        return v

    def _engine_loaded(self, v: _Version) -> bool | None:
        """The engine's own word on whether the version is loaded, where it can say."""
        engine = self.engines.for_route(v.serving.route)
        is_loaded = getattr(engine, "is_loaded", None)
        if not callable(is_loaded):
            return None
        try:
            return bool(is_loaded(v.serving.upstream_model))
        except KeyError:
            return None

    def _expired(self, v: _Version, now: float) -> bool:
        return now >= max(v.last_used + self.idle_s, v.keep_until)

    def _state(self, v: _Version) -> State:
        if v.loading is not None and not v.loading.done():
            return "loading"
        engine_says = self._engine_loaded(v)
        if engine_says is not None:
            # The engine unloads idle versions itself: loaded is warm.
            v.loaded = engine_says
            return "warm" if engine_says else "cold"
        if v.loaded and not self._expired(v, self.clock.time()):
            return "warm"
        return "cold"

    def _engine_until(self, v: _Version) -> float | None:
        """When the engine will unload a loaded version, where it can say."""
        until = getattr(self.engines.for_route(v.serving.route), "warm_until", None)
        if not callable(until):
            return None
        try:
            found = until(v.serving.upstream_model)
        except KeyError:
            return None
        return float(found) if found is not None else None

    def view(self, model_id: str, where: Serving) -> WarmView:
        v = self._version(model_id, where)
        state = self._state(v)
        now = self.clock.time()
        until: float | None = None
        if state == "warm":
            until = self._engine_until(v) or max(v.last_used + self.idle_s, v.keep_until)
        elif v.keep_until > now:
            until = v.keep_until
        when = datetime.fromtimestamp(until, tz=UTC) if until is not None else None
        return WarmView(state, when, v.last_load_seconds)

    # -- loading ----------------------------------------------------------------

    def _loader(self, v: _Version) -> Callable[[], Awaitable[Any]] | None:
        engine = self.engines.for_route(v.serving.route)
        load = getattr(engine, "load_version", None)
        if not callable(load) or self._engine_loaded(v) is None:
            return None
        name = v.serving.upstream_model

        async def run() -> Any:
            return await load(name)

        return run

    def _start(
        self, model_id: str, v: _Version, work: Callable[[], Awaitable[T]]
    ) -> asyncio.Task[T]:
        """Run ``work`` as the version's load, timing it on the clock."""

        async def load() -> T:
            started = self.clock.time()
            try:
                result = await work()
            finally:
                v.loading = None
            now = self.clock.time()
            v.loaded, v.last_used, v.last_load_seconds = True, now, now - started
            log.info("model version loaded", extra={"model": model_id, "seconds": now - started})
            return result

        task = asyncio.ensure_future(load())
        v.loading = task
        task.add_done_callback(_log_failure(model_id))
        return task

    async def _wait(self, task: asyncio.Future[Any], wait_s: float) -> bool:
        """Wait for ``task`` at most ``wait_s`` of clock time; whether it finished."""
        if task.done():
            return True
        # The budget runs from this call, not from the sleeper's first turn: on a
        # busy loop that turn can come after the clock has already moved.
        deadline = self.clock.time() + wait_s

        async def until_deadline() -> None:
            await self.clock.sleep(deadline - self.clock.time())

        sleeper = asyncio.ensure_future(until_deadline())
        try:
            await asyncio.wait({task, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
        return task.done()

    async def run(
        self,
        model_id: str,
        where: Serving,
        call: Callable[[], Awaitable[T]],
        *,
        wait_s: float,
    ) -> tuple[bool, T | None]:
        """``(True, result)`` once the version is warm, or ``(False, None)`` after ``wait_s``.

        Where the engine cannot load ahead, ``call`` itself is the load; a call
        given up on keeps running in the background (its result is dropped, so
        ``call`` must not bill anyone) and marks the version warm when it ends.
        """
        v = self._version(model_id, where)
        if self._state(v) == "warm":
            v.last_used = self.clock.time()
            return True, await call()
        loader = self._loader(v)
        if v.loading is None and loader is None:
            task = self._start(model_id, v, call)
            if not await self._wait(task, wait_s):
                return False, None
            return True, task.result()
        # Someone else's load is in flight, or the engine can load ahead.
        pending = v.loading or self._start(model_id, v, loader or call)
        if not await self._wait(pending, wait_s):
            return False, None
        if loader is not None:
            pending.result()  # a failed load fails this call too
        v.last_used = self.clock.time()
        return True, await call()

    def keep_warm(self, model_id: str, where: Serving, minutes: float) -> WarmView:
        """Keep the version loaded for ``minutes`` from now, starting its load if cold."""
        v = self._version(model_id, where)
        v.keep_until = max(v.keep_until, self.clock.time() + minutes * 60.0)
        keep = getattr(self.engines.for_route(where.route), "keep_loaded", None)
        if callable(keep) and self._engine_loaded(v) is not None:
            keep(where.upstream_model, v.keep_until)
        if self._state(v) == "cold":
            self._start(model_id, v, self._loader(v) or self._probe(v))
        return self.view(model_id, where)

    def _probe(self, v: _Version) -> Callable[[], Awaitable[Any]]:
        """The smallest call that makes a remote version load (the operator's cost)."""
        route, name = v.serving.route, v.serving.upstream_model
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Ready?"}]

        async def probe() -> Any:
            if self.dispatcher.can_score(route):
                return await self.dispatcher.score(
                    route=route, model=name, messages=messages, candidates=["Yes"], input_tokens=8
                )
            request = CompletionRequest(model=name, messages=messages, max_tokens=1)
            return await self.dispatcher.call(route=route, request=request, input_tokens=8)

        return probe

    # -- going cold ---------------------------------------------------------------

    async def sweep(self) -> None:
        """Let each engine unload its idle versions; mark idle remote versions cold."""
        for engine in self.engines.live():
            evict = getattr(engine, "evict_idle", None)
            if callable(evict):
                for name in await evict():
                    log.info("model version went cold", extra={"model": name})
        now = self.clock.time()
        for model_id, v in list(self._versions.items()):
            if self._engine_loaded(v) is not None:
                continue  # the engine's own sweep, above
            if not v.loaded or v.loading is not None or not self._expired(v, now):
                continue
            v.loaded = False
            log.info("model version went cold", extra={"model": model_id})

    async def aclose(self) -> None:
        """Stop loads still in flight (the service is going down)."""
        tasks = [v.loading for v in self._versions.values() if v.loading is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _log_failure(model_id: str) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.info(
                "model version load failed",
                extra={"model": model_id, "error": getattr(exc, "code", type(exc).__name__)},
            )

    return done
