"""The embedded engine: a GGUF model run in-process with llama-cpp.

llama calls are long and hold a native context, so they run in worker
threads: each version of the model owns a pool of ``contexts`` Llama
instances, handed out through an asyncio queue so one thread uses one
instance at a time and the event loop never blocks. The native code releases
the GIL while it computes, so two contexts really use two cores.

Scoring (``score``) evaluates the shared prompt once, reusing whatever prefix
the context already holds (the same system prompt across a batch costs
nothing after the first row), then each candidate in one decode.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from batchyard.core.clock import Clock, SystemClock
from batchyard.core.tokens import text_messages
from batchyard.engines import tool_calls
from batchyard.engines.base import Choice, Completion, CompletionRequest, Delta, Embeddings, Usage
from batchyard.engines.tokenizers import ChatTemplate
from batchyard.errors import ContextWindowExceeded, UnsupportedInput, UpstreamError

__all__ = ["LlamaCppEngine", "VersionSpec"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class VersionSpec:
    """A fine-tuned version: a LoRA adapter on the base GGUF, or a GGUF of its own."""

    kind: Literal["lora", "gguf"]
    path: Path


class _Model:
    """One Llama instance plus what scoring needs to know about its template."""

    def __init__(self, llama: Any) -> None:
        self.llama = llama
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
        # The text of the prompt this instance's context holds (see ``_Pool.take``).
        self.holds: str = ""

    def prompt_text(self, messages: list[dict[str, Any]]) -> str:
        if self.template is not None:
            return self.template.prompt(messages)
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(parts) + "<|im_start|>assistant\n"


# Instances still open at exit: Llama's finaliser fails if it runs after
# llama_cpp's module teardown, so they are closed first.
_open_models: weakref.WeakSet[_Model] = weakref.WeakSet()


@atexit.register
def _close_open_models() -> None:
    for model in list(_open_models):
        model.llama.close()


class _Pool:
    """The instances of one version, and whether they are loaded."""

    def __init__(self, factory: Callable[[], Any], contexts: int, label: str) -> None:
        self.factory = factory
        self.contexts = contexts
        self.executor = ThreadPoolExecutor(max_workers=contexts, thread_name_prefix=label)
        self.free: asyncio.Queue[_Model] = asyncio.Queue()
        self.models: list[_Model] = []
        self.lock = asyncio.Lock()
        self.load_seconds: float | None = None

    @property
    def loaded(self) -> bool:
        return bool(self.models)

    async def take(self, prompt: str | None) -> _Model:
        """A free instance; of those free now, the one whose context holds most of ``prompt``.

        Scoring reuses the prompt prefix a context already holds. Streams of
        decide calls with different decision sets share the instances;
        sending each prompt to the instance that read its questions last
        keeps each set's prefix cached instead of evicting one with another.
        """
        model = await self.free.get()
        if prompt is None or self.free.empty():
            return model
        others = [self.free.get_nowait() for _ in range(self.free.qsize())]
        best = max([model, *others], key=lambda m: _shared_prefix(m.holds, prompt))
        for m in [model, *others]:
            if m is not best:
                self.free.put_nowait(m)
        return best


def _shared_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _log_softmax_at(row: Any, token: int) -> float:
    row64 = row.astype(np.float64)
    peak = float(row64.max())
    return float(row64[token] - peak - np.log(np.exp(row64 - peak).sum()))


def _top_of(row: Any, top: int) -> list[tuple[int, float]]:
    """The ``top`` most likely tokens of a logits row, with their log-probabilities."""
    row64 = row.astype(np.float64)
    peak = float(row64.max())
    norm = peak + float(np.log(np.exp(row64 - peak).sum()))
    best = np.argpartition(-row64, top - 1)[:top]
    best = best[np.argsort(-row64[best])]
    return [(int(t), float(row64[t] - norm)) for t in best]


def _continuation_logprobs(
    model: _Model,
    prompt: list[int],
    conts: list[list[int]],
    *,
    top: int = 0,
    tops: list[list[tuple[int, float]]] | None = None,
) -> list[list[float]]:
    """Per-token log-probabilities of each continuation after ``prompt`` (in a worker thread).

    With ``top`` and ``tops``, the ``top`` likeliest tokens at each position of
    the (single) continuation are appended to ``tops``.

    The context's cached tokens are kept where they match the prompt, and the
    context is left holding exactly the prompt, so a following generation or
    scoring call with the same prefix skips it.
    """
    llama = model.llama
    n_prompt = len(prompt)
    cached = llama._input_ids
    keep = 0
    limit = min(len(cached), n_prompt - 1)
    while keep < limit and int(cached[keep]) == prompt[keep]:
        keep += 1
    llama.n_tokens = keep
    llama.eval(prompt[keep:])
    ctx, batch, n_vocab, n_batch = llama._ctx, llama._batch, model.n_vocab, llama.n_batch
    last = np.ctypeslib.as_array(ctx.get_logits(), shape=(n_vocab,)).copy()
    out: list[list[float]] = []
    try:
        for tokens in conts:
            per_token = [_log_softmax_at(last, tokens[0])]
            if top and tops is not None:
                tops.append(_top_of(last, top))
            feed = tokens[:-1]
            for start in range(0, len(feed), n_batch):
                chunk = feed[start : start + n_batch]
                ctx.kv_cache_seq_rm(-1, n_prompt + start, -1)
                batch.set_batch(chunk, n_past=n_prompt + start, logits_all=True)
                ctx.decode(batch)
                rows = np.ctypeslib.as_array(ctx.get_logits(), shape=(len(chunk), n_vocab))
                for j in range(len(chunk)):
                    per_token.append(_log_softmax_at(rows[j], tokens[start + j + 1]))
                    if top and tops is not None:
                        tops.append(_top_of(rows[j], top))
            out.append(per_token)
    finally:
        # Leave the context holding just the prompt; its logits are stale now.
        ctx.kv_cache_seq_rm(-1, n_prompt, -1)
        llama.n_tokens = n_prompt
        llama._requires_eval = True
    return out


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's ``json_schema`` format as llama-cpp's schema-constrained ``json_object``."""
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        return {"type": "json_object", "schema": schema} if schema else {"type": "json_object"}
    if kind == "json_object":
        return {"type": "json_object", **({"schema": fmt["schema"]} if "schema" in fmt else {})}
    return None


