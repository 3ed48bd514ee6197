"""Engines for routes, built once and shared.

Routes name an engine kind and an endpoint; this registry turns them into
live engines lazily (the embedded model loads on first use, not at import),
and shares one embedded engine between every route that points at it.

The versions a route lists (``version:`` in the config file, or a project's
uploaded versions, which the catalog adds at run time) reach an engine that
can serve them (``add_version``: the embedded one) whenever the route's engine
is asked for: a LoRA adapter (``lora_path``) on the route's base GGUF, or full
weights of their own (``model_path``), with the file's ``sha256`` when the
store knows it. An entry with neither is a name the upstream itself serves,
passed through as the request's model.

The embedded engine also gets the deployment's clock, how long an idle
version stays loaded, the memory budget of its versions, and the gate that
tells it whether a version is still served (``model_versions`` settings,
``service.model_versions.gate``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from batchyard.core.catalog import ENGINES, Catalog, RouteSpec, engine_name
from batchyard.core.clock import Clock
from batchyard.core.config_errors import ConfigError
from batchyard.engines.protocol import CacheReporting, CacheState, Engine

__all__ = ["EngineRegistry"]


class EngineRegistry:
    def __init__(
        self,
        *,
        embedded_model_path: str | None = None,
        embedded_slots: int = 8,
        embedded_n_ctx: int = 2048,
        embedded_threads: int | None = None,
        embedded_prefill_tokens: int = 512,
        embedded_cache_tokens: int | None = None,
        embedded_shelf_mb: int = 256,
        overrides: dict[str, Engine] | None = None,
        clock: Clock | None = None,
        version_idle_s: float | None = None,
        version_memory_bytes: int | None = None,
    ) -> None:
        self._embedded_model_path = embedded_model_path
        self._slots = embedded_slots
        self._n_ctx = embedded_n_ctx
        self._threads = embedded_threads
        self._prefill = embedded_prefill_tokens
        self._cache = embedded_cache_tokens
        self._shelf_mb = embedded_shelf_mb
        self._clock = clock
        self._idle_s = version_idle_s
        self._budget = version_memory_bytes
        self._gate: Callable[[str], Awaitable[bool]] | None = None
        self._engines: dict[str, Engine] = dict(overrides or {})
        self._embedded: Engine | None = None
        self._lock = asyncio.Lock()

    def gate_with(self, gate: Callable[[str], Awaitable[bool]]) -> None:
        """Whether a version is still served, asked by the embedded engine before each use."""
        self._gate = gate

    async def _gate_call(self, name: str) -> bool:
        return True if self._gate is None else await self._gate(name)

    def set(self, route_id: str, engine: Engine) -> None:
        """Put an engine behind a route (tests and embedding applications)."""
        self._engines[route_id] = engine

    def slots(self, route: RouteSpec) -> int | None:
        """How many calls the route's engine runs at once, where it has a bound.

        The engine's own ``contexts`` (the embedded model's sequences), or, for
        an embedded route whose engine does not say, the configured slots;
        ``None`` for an upstream that says nothing.
        """
        contexts = getattr(self.for_route(route), "contexts", None)
        if isinstance(contexts, int) and contexts > 0:
            return contexts
        return max(1, self._slots) if route.engine == "llama_cpp" else None

    def embedded(self) -> Engine:
        if self._embedded is None:
            from batchyard.engines.llama_cpp import LlamaCppEngine
            from batchyard.engines.model_files import default_model_path

            path = (
                Path(self._embedded_model_path)
                if self._embedded_model_path
                else default_model_path()
            )
            self._embedded = LlamaCppEngine(
                path,
                slots=self._slots,
                n_ctx=self._n_ctx,
                n_threads=self._threads,
                prefill_tokens=self._prefill,
                cache_tokens=self._cache,
                shelf_bytes=self._shelf_mb << 20,
                clock=self._clock,
                idle_s=self._idle_s,
                memory_budget=self._budget,
                gate=self._gate_call,
            )
        return self._embedded

    async def cache_states(self) -> list[CacheState]:
        """The embedded model's shelves, where it is loaded in this process (``/metrics``)."""
        engine = self._embedded
        return await engine.cache_states() if isinstance(engine, CacheReporting) else []

    def check(self, catalog: Catalog) -> None:
        """Every route of ``catalog`` can get an engine: refused at start, not per call.

        Raises ``ConfigError`` naming the route (``routes[1].api_key_env``). Routes
        with an engine put behind them (``overrides``, ``set``) need nothing more.
        """
        for i, route in enumerate(catalog.routes.values()):
            if route.id in self._engines:
                continue
            where = f"routes[{i}]"
            if route.engine not in ENGINES:
                raise ConfigError(
                    f"{where}.engine",
                    f"unknown engine {route.engine!r} (known: {', '.join(ENGINES)})",
                    "fix the route or remove it",
                )
            if route.engine == "openai_http" and not route.base_url:
                raise ConfigError(
                    f"{where}.base_url",
                    f"route {route.id!r} (openai_http) has no base URL",
                    "add base_url: http://host:port/v1",
                )
            if route.api_key_env and not os.environ.get(route.api_key_env):
                raise ConfigError(
                    f"{where}.api_key_env",
                    f"the environment variable {route.api_key_env} is not set",
                    "export it with the upstream's key, or remove api_key_env if it needs none",
                )

    def for_route(self, route: RouteSpec) -> Engine:
        engine = self._engines.get(route.id)
        if engine is not None:
            self._serve_versions(engine, route)
            return engine
        if route.engine == "llama_cpp":
            engine = self.embedded()
        elif route.engine == "memory":
            from batchyard.engines.scripted import ScriptedEngine

            engine = ScriptedEngine(name=route.id)
        else:
            from batchyard.engines.openai_http import OpenAIHttpEngine

            if not route.base_url:
                raise ValueError(f"route {route.id!r} needs a base_url")
            key = os.environ.get(route.api_key_env) if route.api_key_env else None
            engine = OpenAIHttpEngine(route.base_url, key, timeout_s=route.timeout_s, name=route.id)
        self._engines[route.id] = engine
        self._serve_versions(engine, route)
        return engine

    def _serve_versions(self, engine: Engine, route: RouteSpec) -> None:
        add = getattr(engine, "add_version", None)
        if not callable(add) or not route.version:
            return
        for model_id, extras in list(route.version.items()):
            spec = _version_spec(extras)
            if spec is not None:
                add(engine_name(model_id, route), spec)

    async def forget_version(self, route: RouteSpec, model_id: str) -> None:
        """Stop serving a deleted version on ``route``'s engine, freeing its memory."""
        engine = self._engines.get(route.id)
        remove = getattr(engine, "remove_version", None)
        if callable(remove):
            await remove(engine_name(model_id, route))

    def live(self) -> list[Engine]:
        """Each engine built so far, once (the warmth sweep asks them to evict)."""
        found: dict[int, Engine] = {}
        for engine in [*self._engines.values(), *([self._embedded] if self._embedded else [])]:
            found.setdefault(id(engine), engine)
        return list(found.values())

    async def aclose(self) -> None:
        seen: set[int] = set()
        for engine in [*self._engines.values(), *([self._embedded] if self._embedded else [])]:
            if id(engine) not in seen:
                seen.add(id(engine))
                await engine.aclose()


def _version_spec(extras: Any) -> Any:
    """The embedded engine's ``VersionSpec`` for a route's version entry, or None."""
    if not isinstance(extras, dict):
        return None
    from batchyard.engines.llama_cpp import VersionSpec

    digest = extras.get("sha256")
    sha256 = str(digest) if digest else None
    if extras.get("lora_path"):
        return VersionSpec("lora", Path(str(extras["lora_path"])), sha256)
    if extras.get("model_path"):
        return VersionSpec("gguf", Path(str(extras["model_path"])), sha256)
    return None
