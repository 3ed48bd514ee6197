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
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchyard.core.clock import Clock, SystemClock
from batchyard.core.tokens import text_messages
from batchyard.engines import tool_calls
from batchyard.engines.base import Choice, Completion, CompletionRequest, Delta, Embeddings, Usage
from batchyard.engines.llama_sampling import (
    CHAT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    TEXT_TEMPERATURE,
    SamplingParams,
    grammar_for,
)
from batchyard.engines.llama_scheduler import Branch, Job, Scheduler, Scoring
from batchyard.engines.tokenizers import ChatTemplate
from batchyard.errors import ContextWindowExceeded, UnsupportedInput, UpstreamError

__all__ = ["LlamaCppEngine", "VersionSpec"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VersionSpec:
    """A fine-tuned version: a LoRA adapter on the base GGUF, or a GGUF of its own."""

    kind: Literal["lora", "gguf"]
    path: Path


class _Model:
    """One loaded model: its weights (a small ``Llama``), its template, its scheduler."""

    def __init__(self, llama: Any, scheduler: Scheduler) -> None:
        self.llama = llama
        self.scheduler = scheduler
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
    """One version: how to load it, and the model once loaded."""

    def __init__(self, factory: Callable[[], _Model]) -> None:
        self.factory = factory
        self.model: _Model | None = None
        self.lock = asyncio.Lock()
        self.load_seconds: float | None = None

    @property
    def loaded(self) -> bool:
        return self.model is not None


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
    prompt never stalls the tokens of running streams for long.
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
        versions: dict[str, VersionSpec] | None = None,
        score_turn_end: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        # Only to time loads (reported as warm state); nothing here waits on it.
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
        self.versions: dict[str, VersionSpec] = dict(versions or {})
        self.last_load_seconds: float | None = None
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-load")
        self._slots: dict[str | None, _Slot] = {None: self._slot(None)}
        for version in self.versions:
            self._slots[version] = self._slot(version)
        self._embedding_model: Any = None
        self._embed_lock = asyncio.Lock()

    def _slot(self, version: str | None) -> _Slot:
        import llama_cpp

        extra: dict[str, Any] = {}
        if version is None:
            path = self.model_path
        else:
            spec = self.versions[version]
            if spec.kind == "lora":
                path, extra["lora_path"] = self.model_path, str(spec.path)
            else:
                path = spec.path

        def factory() -> _Model:
            # The Llama holds the weights, vocabulary and template; its own
            # context is kept small, the scheduler's context does the work.
            llama = llama_cpp.Llama(
                str(path), n_ctx=256, n_batch=64, n_threads=1, verbose=False, **extra
            )
            scheduler = Scheduler(
                llama,
                slots=self.slots,
                n_ctx=self.n_ctx,
                cache_tokens=self.cache_tokens,
                threads=self.n_threads,
                prefill_tokens=self.prefill_tokens,
            )
            return _Model(llama, scheduler)

        return _Slot(factory)

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

    def _known(self, version: str | None) -> str | None:
        if version is not None and version not in self.versions:
            raise KeyError(f"unknown model version {version!r}")
        return version

    async def load(self) -> None:
        await self.load_version(None)

    async def load_version(self, version: str | None) -> float:
        """Load ``version`` (``None``: the base) if needed; returns the load's measured seconds."""
        slot = self._slots[self._known(version)]
        async with slot.lock:
            if slot.model is not None:
                return slot.load_seconds or 0.0
            loop = asyncio.get_running_loop()
            started = self.clock.time()
            try:
                model = await loop.run_in_executor(self._loader, slot.factory)
            except (ValueError, OSError, RuntimeError) as exc:
                raise UpstreamError(
                    f"could not load model version {version or 'base'}: {exc}",
                    code="model_load_failed",
                    retryable=False,
                ) from None
            elapsed = self.clock.time() - started
            slot.model = model
            _open_models.add(model)
            slot.load_seconds = self.last_load_seconds = elapsed
            log.info(
                "model loaded",
                extra={"engine": self.name, "version": version or "base", "seconds": elapsed},
            )
            return elapsed

    async def unload_version(self, version: str | None) -> None:
        """Free a version's memory; requests still running on it fail as retryable."""
        slot = self._slots[self._known(version)]
        async with slot.lock:
            model, slot.model = slot.model, None
            if model is not None:
                _open_models.discard(model)
                await asyncio.get_running_loop().run_in_executor(self._loader, model.close)

    # -- versions registered at run time (project model versions) -----------------
    # Versions uploaded into a project arrive after the engine is built.

    def add_version(self, name: str, spec: VersionSpec) -> None:
        """Serve ``name`` from ``spec`` from now on; loaded on first use (or ``load_version``)."""
        if self.versions.get(name) == spec:
            return
        if name in self.versions:
            raise ValueError(f"model version {name!r} is already served from another file")
        self.versions[name] = spec
        self._slots[name] = self._slot(name)

    async def remove_version(self, name: str) -> None:
        """Stop serving ``name`` and free its memory."""
        if name not in self.versions:
            return
        if self._slots[name].loaded:
            await self.unload_version(name)
        del self._slots[name], self.versions[name]

    # -- running ------------------------------------------------------------------

    async def _model(self, version: str | None) -> _Model:
        slot = self._slots[version]
        if slot.model is None:
            await self.load_version(version)
        assert slot.model is not None
        return slot.model

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
                tool_calls.answer_schema(request.tools or [], request.tool_choice)
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
        job = Job(prompt, branches, adapter=None)
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
        n = len(job.branches)
        texts = [""] * n
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        finishes = ["stop"] * n
        matched: list[str | None] = [None] * n
        out = [0] * n
        prompt_tokens = cached = 0
        async for event in model.scheduler.run(job):
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
                text, calls = tool_calls.parse_answer(text, finish_reason=finish)
                finish = "tool_calls" if calls else "stop"
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
        async for event in model.scheduler.run(job):
            kind = event[0]
            if kind == "piece" and event[2]:
                text.append(event[2])
                yield Delta(0, event[2])
            elif kind == "branch":
                _, _, tail, finish, out, stop = event
                if tail:
                    text.append(tail)
                    yield Delta(0, tail)
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
        """
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
            vectors = [list(map(float, embedder.embed(t, normalize=True))) for t in texts]
            return Embeddings(vectors, Usage(sum(counts), 0))

        async with self._embed_lock:
            return await asyncio.get_running_loop().run_in_executor(self._loader, work)

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
                        verbose=False,
                    )

                loop = asyncio.get_running_loop()
                self._embedding_model = await loop.run_in_executor(self._loader, load)
            return self._embedding_model

    def _conts(
        self, model: _Model, prompt_text: str, prompt: list[int], candidates: list[str]
    ) -> list[list[int]]:
        tokenize = model.llama.tokenize
        conts: list[list[int]] = []
        for candidate in candidates:
            full = tokenize((prompt_text + candidate).encode("utf-8"), False, True)
            if full[: len(prompt)] == prompt:
                tokens = full[len(prompt) :]
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
        job = Job(prompt, [Branch() for _ in range(scoring.tips)], scoring=scoring)
        self._check_fits(loaded, job)
        if len(scoring.nodes) > loaded.scheduler.capacity:
            raise ContextWindowExceeded(
                f"the candidates need {len(scoring.nodes)} tokens decoded at once; "
                f"a step of the embedded model holds {loaded.scheduler.capacity}"
            )
        scores: list[float] = []
        cached = 0
        async for event in loaded.scheduler.run(job):
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
