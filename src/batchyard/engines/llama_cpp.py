"""The embedded engine: a GGUF model run in-process with llama-cpp, batched.

Each loaded version of the model is one ``Scheduler``
(``engines.llama_scheduler``): one llama context holding many sequences and
one thread that decodes all of them together, a token of every generating
request and chunks of the prompts being read in one ``llama_decode`` a step.
This module is the facade the rest of batchyard calls: it turns a chat or
text completion, a stream, a tool call or a scoring call into a job (a
prompt and its branches) and the job's events back into completions.

Scoring (``score``) reads the shared prompt once (a prompt the cache already
holds costs nothing, not even its last token) and scores every candidate as
one token trie in one decode, the step after the prompt is read, beside
other requests' work: decide sends all outcomes of all decisions of a text
as one call.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchyard.core.clock import Clock, SystemClock
from batchyard.core.tokens import text_messages
from batchyard.engines import tool_calls
from batchyard.engines.llama_sampling import (
    CHAT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    TEXT_TEMPERATURE,
    SamplingParams,
    grammar_for,
)
from batchyard.engines.llama_scheduler import (
    SHELF_BYTES,
    Adapter,
    Branch,
    Job,
    Scheduler,
    Scoring,
)
from batchyard.engines.model_files import sha256_of
from batchyard.engines.protocol import (
    CacheState,
    Choice,
    Completion,
    CompletionRequest,
    Delta,
    Embeddings,
    Usage,
)
from batchyard.engines.tokenizers import ChatTemplate
from batchyard.errors import (
    ContextWindowExceeded,
    ModelNotFound,
    ModelUnavailable,
    ServiceUnavailable,
    UnsupportedInput,
    UpstreamError,
)

__all__ = ["LlamaCppEngine", "VersionGate", "VersionSpec"]

log = logging.getLogger(__name__)


@functools.cache
def _route_llama_logs() -> Any:
    """Send llama.cpp's log lines to ``batchyard.engines.llama``, errors only above debug.

    llama-cpp-python's own callback maps ggml's levels by an older enum (ggml now
    counts 1 debug, 2 info, 3 warn, 4 error), so its quiet mode printed warnings raw
    to stderr (the shared cache's ``n_ctx_seq > n_ctx_train``, which does not apply
    to a cache of many sequences) and hid errors. Installed once, after the first
    ``Llama`` set llama-cpp-python's own; the cache keeps the C callback alive.
    """
    import ctypes

    import llama_cpp

    llama_log = logging.getLogger("batchyard.engines.llama")
    last = [logging.DEBUG]  # a continuation line (5) keeps the level of the line before

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level != 5:
            last[0] = logging.ERROR if level == 4 else logging.DEBUG
        if llama_log.isEnabledFor(last[0]):
            llama_log.log(last[0], "llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


#: Flash attention's CPU kernel tiles a micro-batch of this many query rows or more
#: (``GGML_FA_TILE_Q``) and reads fewer row by row; the two round differently.
FA_TILE_ROWS = 64


def _embedding_packs(counts: list[int]) -> list[list[int]]:
    """The inputs (by index, in order) read together in one decode each: under 64 rows.

    Short inputs read alone leave most of a decode's matrix work idle (a 20-token
    input costs nearly what a 60-token one does), so consecutive inputs share a
    decode while their tokens stay under ``FA_TILE_ROWS``. Under it every row
    takes the row-by-row attention kernel over its own sequence's cells, in order,
    exactly as when read alone, so a text's vector does not depend on what it was
    sent with; at 64 rows or more the tiled kernel rounds otherwise (4e-5 apart
    for LangChain's query against the same text among its documents,
    docs/explanation/batch-invariance.md), so a longer input is read alone.
    """
    packs: list[list[int]] = []
    rows = FA_TILE_ROWS
    for i, n in enumerate(counts):
        if rows + n < FA_TILE_ROWS:
            packs[-1].append(i)
            rows += n
        else:
            packs.append([i])
            rows = n
    return packs


@dataclass(frozen=True, slots=True)
class VersionSpec:
    """A fine-tuned version: a LoRA adapter on the base GGUF, or a GGUF of its own.

    ``sha256``, when given, is the file's digest as accepted: it is checked on
    the loading thread, just before llama.cpp reads the file, so a file changed
    at rest is refused (``model_version_corrupt``) and the check never blocks
    the event loop.
    """

    kind: Literal["lora", "gguf"]
    path: Path
    sha256: str | None = None


#: Asked before each use of a version: whether it is still served (a project
#: version deleted through another process is not). Wired by the composition root.
VersionGate = Callable[[str], Awaitable[bool]]


class _Model:
    """One loaded model: its weights (a small ``Llama``), its template, its scheduler."""

    def __init__(self, llama: Any, scheduler: Scheduler, version: str | None = None) -> None:
        self.llama = llama
        self.scheduler = scheduler
        self.version = version
        self.template = ChatTemplate.from_llama(llama)
        self.n_vocab: int = llama.n_vocab()
        end = llama.token_eos()
        if self.template is not None:
            suffix = self.template.reply_suffix()
            if suffix:
                tokens = llama.tokenize(suffix.encode("utf-8"), add_bos=False, special=True)
                end = tokens[0] if tokens else end
        # The token that closes an assistant turn, for scoring a candidate as
        # the complete reply (see ``LlamaCppEngine.score_turn_end``).
        self.turn_end: int = end

    def prompt_text(self, messages: list[dict[str, Any]]) -> str:
        if self.template is not None:
            return self.template.prompt(messages)
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(parts) + "<|im_start|>assistant\n"

    def close(self) -> None:
        self.scheduler.close()
        self.llama.close()


# Models still open at exit: Llama's finaliser fails if it runs after
# llama_cpp's module teardown, so they are closed first.
_open_models: weakref.WeakSet[_Model] = weakref.WeakSet()


@atexit.register
def _close_open_models() -> None:
    for model in list(_open_models):
        model.close()


class _Slot:
    """One model or version: how to load it, what is loaded, and how it is used.

    The base and a full-weights version load a ``_Model`` (weights, context,
    scheduler); a LoRA version loads only an ``Adapter`` on the base model,
    whose scheduler serves its requests beside the base's.
    """

    def __init__(self, version: str | None, spec: VersionSpec | None) -> None:
        self.version = version
        self.spec = spec
        self.model: _Model | None = None
        self.adapter: Adapter | None = None
        self.lock = asyncio.Lock()
        self.load_seconds: float | None = None
        # Requests running on it now, when the last one ended, and any keep-warm pin
        # (all on the engine's clock): what idle eviction and the memory budget read.
        self.active = 0
        self.last_used = 0.0
        self.keep_until = 0.0

    @property
    def lora(self) -> bool:
        return self.spec is not None and self.spec.kind == "lora"

    @property
    def loaded(self) -> bool:
        return self.model is not None or self.adapter is not None


def _check_file(version: str, spec: VersionSpec) -> None:
    """The version's file is the one accepted (on the loading thread, before llama.cpp)."""
    try:
        intact = spec.path.is_file() and (
            spec.sha256 is None or sha256_of(spec.path) == spec.sha256
        )
    except OSError:
        intact = False
    if not intact:
        log.warning(
            "model version file missing or changed at rest",
            extra={"event": "model_version_corrupt", "id": version},
        )
        raise ModelUnavailable(
            f"model version {version}'s file is missing or was changed since it was "
            "uploaded; upload it again",
            param="model",
            code="model_version_corrupt",
        )