class LlamaCppEngine:
    """Chat completions and candidate scoring from a local GGUF model.

    The request's ``model`` picks a version by name; any other name means the
    base model (the catalog maps public names before the engine sees them).
    Models load lazily on first use, or ahead of time with ``load``.
    """

    BASE: str | None = None

    def __init__(
        self,
        model_path: Path,
        *,
        name: str = "llama_cpp",
        n_ctx: int = 2048,
        contexts: int = 2,
        n_threads: int | None = None,
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
        self.contexts = max(1, contexts)
        self.n_threads = n_threads or max(1, (os.cpu_count() or 1) // self.contexts)
        self.versions: dict[str, VersionSpec] = dict(versions or {})
        self.last_load_seconds: float | None = None
        self._pools: dict[str | None, _Pool] = {None: self._pool(None)}
        self._embedding_model: Any = None
        self._embed_lock = asyncio.Lock()
        for version in self.versions:
            self._pools[version] = self._pool(version)

    def _pool(self, version: str | None) -> _Pool:
        import llama_cpp

        base: dict[str, Any] = {
            "n_ctx": self.n_ctx,
            "n_threads": self.n_threads,
            "n_threads_batch": self.n_threads,
            "verbose": False,
        }
        extra: dict[str, Any] = {}
        if version is None:
            path = self.model_path
        else:
            spec = self.versions[version]
            if spec.kind == "lora":
                path, extra["lora_path"] = self.model_path, str(spec.path)
            else:
                path = spec.path

        def factory() -> Any:
            return llama_cpp.Llama(str(path), **base, **extra)

        return _Pool(factory, self.contexts, f"llama-{version or 'base'}")

    # -- load state ------------------------------------------------------------

    def version_for(self, model: str) -> str | None:
        return model if model in self.versions else None

    @property
    def loaded(self) -> bool:
        return self._pools[None].loaded

    def is_loaded(self, version: str | None = None) -> bool:
        return self._pools[self._known(version)].loaded

    def load_seconds(self, version: str | None = None) -> float | None:
        """How long the last load of ``version`` took, as measured."""
        return self._pools[self._known(version)].load_seconds

    def _known(self, version: str | None) -> str | None:
        if version is not None and version not in self.versions:
            raise KeyError(f"unknown model version {version!r}")
        return version

    async def load(self) -> None:
        await self.load_version(None)

    async def load_version(self, version: str | None) -> float:
        """Load ``version`` (``None``: the base) if needed; returns the load's measured seconds."""
        pool = self._pools[self._known(version)]
        async with pool.lock:
            if pool.loaded:
                return pool.load_seconds or 0.0
            loop = asyncio.get_running_loop()
            started = self.clock.time()
            try:
                models = await loop.run_in_executor(
                    pool.executor, lambda: [_Model(pool.factory()) for _ in range(pool.contexts)]
                )
            except (ValueError, OSError, RuntimeError) as exc:
                raise UpstreamError(
                    f"could not load model version {version or 'base'}: {exc}",
                    code="model_load_failed",
                    retryable=False,
                ) from None
            elapsed = self.clock.time() - started
            pool.models = models
            for model in models:
                _open_models.add(model)
                pool.free.put_nowait(model)
            pool.load_seconds = self.last_load_seconds = elapsed
            log.info(
                "model loaded",
                extra={"engine": self.name, "version": version or "base", "seconds": elapsed},
            )
            return elapsed

    async def unload_version(self, version: str | None) -> None:
        """Free a version's memory once its in-flight calls finish."""
        pool = self._pools[self._known(version)]
        async with pool.lock:
            models = [await pool.free.get() for _ in pool.models]
            pool.models = []
            for model in models:
                _open_models.discard(model)
                model.llama.close()

    # -- versions registered at run time (i20: project model versions) -------------
    # A hook kept apart from the rest so the scheduler rewrite can keep its
    # signature: versions uploaded into a project arrive after the engine is built.

    def add_version(self, name: str, spec: VersionSpec) -> None:
        """Serve ``name`` from ``spec`` from now on; loaded on first use (or ``load_version``)."""
        if self.versions.get(name) == spec:
            return
        if name in self.versions:
            raise ValueError(f"model version {name!r} is already served from another file")
        self.versions[name] = spec
        self._pools[name] = self._pool(name)

    async def remove_version(self, name: str) -> None:
        """Stop serving ``name`` and free its memory once its in-flight calls finish."""
        if name not in self.versions:
            return
        pool = self._pools[name]
        if pool.loaded:
            await self.unload_version(name)
        del self._pools[name], self.versions[name]
        pool.executor.shutdown(wait=False)

    # -- running ------------------------------------------------------------------

    async def _run(
        self, version: str | None, work: Callable[[_Model], T], prompt: str | None = None
    ) -> T:
        pool = self._pools[version]
        if not pool.loaded:
            await self.load_version(version)
        model = await pool.take(prompt)
        future = asyncio.get_running_loop().run_in_executor(pool.executor, work, model)
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread still holds the instance; hand it back only when done.
            def release(done: asyncio.Future[T]) -> None:
                if not done.cancelled():
                    done.exception()
                pool.free.put_nowait(model)

            future.add_done_callback(release)
            raise
        except BaseException:
            pool.free.put_nowait(model)
            raise
        pool.free.put_nowait(model)
        return result

    def _prepared(self, request: CompletionRequest) -> _Prepared:
        """What llama-cpp is asked: the messages as text, the sampling, any tool grammar."""
        plain, images = text_messages(tool_calls.plain_messages(request.messages))
        if images:
            raise UnsupportedInput(f"{self.name} reads text only; the request has image parts")
        kwargs: dict[str, Any] = {"max_tokens": request.max_tokens}
        for name in ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty"):
            value = getattr(request, name)
            if value is not None:
                kwargs[name] = value
        if request.stop:
            kwargs["stop"] = request.stop
        schema = None
        if request.prompt is None:
            schema = tool_calls.answer_schema(request.tools or [], request.tool_choice)
            if schema is not None:
                guide = tool_calls.tools_prompt(request.tools or [], request.tool_choice)
                plain = [{"role": "system", "content": guide}, *plain]
                kwargs["response_format"] = {"type": "json_object", "schema": schema}
            else:
                response_format = _response_format(request.response_format)
                if response_format is not None:
                    kwargs["response_format"] = response_format
        return _Prepared(plain, kwargs, tools=schema is not None)

    def _generate(
        self, model: _Model, request: CompletionRequest, prep: _Prepared, seed: int | None
    ) -> tuple[Choice, int, int]:
        """One sample, in a worker thread: the choice, prompt tokens, output tokens."""
        try:
            if request.prompt is not None:
                answer = model.llama.create_completion(
                    prompt=request.prompt, **prep.kwargs, seed=seed
                )
                raw = answer["choices"][0]
                text = raw.get("text") or ""
            else:
                answer = model.llama.create_chat_completion(
                    messages=prep.plain, **prep.kwargs, seed=seed
                )
                raw = answer["choices"][0]
                text = raw["message"].get("content") or ""
        except ValueError as exc:
            if "context window" in str(exc) or "exceed context" in str(exc):
                raise ContextWindowExceeded(str(exc)) from None
            raise
        usage = answer["usage"]
        finish = raw.get("finish_reason") or "stop"
        calls = None
        if prep.tools:
            text, calls = tool_calls.parse_answer(text, finish_reason=finish)
            finish = "tool_calls" if calls else "stop"
        logprobs = None
        if request.logprobs and calls is None:
            prompt = _prompt_tokens(model, request, prep.plain)
            logprobs = _generated_logprobs(model, prompt, text, request.top_logprobs or 0)
        choice = Choice(text=text, finish_reason=finish, logprobs=logprobs, tool_calls=calls)
        return choice, int(usage["prompt_tokens"]), int(usage["completion_tokens"])

    async def complete(self, request: CompletionRequest) -> Completion:
        prep = self._prepared(request)

        def work(model: _Model) -> tuple[list[Choice], int, int]:
            model.holds = ""
            choices: list[Choice] = []
            prompt_tokens = output_tokens = 0
            for i in range(max(1, request.n)):
                seed = None if request.seed is None else request.seed + i
                choice, prompt_tokens, used = self._generate(model, request, prep, seed)
                output_tokens += used
                choices.append(choice)
            return choices, prompt_tokens, output_tokens

        choices, prompt_tokens, output_tokens = await self._run(
            self.version_for(request.model), work
        )
        return Completion(
            model=request.model,
            choices=choices,
            usage=Usage(input_tokens=prompt_tokens, output_tokens=output_tokens),
        )

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        """Token by token, from a worker thread; closing the iterator stops the generation.

        Tool calls and several samples are produced whole (a tool call is one
        grammar-checked object) and sent as one piece each.
        """
        prep = self._prepared(request)
        if prep.tools or request.n > 1 or request.logprobs:
            done = await self.complete(request)
            for i, choice in enumerate(done.choices):
                yield Delta(
                    i, choice.text, choice.tool_calls, choice.logprobs, choice.finish_reason
                )
            yield done
            return
        version = self.version_for(request.model)
        pool = self._pools[version]
        if not pool.loaded:
            await self.load_version(version)
        model = await pool.free.get()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        stop = threading.Event()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        def work() -> None:
            try:
                if request.prompt is not None:
                    pieces = model.llama.create_completion(
                        prompt=request.prompt, **prep.kwargs, seed=request.seed, stream=True
                    )
                else:
                    pieces = model.llama.create_chat_completion(
                        messages=prep.plain, **prep.kwargs, seed=request.seed, stream=True
                    )
                text: list[str] = []
                finish = "stop"
                for chunk in pieces:
                    if stop.is_set():
                        pieces.close()
                        break
                    raw = chunk["choices"][0]
                    piece = raw.get("text") if request.prompt is not None else None
                    if request.prompt is None:
                        piece = (raw.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                        put("delta", piece)
                    if raw.get("finish_reason"):
                        finish = raw["finish_reason"]
                reply = "".join(text)
                prompt = _prompt_tokens(model, request, prep.plain)
                out = len(model.llama.tokenize(reply.encode("utf-8"), False, False))
                put("done", (reply, finish, len(prompt), out))
            except ValueError as exc:
                if "context window" in str(exc) or "exceed context" in str(exc):
                    put("error", ContextWindowExceeded(str(exc)))
                else:
                    put("error", exc)
            except BaseException as exc:
                put("error", exc)

        future = loop.run_in_executor(pool.executor, work)
        future.add_done_callback(lambda _: pool.free.put_nowait(model))
        try:
            while True:
                kind, value = await queue.get()
                if kind == "delta":
                    yield Delta(0, value)
                elif kind == "error":
                    raise value
                else:
                    reply, finish, prompt_tokens, out = value
                    yield Delta(0, "", finish_reason=finish)
                    yield Completion(
                        model=request.model,
                        choices=[Choice(text=reply, finish_reason=finish)],
                        usage=Usage(prompt_tokens, out),
                    )
                    return
        finally:
            stop.set()

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
            return await asyncio.get_running_loop().run_in_executor(
                self._pools[None].executor, work
            )

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
                self._embedding_model = await loop.run_in_executor(self._pools[None].executor, load)
            return self._embedding_model

    async def score(
        self, model: str, messages: list[dict[str, Any]], candidates: list[str]
    ) -> tuple[list[float], Usage]:
        """Log-probability of each candidate as the assistant's reply (its opening,
        or the complete reply when ``score_turn_end``).

        Usage: ``input_tokens`` is the prompt, evaluated once; ``output_tokens``
        is the SUM of every candidate's tokens (with the end-of-turn token when
        ``score_turn_end``), because each one is evaluated.
        """
        plain, images = text_messages(messages)
        if images:
            raise UnsupportedInput(f"{self.name} reads text only; the request has image parts")
        if not candidates:
            return [], Usage(input_tokens=0, output_tokens=0)

        key = "\x00".join(f"{m['role']}\x00{m['content']}" for m in plain)

        def work(m: _Model) -> tuple[list[float], Usage]:
            m.holds = ""
            prompt_text = m.prompt_text(plain)
            tokenize = m.llama.tokenize
            prompt = tokenize(prompt_text.encode("utf-8"), add_bos=False, special=True)
            conts: list[list[int]] = []
            for candidate in candidates:
                full = tokenize((prompt_text + candidate).encode("utf-8"), False, True)
                if full[: len(prompt)] == prompt:
                    tokens = full[len(prompt) :]
                else:
                    tokens = tokenize(candidate.encode("utf-8"), False, False)
                if self.score_turn_end or not tokens:
                    tokens = [*tokens, m.turn_end]
                conts.append(tokens)
            longest = max(len(c) for c in conts)
            if len(prompt) + longest > m.llama.n_ctx():
                raise ContextWindowExceeded(
                    f"prompt ({len(prompt)} tokens) and the longest candidate ({longest}) "
                    f"exceed the context window of {m.llama.n_ctx()}"
                )
            scores = [sum(lps) for lps in _continuation_logprobs(m, prompt, conts)]
            m.holds = key
            return scores, Usage(len(prompt), sum(len(c) for c in conts))

        return await self._run(self.version_for(model), work, key)

    async def aclose(self) -> None:
        if self._embedding_model is not None:
            self._embedding_model.close()
            self._embedding_model = None
        for version, pool in self._pools.items():
            if pool.loaded:
                await self.unload_version(version)
            pool.executor.shutdown(wait=False)


@dataclass(frozen=True, slots=True)
class _Prepared:
    plain: list[dict[str, Any]]
    kwargs: dict[str, Any]
    tools: bool


def _prompt_tokens(model: _Model, request: CompletionRequest, plain: list[dict[str, Any]]) -> Any:
    if request.prompt is not None:
        return model.llama.tokenize(request.prompt.encode("utf-8"), add_bos=True, special=False)
    return model.llama.tokenize(
        model.prompt_text(plain).encode("utf-8"), add_bos=False, special=True
    )


def _piece(llama: Any, token: int) -> tuple[str, list[int]]:
    raw = llama.detokenize([token])
    return raw.decode("utf-8", errors="replace"), list(raw)


def _generated_logprobs(
    model: _Model, prompt: list[int], text: str, top: int
) -> list[dict[str, Any]]:
    """OpenAI-shaped ``logprobs.content`` for generated text, by re-reading it.

    Contexts keep only the last token's logits (all-token logits would cost
    hundreds of MB each), so the reply is read back in one decode afterwards;
    ``top`` alternatives per position come from the same rows.
    """
    llama = model.llama
    tokens = llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    out: list[dict[str, Any]] = []
    if not tokens:
        return out
    tops: list[list[tuple[int, float]]] = []
    logprobs = _continuation_logprobs(model, prompt, [tokens], top=top, tops=tops)[0]
    for k, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        piece, raw = _piece(llama, token)
        alternatives = []
        for alt, alt_logprob in tops[k] if top else []:
            alt_piece, alt_raw = _piece(llama, alt)
            alternatives.append({"token": alt_piece, "logprob": alt_logprob, "bytes": alt_raw})
        out.append({"token": piece, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return out
