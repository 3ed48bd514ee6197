"""The embedded engine: a GGUF model run in-process with llama-cpp, batched.

Each loaded model has one step thread (``engines.llama``): one llama context
holding many sequences, whose scheduler puts a token of every generating
request and chunks of the prompts being read into one ``llama_decode`` a step.
This module is the facade the rest of batchyard calls: it turns a chat or text
completion, a stream, a tool call or a scoring call into a job (a prompt and
its branches) and the job's events back into completions.

Scoring (``score``) reads the shared prompt once (a prompt the cache already
holds costs nothing, not even its last token) and scores every candidate as
one token trie in one decode, beside other requests' work: decide sends all
outcomes of all decisions of a text as one call.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from batchyard.core.clock import Clock, SystemClock
from batchyard.core.tokens import text_messages
from batchyard.engines import tool_calls
from batchyard.engines.llama.cache import SHELF_BYTES
from batchyard.engines.llama.context import Adapter
from batchyard.engines.llama.jobs import (
    Branch,
    BranchEnded,
    Cached,
    Done,
    Event,
    Job,
    Piece,
    Scored,
    Stopped,
)
from batchyard.engines.llama.models import (
    Model,
    VersionGate,
    VersionSpec,
    VersionState,
    check_file,
    embedding_packs,
    kv_bytes,
    open_models,
    route_llama_logs,
)
from batchyard.engines.llama.requests import candidate_tokens, check_fits, generation_job
from batchyard.engines.llama.scoring import Trie
from batchyard.engines.llama.steps import StepThread
from batchyard.engines.protocol import (
    CacheState,
    Choice,
    Completion,
    CompletionRequest,
    Delta,
    Embeddings,
    Usage,
)
from batchyard.errors import (
    ContextWindowExceeded,
    ModelNotFound,
    ServiceUnavailable,
    UnsupportedInput,
    UpstreamError,
)

__all__ = ["LlamaCppEngine", "VersionGate", "VersionSpec"]

log = logging.getLogger(__name__)


class LlamaCppEngine:
    """Chat completions and candidate scoring from a local GGUF model.

    The request's ``model`` picks a version by name; any other name means the
    base model (the catalog maps public names before the engine sees them).
    Models load lazily on first use, or ahead of time with ``load``.

    ``slots`` requests run at once (more wait their turn), each with up to
    ``n_ctx`` tokens; ``cache_tokens`` cache cells (default ``slots × n_ctx``)
    are sized up front and shared by every sequence and idle prefix;
    ``prefill_tokens`` bounds the prompt tokens read in one step, so a long
    prompt never stalls the tokens of running streams for long. Up to
    ``shelf_bytes`` of host memory a loaded model keeps prompts moved out of
    the cache, for a later request that starts like them (the scheduler's shelf).

    Versions: a LoRA adapter is loaded once, on the base model
    (``llama_adapter_lora_init``), and its requests are sequences of the base's
    scheduler, so it costs its own tensors and no second copy of the base;
    full weights are a model of their own with their own scheduler. A version
    not used for ``idle_s`` (and not kept warm, ``keep_loaded``) is unloaded by
    ``evict_idle``; loading one that would take the versions past
    ``memory_budget`` bytes first unloads the least recently used idle ones.
    """

    BASE: str | None = None

    def __init__(
        self,
        model_path: Path,
        *,
        name: str = "llama_cpp",
        n_ctx: int = 2048,
        slots: int | None = None,
        n_threads: int | None = None,
        prefill_tokens: int = 512,
        cache_tokens: int | None = None,
        shelf_bytes: int = SHELF_BYTES,
        versions: dict[str, VersionSpec] | None = None,
        score_turn_end: bool = False,
        clock: Clock | None = None,
        idle_s: float | None = None,
        memory_budget: int | None = None,
        gate: VersionGate | None = None,
    ) -> None:
        self.name = name
        # Times loads, and idle time for eviction (tests move a ManualClock).
        self.clock: Clock = clock or SystemClock()
        # Off by default: small models rarely end a turn right after a bare
        # label ("Positive" then EOT can be 1e-7 likely while "Positive." is
        # not), so requiring the end token buries the signal in noise. Turn it
        # on when candidates are prefixes of each other ("no" / "not sure").
        self.score_turn_end = score_turn_end
        self.model_path = Path(model_path)
        self.n_ctx = n_ctx
        self.slots = max(1, slots or 8)
        self.n_threads = n_threads or max(1, os.cpu_count() or 1)
        self.prefill_tokens = max(16, prefill_tokens)
        self.cache_tokens = cache_tokens or self.slots * n_ctx
        self.shelf_bytes = max(0, shelf_bytes)
        self.idle_s = idle_s
        self.memory_budget = memory_budget
        self._gate = gate
        self.versions: dict[str, VersionSpec] = dict(versions or {})
        self.last_load_seconds: float | None = None
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-load")
        self._states: dict[str | None, VersionState] = {None: VersionState(None, None)}
        for version, spec in self.versions.items():
            self._states[version] = VersionState(version, spec)
        self._embedding_model: Any = None
        self._embed_lock = asyncio.Lock()

    # -- load state ------------------------------------------------------------

    def version_for(self, model: str) -> str | None:
        return model if model in self.versions else None

    @property
    def loaded(self) -> bool:
        return self._states[None].loaded

    def is_loaded(self, version: str | None = None) -> bool:
        return self._states[self._known(version)].loaded

    def load_seconds(self, version: str | None = None) -> float | None:
        """How long the last load of ``version`` took, as measured."""
        return self._states[self._known(version)].load_seconds

    def warm_until(self, version: str) -> float | None:
        """When a loaded ``version`` becomes evictable (clock seconds); None: not loaded."""
        state = self._states[self._known(version)]
        if not state.loaded:
            return None
        if state.active or self.idle_s is None:
            return max(self.clock.time() + (self.idle_s or 0.0), state.keep_until)
        return max(state.last_used + self.idle_s, state.keep_until)

    def version_bytes(self, version: str) -> int:
        """What ``version`` holds in memory once loaded: measured when loaded, else estimated.

        An adapter: its tensors (about its file's size); its prompts share the base's
        cache and shelf. Full weights: the model's tensors, its own KV cache of
        ``cache_tokens`` cells, and the shelf its scheduler may fill (``shelf_bytes``).
        """
        state = self._states[self._known(version)]
        if state.adapter is not None:
            return state.adapter.bytes
        if state.model is not None:
            import llama_cpp

            size = int(llama_cpp.llama_model_size(state.model.llama._model.model))
            kv = kv_bytes(state.model.llama, state.model.steps.ctx.n_cells)
            return size + kv + self.shelf_bytes
        spec = self.versions[version]
        try:
            size = spec.path.stat().st_size
        except OSError:
            size = 0
        base = self._states[None].model
        if spec.kind == "gguf":
            size += self.shelf_bytes
            if base is not None:
                size += kv_bytes(base.llama, base.steps.ctx.n_cells)
        return size

    async def cache_states(self) -> list[CacheState]:
        """Each loaded model's shelf: the base's, and each full-weights version's."""
        states = []
        for version, state in list(self._states.items()):
            if state.model is not None:
                held, prompts = await state.model.steps.shelf_state()
                states.append(CacheState(version or "base", held, prompts))
        return states

    def loaded_versions(self) -> list[str]:
        return [v for v, s in self._states.items() if v is not None and s.loaded]

    def _known(self, version: str | None) -> str | None:
        if version is not None and version not in self.versions:
            raise KeyError(f"unknown model version {version!r}")
        return version

    async def load(self) -> None:
        await self.load_version(None)

    def _build(self, path: Path) -> Model:
        """Load a GGUF as a model of its own with its step thread (on the loading thread)."""
        import llama_cpp

        # The Llama holds the weights, vocabulary and template; its own
        # context is kept small, the scheduler's context does the work.
        llama = llama_cpp.Llama(str(path), n_ctx=256, n_batch=64, n_threads=1, verbose=False)
        route_llama_logs()
        try:
            steps = StepThread.open(
                llama,
                slots=self.slots,
                n_ctx=self.n_ctx,
                cache_tokens=self.cache_tokens,
                threads=self.n_threads,
                prefill_tokens=self.prefill_tokens,
                shelf_bytes=self.shelf_bytes,
            )
        except BaseException:
            llama.close()
            raise
        return Model(llama, steps)

    def _load_adapter(self, version: str, spec: VersionSpec, base: Model) -> Adapter:
        """Load a LoRA adapter on the base model (on the loading thread)."""
        import llama_cpp

        check_file(version, spec)
        handle = llama_cpp.llama_adapter_lora_init(base.llama._model.model, str(spec.path).encode())
        if not handle:
            raise ValueError(f"llama.cpp refused the adapter {spec.path.name}")
        return Adapter(version, handle, 1.0, bytes=spec.path.stat().st_size)

    async def load_version(self, version: str | None) -> float:
        """Load ``version`` (``None``: the base) if needed; returns the load's measured seconds.

        A LoRA version loads the base first. Before a version loads, idle
        versions are unloaded while the versions would exceed ``memory_budget``.
        """
        state = self._states[self._known(version)]
        base: Model | None = None
        if state.lora:
            await self.load_version(None)
            base = self._states[None].model
        async with state.lock:
            if state.loaded:
                return state.load_seconds or 0.0
            if version is not None:
                await self._make_room(version)
            loop = asyncio.get_running_loop()
            started = self.clock.time()
            spec = state.spec
            try:
                if spec is None:
                    model = await loop.run_in_executor(self._loader, self._build, self.model_path)
                elif spec.kind == "lora":
                    assert base is not None and version is not None
                    state.adapter = await loop.run_in_executor(
                        self._loader, self._load_adapter, version, spec, base
                    )
                else:
                    assert version is not None

                    def build() -> Model:
                        check_file(version, spec)
                        return self._build(spec.path)

                    model = await loop.run_in_executor(self._loader, build)
            except (ValueError, OSError, RuntimeError) as exc:
                raise UpstreamError(
                    f"could not load model version {version or 'base'}: {exc}",
                    code="model_load_failed",
                    retryable=False,
                ) from None
            elapsed = self.clock.time() - started
            if not state.lora:
                model.version = version
                state.model = model
                open_models.add(model)
            state.last_used = self.clock.time()
            state.load_seconds = self.last_load_seconds = elapsed
            log.info(
                "model loaded",
                extra={"engine": self.name, "version": version or "base", "seconds": elapsed},
            )
            return elapsed

    async def unload_version(self, version: str | None) -> None:
        """Free a version's memory; requests still running on it fail as retryable.

        Unloading the base unloads its LoRA versions first (their adapters live
        on the base model).
        """
        state = self._states[self._known(version)]
        if version is None:
            for other in [v for v, s in self._states.items() if s.lora and s.adapter]:
                await self.unload_version(other)
        async with state.lock:
            model, state.model = state.model, None
            adapter, state.adapter = state.adapter, None
            loop = asyncio.get_running_loop()
            if adapter is not None:
                base = self._states[None].model
                if base is not None:
                    import llama_cpp

                    def free() -> None:
                        llama_cpp.llama_adapter_lora_free(adapter.handle)

                    done = base.steps.release(adapter, free)
                    await loop.run_in_executor(self._loader, done.wait)
            if model is not None:
                open_models.discard(model)
                await loop.run_in_executor(self._loader, model.close)
        if version is not None and (adapter is not None or model is not None):
            log.info("model version unloaded", extra={"engine": self.name, "version": version})

    # -- warmth: idle time, keep-warm and the memory budget ---------------------------

    def keep_loaded(self, version: str, until: float) -> None:
        """Keep ``version`` loaded until ``until`` (clock seconds), whatever its idle time."""
        state = self._states[self._known(version)]
        state.keep_until = max(state.keep_until, until)

    def _evictable(self, state: VersionState, now: float) -> bool:
        return (
            state.version is not None
            and state.loaded
            and not state.active
            and (state.keep_until <= now)
        )

    async def evict_idle(self) -> list[str]:
        """Unload versions idle for ``idle_s`` (not kept warm, nothing running), and
        versions the gate says are gone (deleted through another process)."""
        now = self.clock.time()
        gone: list[str] = []
        for version, state in list(self._states.items()):
            if version is None or not state.loaded:
                continue
            if self._gate is not None and not await self._gate(version):
                await self.remove_version(version)
                gone.append(version)
            elif (
                self.idle_s is not None
                and self._evictable(state, now)
                and now >= state.last_used + self.idle_s
            ):
                await self.unload_version(version)
                gone.append(version)
        return gone

    async def _make_room(self, version: str) -> None:
        """Unload idle versions, least recently used first, until ``version`` fits the budget."""
        if self.memory_budget is None:
            return
        need = self.version_bytes(version)
        now = self.clock.time()
        while True:
            loaded = [self._states[v] for v in self.loaded_versions() if v != version]
            used = sum(self.version_bytes(s.version) for s in loaded if s.version is not None)
            if used + need <= self.memory_budget:
                return
            idle = sorted((s for s in loaded if self._evictable(s, now)), key=lambda s: s.last_used)
            if not idle:
                raise ServiceUnavailable(
                    f"model version {version} needs {need} bytes and the versions loaded "
                    f"here hold {used} of the {self.memory_budget}-byte budget; each is in use "
                    "or kept warm. Send the request again later",
                    code="model_memory_full",
                    retryable=True,
                    retry_after=30,
                )
            assert idle[0].version is not None
            log.info(
                "model version evicted for memory",
                extra={"engine": self.name, "version": idle[0].version, "for": version},
            )
            await self.unload_version(idle[0].version)

    # -- versions registered at run time (project model versions) -----------------
    # Versions uploaded into a project arrive after the engine is built.

    def add_version(self, name: str, spec: VersionSpec) -> None:
        """Serve ``name`` from ``spec`` from now on; loaded on first use (or ``load_version``)."""
        if self.versions.get(name) == spec:
            return
        if name in self.versions:
            raise ValueError(f"model version {name!r} is already served from another file")
        self.versions[name] = spec
        self._states[name] = VersionState(name, spec)

    async def remove_version(self, name: str) -> None:
        """Stop serving ``name`` and free its memory."""
        if name not in self.versions:
            return
        if self._states[name].loaded:
            await self.unload_version(name)
        self._states.pop(name, None)
        self.versions.pop(name, None)

    # -- running ------------------------------------------------------------------

    async def _model(self, version: str | None) -> Model:
        """The model that runs ``version``'s requests (a LoRA's: the base), loaded.

        A version is first checked with the gate: one deleted through another
        process is forgotten here and answered as a model that does not exist.
        """
        if version is not None and self._gate is not None and not await self._gate(version):
            await self.remove_version(version)
            raise ModelNotFound(f"the model {version!r} does not exist", param="model")
        state = self._states[version]
        if not state.loaded:
            await self.load_version(version)
        model = self._states[None].model if state.lora else state.model
        assert model is not None
        return model

    def _adapter(self, request_model: str) -> Adapter | None:
        """The adapter of a LoRA version's requests (None: the model's own weights)."""
        version = self.version_for(request_model)
        return self._states[version].adapter if version is not None else None

    async def _run(
        self, model: Model, job: Job, hangup: asyncio.Event | None = None
    ) -> AsyncIterator[Event]:
        """``model.steps.run(job)``, counted as its version's use (for idle eviction).

        ``hangup`` set (the caller hung up) stops the job at the scheduler's
        next step (``StepThread.stop``): what it produced is its answer; a job
        that had produced nothing ends ``Stopped``, a 499 nobody reads.
        """
        state = self._states.get(job.adapter.name if job.adapter is not None else model.version)
        if state is None:
            state = self._states[None]
        state.active += 1

        async def stop_on_hangup(hangup: asyncio.Event) -> None:
            await hangup.wait()
            model.steps.stop(job)

        watch = None if hangup is None else asyncio.create_task(stop_on_hangup(hangup))
        try:
            async for event in model.steps.run(job):
                if isinstance(event, Stopped):
                    raise UpstreamError(
                        "the caller hung up before its answer began",
                        code="client_disconnected",
                        status=499,
                        retryable=True,
                    )
                yield event
        finally:
            if watch is not None:
                watch.cancel()
            state.active -= 1
            state.last_used = self.clock.time()

    def _job(self, model: Model, request: CompletionRequest) -> tuple[Job, bool]:
        return generation_job(
            model,
            request,
            name=self.name,
            n_ctx=self.n_ctx,
            adapter=self._adapter(request.model),
        )

    async def complete(self, request: CompletionRequest) -> Completion:
        model = await self._model(self.version_for(request.model))
        job, tools = self._job(model, request)
        job.whole = True
        n = len(job.branches)
        texts = [""] * n
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        finishes = ["stop"] * n
        matched: list[str | None] = [None] * n
        out = [0] * n
        prompt_tokens = cached = 0
        async for event in self._run(model, job, request.hangup):
            if isinstance(event, Piece):
                texts[event.branch] += event.text
                if event.entries:
                    logprobs[event.branch].extend(event.entries)
            elif isinstance(event, BranchEnded):
                i = event.branch
                texts[i] += event.tail
                finishes[i], out[i], matched[i] = event.finish, event.tokens, event.stop
            elif isinstance(event, Done):
                prompt_tokens, cached = event.prompt_tokens, event.cached
        choices = []
        for i in range(n):
            text, finish, calls = texts[i], finishes[i], None
            if tools:
                text, calls = tool_calls.parse_answer(
                    text, request.tools or [], request.tool_choice, finish_reason=finish
                )
                # A plain reply cut at max_tokens says so; a complete one stopped.
                finish = "tool_calls" if calls else ("length" if finish == "length" else "stop")
            wanted = request.logprobs and calls is None
            choices.append(
                Choice(
                    text=text,
                    finish_reason=finish,
                    logprobs=logprobs[i] if wanted else None,
                    tool_calls=calls,
                    stop_sequence=matched[i] if calls is None else None,
                )
            )
        return Completion(
            model=request.model,
            choices=choices,
            usage=Usage(prompt_tokens, sum(out), cached_input_tokens=cached),
        )

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        """Token by token as the scheduler samples them; closing the iterator ends the sequence.

        Tool calls and several samples are produced whole (a tool call is one
        grammar-checked object) and sent as one piece each.
        """
        model = await self._model(self.version_for(request.model))
        job, tools = self._job(model, request)
        if tools or request.n > 1 or request.logprobs:
            done = await self.complete(request)
            for i, choice in enumerate(done.choices):
                yield Delta(
                    i, choice.text, choice.tool_calls, choice.logprobs, choice.finish_reason
                )
            yield done
            return
        text: list[str] = []
        finish, out, stop = "stop", 0, None
        # What the cache gave of the prompt, told with the next piece (``Delta``'s field).
        cached: int | None = None
        async for event in self._run(model, job):
            if isinstance(event, Cached):
                cached = event.tokens
            elif isinstance(event, Piece) and event.text:
                text.append(event.text)
                yield Delta(0, event.text, cached_input_tokens=cached)
                cached = None
            elif isinstance(event, BranchEnded):
                tail, finish, out, stop = event.tail, event.finish, event.tokens, event.stop
                if tail:
                    text.append(tail)
                    yield Delta(0, tail, cached_input_tokens=cached)
                    cached = None
            elif isinstance(event, Done):
                yield Delta(0, "", finish_reason=finish)
                yield Completion(
                    model=request.model,
                    choices=[Choice(text="".join(text), finish_reason=finish, stop_sequence=stop)],
                    usage=Usage(event.prompt_tokens, out, cached_input_tokens=event.cached),
                )

    async def embed(self, model: str, texts: list[str]) -> Embeddings:
        """Mean-pooled, unit-length vectors from the model's own hidden states.

        The embedded default has no embedding model of its own: these come from
        SmolLM2 itself, fine for trying the endpoint and for rough similarity,
        not a replacement for a trained embedding model on a route of its own.
        A version has none of its own (they would be the base's), so it is refused.
        """
        if self.version_for(model) is not None:
            raise UnsupportedInput(
                f"{model} is a fine-tuned version; embeddings come from its base model",
                param="model",
            )
        embedder = await self._embedder()

        def work() -> Embeddings:
            tokenize = embedder.tokenize
            counts = [len(tokenize(t.encode("utf-8"), True, False)) for t in texts]
            if max(counts) > embedder.n_ctx():
                raise ContextWindowExceeded(
                    f"an input is {max(counts)} tokens, over the {embedder.n_ctx()}-token "
                    "window of the embedding model",
                    param="input",
                )
            vectors: list[list[float]] = [[] for _ in texts]
            for pack in embedding_packs(counts):
                got = embedder.embed([texts[i] for i in pack], normalize=True)
                for i, vector in zip(pack, got, strict=True):
                    vectors[i] = list(map(float, vector))
            return Embeddings(vectors, Usage(sum(counts), 0))

        # On the base model's step thread, between its steps: one thread decodes for the
        # whole process, so llama.cpp's OpenMP threads stay one team (``StepThread.call``).
        base = await self._model(None)
        async with self._embed_lock:
            return await base.steps.call(work)

    async def _embedder(self) -> Any:
        async with self._embed_lock:
            if self._embedding_model is None:
                import llama_cpp

                def load() -> Any:
                    return llama_cpp.Llama(
                        str(self.model_path),
                        n_ctx=self.n_ctx,
                        n_batch=self.n_ctx,
                        n_ubatch=self.n_ctx,
                        n_threads=self.n_threads,
                        embedding=True,
                        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                        # As the scheduler's context: with it, a row's attention skips
                        # other sequences' cells, so inputs read together in one decode
                        # (``embedding_packs``) get the vectors they get alone.
                        flash_attn=True,
                        verbose=False,
                    )

                loop = asyncio.get_running_loop()
                self._embedding_model = await loop.run_in_executor(self._loader, load)
            return self._embedding_model

    async def score(
        self, model: str, messages: list[dict[str, Any]], candidates: list[str]
    ) -> tuple[list[float], Usage]:
        """Log-probability of each candidate as the assistant's reply (its opening,
        or the complete reply when ``score_turn_end``).

        Usage: ``input_tokens`` is the prompt, evaluated once (``cached_input_tokens``
        of it came from the cache); ``output_tokens`` is the SUM of every
        candidate's tokens (with the end-of-turn token when ``score_turn_end``),
        as each one is scored (openings they share are decoded once).
        """
        plain, images = text_messages(messages)
        if images:
            raise UnsupportedInput(f"{self.name} reads text only; the request has image parts")
        if not candidates:
            return [], Usage(input_tokens=0, output_tokens=0)
        loaded = await self._model(self.version_for(model))
        prompt_text = loaded.prompt_text(plain)
        prompt = loaded.llama.tokenize(prompt_text.encode("utf-8"), add_bos=False, special=True)
        conts = candidate_tokens(
            loaded, prompt_text, prompt, candidates, turn_end=self.score_turn_end
        )
        longest = max(len(c) for c in conts)
        if len(prompt) + longest > self.n_ctx:
            raise ContextWindowExceeded(
                f"prompt ({len(prompt)} tokens) and the longest candidate ({longest}) "
                f"exceed the context window of {self.n_ctx}"
            )
        trie = Trie(conts)
        job = Job(
            prompt,
            [Branch() for _ in range(trie.tips)],
            adapter=self._adapter(model),
            trie=trie,
        )
        check_fits(loaded, job)
        capacity = loaded.steps.ctx.capacity
        if len(trie.nodes) > capacity:
            raise ContextWindowExceeded(
                f"the candidates need {len(trie.nodes)} tokens decoded at once; "
                f"a step of the embedded model holds {capacity}"
            )
        scores: list[float] = []
        cached = 0
        async for event in self._run(loaded, job):
            if isinstance(event, Scored):
                scores = [sum(lps) for lps in event.scores]
            elif isinstance(event, Done):
                cached = event.cached
        usage = Usage(len(prompt), sum(len(c) for c in conts), cached_input_tokens=cached)
        return scores, usage

    async def aclose(self) -> None:
        if self._embedding_model is not None:
            self._embedding_model.close()
            self._embedding_model = None
        for version, state in self._states.items():
            if state.loaded:
                await self.unload_version(version)
        self._loader.shutdown(wait=False)
