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
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from batchyard.core.tokens import ChatTemplate, text_messages
from batchyard.engines.base import Choice, Completion, CompletionRequest, Usage
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

        Scoring reuses the prompt prefix a context already holds. Calibrated
        decide alternates two prompts that differ early (the outcomes listed
        in two orders); sending each to the instance that read it last keeps
        both cached instead of evicting one with the other.
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


def _continuation_logprobs(
    model: _Model, prompt: list[int], conts: list[list[int]]
) -> list[list[float]]:
    """Per-token log-probabilities of each continuation after ``prompt`` (in a worker thread).

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
            feed = tokens[:-1]
            for start in range(0, len(feed), n_batch):
                chunk = feed[start : start + n_batch]
                ctx.kv_cache_seq_rm(-1, n_prompt + start, -1)
                batch.set_batch(chunk, n_past=n_prompt + start, logits_all=True)
                ctx.decode(batch)
                rows = np.ctypeslib.as_array(ctx.get_logits(), shape=(len(chunk), n_vocab))
                for j in range(len(chunk)):
                    per_token.append(_log_softmax_at(rows[j], tokens[start + j + 1]))
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
    ) -> None:
        self.name = name
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
            started = time.perf_counter()
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
            elapsed = time.perf_counter() - started
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

    async def complete(self, request: CompletionRequest) -> Completion:
        plain, images = text_messages(request.messages)
        if images:
            raise UnsupportedInput(f"{self.name} reads text only; the request has image parts")
        kwargs: dict[str, Any] = {"messages": plain, "max_tokens": request.max_tokens}
        if request.temperature is not None:
            kwargs["temperature"] = request.temperature
        if request.top_p is not None:
            kwargs["top_p"] = request.top_p
        if request.stop:
            kwargs["stop"] = request.stop
        response_format = _response_format(request.response_format)
        if response_format is not None:
            kwargs["response_format"] = response_format

        def work(model: _Model) -> tuple[list[Choice], int, int]:
            model.holds = ""
            choices: list[Choice] = []
            prompt_tokens = output_tokens = 0
            for i in range(max(1, request.n)):
                seed = None if request.seed is None else request.seed + i
                try:
                    answer = model.llama.create_chat_completion(**kwargs, seed=seed)
                except ValueError as exc:
                    if "context window" in str(exc):
                        raise ContextWindowExceeded(str(exc)) from None
                    raise
                raw = answer["choices"][0]
                text = raw["message"].get("content") or ""
                usage = answer["usage"]
                prompt_tokens = int(usage["prompt_tokens"])
                output_tokens += int(usage["completion_tokens"])
                logprobs = _generated_logprobs(model, plain, text) if request.logprobs else None
                choices.append(
                    Choice(
                        text=text,
                        finish_reason=raw.get("finish_reason") or "stop",
                        logprobs=logprobs,
                    )
                )
            return choices, prompt_tokens, output_tokens

        choices, prompt_tokens, output_tokens = await self._run(
            self.version_for(request.model), work
        )
        return Completion(
            model=request.model,
            choices=choices,
            usage=Usage(input_tokens=prompt_tokens, output_tokens=output_tokens),
        )

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
        for version, pool in self._pools.items():
            if pool.loaded:
                await self.unload_version(version)
            pool.executor.shutdown(wait=False)


def _generated_logprobs(
    model: _Model, plain: list[dict[str, Any]], text: str
) -> list[dict[str, Any]]:
    """OpenAI-shaped ``logprobs.content`` for generated text, by re-reading it.

    Contexts keep only the last token's logits (all-token logits would cost
    hundreds of MB each), so the reply is read back in one decode afterwards.
    """
    llama = model.llama
    prompt = llama.tokenize(model.prompt_text(plain).encode("utf-8"), add_bos=False, special=True)
    tokens = llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    out: list[dict[str, Any]] = []
    if not tokens:
        return out
    logprobs = _continuation_logprobs(model, prompt, [tokens])[0]
    for token, logprob in zip(tokens, logprobs, strict=True):
        piece = llama.detokenize([token])
        out.append(
            {
                "token": piece.decode("utf-8", errors="replace"),
                "logprob": logprob,
                "bytes": list(piece),
            }
        )
    return out