def _kv_bytes(llama: Any, cells: int) -> int:
    """The bytes of a KV cache of ``cells`` cells (f16 keys and values) for ``llama``'s model."""
    import llama_cpp

    model = llama._model.model
    n_layer = llama_cpp.llama_model_n_layer(model)
    n_head = max(1, llama_cpp.llama_model_n_head(model))
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    n_embd = llama_cpp.llama_model_n_embd(model)
    return int(cells * n_layer * 2 * n_head_kv * (n_embd // n_head) * 2)


def _after_last_special(model: _Model, text: str, tokens: list[int]) -> tuple[str, list[int]]:
    """The prompt from its last special token on, as text and tokens (the whole when none).

    Tokenizing the returned text gives the returned tokens (checked); then text
    appended to it tokenizes as it would appended to the whole prompt.
    """
    import llama_cpp

    vocab = model.llama._model.vocab
    for i in range(len(tokens) - 1, -1, -1):
        if not llama_cpp.llama_vocab_is_control(vocab, tokens[i]):
            continue
        piece = model.llama.detokenize([tokens[i]], special=True).decode("utf-8", "replace")
        at = text.rfind(piece) if piece else -1
        if at < 0:
            break
        head_text, head = text[at:], tokens[i:]
        if model.llama.tokenize(head_text.encode("utf-8"), False, True) == head:
            return head_text, head
        break
    return text, tokens


def _response_format(fmt: dict[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
    """Whether OpenAI's ``response_format`` asks for JSON, and under which schema."""
    if not fmt:
        return False, None
    kind = fmt.get("type")
    if kind == "json_schema":
        return True, (fmt.get("json_schema") or {}).get("schema") or None
    if kind == "json_object":
        return True, fmt.get("schema")
    return False, None


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
        contexts: int | None = None,
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
        # ``contexts`` is the old name of ``slots`` (one request per context then).
        self.slots = max(1, slots or contexts or 8)
        self.contexts = self.slots
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
        self._slots: dict[str | None, _Slot] = {None: _Slot(None, None)}
        for version, spec in self.versions.items():
            self._slots[version] = _Slot(version, spec)
        self._embedding_model: Any = None
        self._embed_lock = asyncio.Lock()

    # -- load state ------------------------------------------------------------

    def version_for(self, model: str) -> str | None:
        return model if model in self.versions else None

    @property
    def loaded(self) -> bool:
        return self._slots[None].loaded

    def is_loaded(self, version: str | None = None) -> bool:
        return self._slots[self._known(version)].loaded

    def load_seconds(self, version: str | None = None) -> float | None:
        """How long the last load of ``version`` took, as measured."""
        return self._slots[self._known(version)].load_seconds

    def warm_until(self, version: str) -> float | None:
        """When a loaded ``version`` becomes evictable (clock seconds); None: not loaded."""
        slot = self._slots[self._known(version)]
        if not slot.loaded:
            return None
        if slot.active or self.idle_s is None:
            return max(self.clock.time() + (self.idle_s or 0.0), slot.keep_until)
        return max(slot.last_used + self.idle_s, slot.keep_until)

    def version_bytes(self, version: str) -> int:
        """What ``version`` holds in memory once loaded: measured when loaded, else estimated.

        An adapter: its tensors (about its file's size); its prompts share the base's
        cache and shelf. Full weights: the model's tensors, its own KV cache of
        ``cache_tokens`` cells, and the shelf its scheduler may fill (``shelf_bytes``).
        """
        slot = self._slots[self._known(version)]
        if slot.adapter is not None:
            return slot.adapter.bytes
        if slot.model is not None:
            import llama_cpp

            size = int(llama_cpp.llama_model_size(slot.model.llama._model.model))
            kv = _kv_bytes(slot.model.llama, slot.model.scheduler.n_cells)
            return size + kv + self.shelf_bytes
        spec = self.versions[version]
        try:
            size = spec.path.stat().st_size
        except OSError:
            size = 0
        base = self._slots[None].model
        if spec.kind == "gguf":
            size += self.shelf_bytes
            if base is not None:
                size += _kv_bytes(base.llama, base.scheduler.n_cells)
        return size

    async def cache_states(self) -> list[CacheState]:
        """Each loaded model's shelf: the base's, and each full-weights version's."""
        states = []
        for version, slot in list(self._slots.items()):
            if slot.model is not None:
                held, prompts = await slot.model.scheduler.shelf_state()
                states.append(CacheState(version or "base", held, prompts))
        return states

    def loaded_versions(self) -> list[str]:
        return [v for v, s in self._slots.items() if v is not None and s.loaded]

    def _known(self, version: str | None) -> str | None:
        if version is not None and version not in self.versions:
            raise KeyError(f"unknown model version {version!r}")
        return version

    async def load(self) -> None:
        await self.load_version(None)

    def _build(self, path: Path) -> _Model:
        """Load a GGUF as a model of its own with its scheduler (on the loading thread)."""
        import llama_cpp

        # The Llama holds the weights, vocabulary and template; its own
        # context is kept small, the scheduler's context does the work.
        llama = llama_cpp.Llama(str(path), n_ctx=256, n_batch=64, n_threads=1, verbose=False)
        _route_llama_logs()
        try:
            scheduler = Scheduler(
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
        return _Model(llama, scheduler)

    def _load_adapter(self, version: str, spec: VersionSpec, base: _Model) -> Adapter:
        """Load a LoRA adapter on the base model (on the loading thread)."""
        import llama_cpp

        _check_file(version, spec)
        handle = llama_cpp.llama_adapter_lora_init(base.llama._model.model, str(spec.path).encode())
        if not handle:
            raise ValueError(f"llama.cpp refused the adapter {spec.path.name}")
        return Adapter(version, handle, 1.0, bytes=spec.path.stat().st_size)

    async def load_version(self, version: str | None) -> float:
        """Load ``version`` (``None``: the base) if needed; returns the load's measured seconds.

        A LoRA version loads the base first. Before a version loads, idle
        versions are unloaded while the versions would exceed ``memory_budget``.
        """
        slot = self._slots[self._known(version)]
        base: _Model | None = None
        if slot.lora:
            await self.load_version(None)
            base = self._slots[None].model
        async with slot.lock:
            if slot.loaded:
                return slot.load_seconds or 0.0
            if version is not None:
                await self._make_room(version)
            loop = asyncio.get_running_loop()
            started = self.clock.time()
            spec = slot.spec
            try:
                if spec is None:
                    model = await loop.run_in_executor(self._loader, self._build, self.model_path)
                elif spec.kind == "lora":
                    assert base is not None and version is not None
                    slot.adapter = await loop.run_in_executor(
                        self._loader, self._load_adapter, version, spec, base
                    )
                else:
                    assert version is not None

                    def build() -> _Model:
                        _check_file(version, spec)
                        return self._build(spec.path)

                    model = await loop.run_in_executor(self._loader, build)
            except (ValueError, OSError, RuntimeError) as exc:
                raise UpstreamError(
                    f"could not load model version {version or 'base'}: {exc}",
                    code="model_load_failed",
                    retryable=False,
                ) from None
            elapsed = self.clock.time() - started
            if not slot.lora:
                model.version = version
                slot.model = model
                _open_models.add(model)
            slot.last_used = self.clock.time()
            slot.load_seconds = self.last_load_seconds = elapsed
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
        slot = self._slots[self._known(version)]
        if version is None:
            for other in [v for v, s in self._slots.items() if s.lora and s.adapter]:
                await self.unload_version(other)
        async with slot.lock:
            model, slot.model = slot.model, None
            adapter, slot.adapter = slot.adapter, None
            loop = asyncio.get_running_loop()
            if adapter is not None:
                base = self._slots[None].model
                if base is not None:
                    import llama_cpp

                    def free() -> None:
                        llama_cpp.llama_adapter_lora_free(adapter.handle)

                    done = base.scheduler.release(adapter, free)
                    await loop.run_in_executor(self._loader, done.wait)
            if model is not None:
                _open_models.discard(model)
                await loop.run_in_executor(self._loader, model.close)
        if version is not None and (adapter is not None or model is not None):
            log.info("model version unloaded", extra={"engine": self.name, "version": version})

    # -- warmth: idle time, keep-warm and the memory budget ---------------------------

    def keep_loaded(self, version: str, until: float) -> None:
        """Keep ``version`` loaded until ``until`` (clock seconds), whatever its idle time."""
        slot = self._slots[self._known(version)]
        slot.keep_until = max(slot.keep_until, until)

    def _evictable(self, slot: _Slot, now: float) -> bool:
        return (
            slot.version is not None
            and slot.loaded
            and not slot.active
            and (slot.keep_until <= now)
        )

    async def evict_idle(self) -> list[str]:
        """Unload versions idle for ``idle_s`` (not kept warm, nothing running), and
        versions the gate says are gone (deleted through another process)."""
        now = self.clock.time()
        gone: list[str] = []
        for version, slot in list(self._slots.items()):
            if version is None or not slot.loaded:
                continue
            if self._gate is not None and not await self._gate(version):
                await self.remove_version(version)
                gone.append(version)
            elif (
                self.idle_s is not None
                and self._evictable(slot, now)
                and now >= slot.last_used + self.idle_s
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
            loaded = [self._slots[v] for v in self.loaded_versions() if v != version]
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
        self._slots[name] = _Slot(name, spec)

    async def remove_version(self, name: str) -> None:
        """Stop serving ``name`` and free its memory."""
        if name not in self.versions:
            return
        if self._slots[name].loaded:
            await self.unload_version(name)
        self._slots.pop(name, None)
        self.versions.pop(name, None)

    # -- running ------------------------------------------------------------------

    async def _model(self, version: str | None) -> _Model:
        """The model that runs ``version``'s requests (a LoRA's: the base), loaded.

        A version is first checked with the gate: one deleted through another
        process is forgotten here and answered as a model that does not exist.
        """
        if version is not None and self._gate is not None and not await self._gate(version):
            await self.remove_version(version)
            raise ModelNotFound(f"the model {version!r} does not exist", param="model")
        slot = self._slots[version]
        if not slot.loaded:
            await self.load_version(version)
        model = self._slots[None].model if slot.lora else slot.model
        assert model is not None
        return model

    def _adapter(self, request_model: str) -> Adapter | None:
        """The adapter of a LoRA version's requests (None: the model's own weights)."""
        version = self.version_for(request_model)
        return self._slots[version].adapter if version is not None else None

    async def _run(
        self, model: _Model, job: Job, hangup: asyncio.Event | None = None
    ) -> AsyncIterator[Any]:
        """``model.scheduler.run(job)``, counted as its version's use (for idle eviction).

        ``hangup`` set (the caller hung up) stops the job at the scheduler's
        next step (``Scheduler.stop``): what it produced is its answer.
        """
        slot = self._slots.get(job.adapter.name if job.adapter is not None else model.version)
        if slot is None:
            slot = self._slots[None]
        slot.active += 1

        async def stop_on_hangup(hangup: asyncio.Event) -> None:
            await hangup.wait()
            model.scheduler.stop(job)

        watch = None if hangup is None else asyncio.create_task(stop_on_hangup(hangup))
        try:
            async for event in model.scheduler.run(job):
                if event[0] == "stopped":
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
            slot.active -= 1
            slot.last_used = self.clock.time()

    # -- requests as jobs ----------------------------------------------------------

    def _prompt(self, model: _Model, request: CompletionRequest) -> tuple[list[int], bool]:
        """The prompt's tokens and whether the answer is a tool call (under its grammar)."""
        if request.prompt is not None:
            text = request.prompt.encode("utf-8")
            tokens = model.llama.tokenize(text, add_bos=True, special=False)
            # An empty prompt is read as the start-of-text token (as llama-cpp does).
            return tokens or [model.llama.token_bos()], False
        plain, images = text_messages(tool_calls.plain_messages(request.messages))
        if images:
            raise UnsupportedInput(f"{self.name} reads text only; the request has image parts")
        tools = tool_calls.answer_schema(request.tools or [], request.tool_choice) is not None
        if tools:
            guide = tool_calls.tools_prompt(request.tools or [], request.tool_choice)
            plain = [{"role": "system", "content": guide}, *plain]
        text = model.prompt_text(plain).encode("utf-8")
        return model.llama.tokenize(text, add_bos=False, special=True), tools

    def _job(self, model: _Model, request: CompletionRequest) -> tuple[Job, bool]:
        if request.prompt is None:
            _, images = text_messages(request.messages)
            if images:
                raise UnsupportedInput(f"{self.name} reads text only; the request has image parts")
        prompt, tools = self._prompt(model, request)
        if len(prompt) >= self.n_ctx:
            raise ContextWindowExceeded(
                f"the prompt is {len(prompt)} tokens; the context window is {self.n_ctx}"
            )
        grammar = None
        if tools:
            grammar = grammar_for(
                tool_calls.answer_schema(request.tools or [], request.tool_choice), param="tools"
            )
        elif request.prompt is None:
            wants_json, schema = _response_format(request.response_format)
            if wants_json:
                grammar = grammar_for(schema)
        default_temperature = CHAT_TEMPERATURE if request.prompt is None else TEXT_TEMPERATURE
        temperature = default_temperature if request.temperature is None else request.temperature
        max_tokens = max(1, min(request.max_tokens, self.n_ctx - len(prompt)))
        branches = []
        for i in range(max(1, request.n)):
            params = SamplingParams(
                temperature=temperature,
                top_p=DEFAULT_TOP_P if request.top_p is None else request.top_p,
                top_k=DEFAULT_TOP_K if request.top_k is None else request.top_k,
                seed=None if request.seed is None else request.seed + i,
                frequency_penalty=request.frequency_penalty or 0.0,
                presence_penalty=request.presence_penalty or 0.0,
                grammar=grammar,
            )
            branches.append(
                Branch(
                    params=params,
                    max_tokens=max_tokens,
                    stops=request.stop,
                    logprobs=request.logprobs and not tools,
                    top=request.top_logprobs or 0,
                )
            )
        job = Job(prompt, branches, adapter=self._adapter(request.model))
        self._check_fits(model, job)
        return job, tools

    def _check_fits(self, model: _Model, job: Job) -> None:
        scheduler = model.scheduler
        if job.reserve > scheduler.n_cells or len(job.branches) + 1 > scheduler.n_seq:
            raise ContextWindowExceeded(
                f"the request needs {job.reserve} cache cells and {len(job.branches) + 1} "
                f"sequences; the embedded model has {scheduler.n_cells} and {scheduler.n_seq}"
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
            kind = event[0]
            if kind == "piece":
                _, i, text, entries = event
                texts[i] += text
                if entries:
                    logprobs[i].extend(entries)
            elif kind == "branch":
                _, i, tail, finish, used, stop = event
                texts[i] += tail
                finishes[i], out[i], matched[i] = finish, used, stop
            elif kind == "done":
                _, prompt_tokens, cached = event
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
            kind = event[0]
            if kind == "cached":
                cached = event[1]
            elif kind == "piece" and event[2]:
                text.append(event[2])
                yield Delta(0, event[2], cached_input_tokens=cached)
                cached = None
            elif kind == "branch":
                _, _, tail, finish, out, stop = event
                if tail:
                    text.append(tail)
                    yield Delta(0, tail, cached_input_tokens=cached)
                    cached = None
            elif kind == "done":
                _, prompt_tokens, cached = event
                yield Delta(0, "", finish_reason=finish)
                yield Completion(
                    model=request.model,
                    choices=[Choice(text="".join(text), finish_reason=finish, stop_sequence=stop)],
                    usage=Usage(prompt_tokens, out, cached_input_tokens=cached),
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
            for pack in _embedding_packs(counts):
                got = embedder.embed([texts[i] for i in pack], normalize=True)
                for i, vector in zip(pack, got, strict=True):
                    vectors[i] = list(map(float, vector))
            return Embeddings(vectors, Usage(sum(counts), 0))

        # On the base model's step thread, between its steps: one thread decodes for the
        # whole process, so llama.cpp's OpenMP threads stay one team (``Scheduler.call``).
        base = await self._model(None)
        async with self._embed_lock:
            return await base.scheduler.call(work)

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
                        # (``_embedding_packs``) get the vectors they get alone.
                        flash_attn=True,
                        verbose=False,
                    )

                loop = asyncio.get_running_loop()
                self._embedding_model = await loop.run_in_executor(self._loader, load)
            return self._embedding_model

    def _conts(
        self, model: _Model, prompt_text: str, prompt: list[int], candidates: list[str]
    ) -> list[list[int]]:
        tokenize = model.llama.tokenize
        # Each candidate is tokenized after the prompt's last special token, not after
        # the whole prompt: llama.cpp splits a text at its special tokens before it
        # tokenizes the pieces, so what follows one is tokenized the same either way,
        # and a decide call's seven candidates no longer re-read its whole prompt on
        # the event loop (on the cores the model decodes on).
        head_text, head = _after_last_special(model, prompt_text, prompt)
        conts: list[list[int]] = []
        for candidate in candidates:
            full = tokenize((head_text + candidate).encode("utf-8"), False, True)
            if full[: len(head)] != head:
                full = tokenize((prompt_text + candidate).encode("utf-8"), False, True)
                head = prompt
            if full[: len(head)] == head:
                tokens = full[len(head) :]
            else:
                tokens = tokenize(candidate.encode("utf-8"), False, False)
            if self.score_turn_end or not tokens:
                tokens = [*tokens, model.turn_end]
            conts.append(tokens)
        return conts

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
        conts = self._conts(loaded, prompt_text, prompt, candidates)
        longest = max(len(c) for c in conts)
        if len(prompt) + longest > self.n_ctx:
            raise ContextWindowExceeded(
                f"prompt ({len(prompt)} tokens) and the longest candidate ({longest}) "
                f"exceed the context window of {self.n_ctx}"
            )
        scoring = Scoring(conts)
        job = Job(
            prompt,
            [Branch() for _ in range(scoring.tips)],
            adapter=self._adapter(model),
            scoring=scoring,
        )
        self._check_fits(loaded, job)
        if len(scoring.nodes) > loaded.scheduler.capacity:
            raise ContextWindowExceeded(
                f"the candidates need {len(scoring.nodes)} tokens decoded at once; "
                f"a step of the embedded model holds {loaded.scheduler.capacity}"
            )
        scores: list[float] = []
        cached = 0
        async for event in self._run(loaded, job):
            if event[0] == "scores":
                scores = [sum(lps) for lps in event[1]]
            elif event[0] == "done":
                cached = event[2]
        usage = Usage(len(prompt), sum(len(c) for c in conts), cached_input_tokens=cached)
        return scores, usage

    async def aclose(self) -> None:
        if self._embedding_model is not None:
            self._embedding_model.close()
            self._embedding_model = None
        for version, slot in self._slots.items():
            if slot.loaded:
                await self.unload_version(version)
        self._loader.shutdown(wait=False)
