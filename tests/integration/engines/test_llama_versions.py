"""LoRA versions on the embedded engine: one adapter on the base model, sequences of its scheduler.

The adapter is the committed ``tests/data/smollm2-sentiment-lora.gguf`` (see
``tests/data/README.md``). llama-cpp-python loaded with the same adapter
(``Llama(model_path, lora_path=…)``) is the reference for what the version
must answer; idle time and keep-warm windows run on a ManualClock, the loads
are real.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from batchyard.core.clock import ManualClock
from batchyard.engines.llama import scheduler as llama_scheduler
from batchyard.engines.llama_cpp import LlamaCppEngine, VersionSpec
from batchyard.engines.model_files import default_model_path
from batchyard.engines.protocol import CompletionRequest
from batchyard.errors import BatchyardError

pytestmark = pytest.mark.model

ADAPTER = Path(__file__).resolve().parents[2] / "data" / "smollm2-sentiment-lora.gguf"
SENTIMENT = (
    "Questions:\nsentiment: How does the writer feel?\n  - positive: pleased\n"
    "  - negative: unhappy\n  - neutral: neither\n\n"
    "Reply with one line per question, in this order and nothing else:\nsentiment: <answer id>"
    "\n\nText:\n{text}"
)


# The adapter was tuned to answer this prompt with one labelled line; the base never does.
LABELLED = re.compile(r"sentiment: (positive|negative|neutral)")


def chat(model: str, text: str, max_tokens: int = 8) -> CompletionRequest:
    messages = [{"role": "user", "content": SENTIMENT.format(text=text)}]
    return CompletionRequest(model, messages, max_tokens, temperature=0.0)


def direct(text: str, *, lora: bool, max_tokens: int = 8) -> str:
    """llama-cpp-python's own greedy answer, the adapter loaded directly (or not)."""
    import llama_cpp

    extra = {"lora_path": str(ADAPTER)} if lora else {}
    llm = llama_cpp.Llama(
        str(default_model_path()), n_ctx=2048, flash_attn=True, verbose=False, **extra
    )
    try:
        request = chat("x", text, max_tokens)
        out: Any = llm.create_chat_completion(
            messages=request.messages, max_tokens=max_tokens, temperature=0
        )
        return str(out["choices"][0]["message"]["content"])
    finally:
        llm.close()


def engine(clock: ManualClock | None = None, **options: Any) -> LlamaCppEngine:
    versions = options.pop("versions", None) or {"tuned": VersionSpec("lora", ADAPTER)}
    return LlamaCppEngine(
        default_model_path(),
        n_ctx=512,
        slots=options.pop("slots", 1),
        versions=versions,
        clock=clock,
        **options,
    )


async def test_a_lora_version_is_an_adapter_on_the_base_and_answers_as_the_adapter() -> None:
    eng = engine()
    try:
        await eng.load_version("tuned")
        slot = eng._states["tuned"]
        # No second model: the adapter lives on the base, its requests on the base's scheduler.
        assert slot.model is None and slot.adapter is not None
        assert eng.is_loaded(None) and eng.is_loaded("tuned")
        assert eng.version_bytes("tuned") == ADAPTER.stat().st_size
        text = "The update broke my phone again, third time this month."
        tuned = (await eng.complete(chat("tuned", text))).text
        # Compared on a context with nothing else cached: beside other cached prompts a
        # sequence's cells sit elsewhere and llama.cpp's kernels sum in another order,
        # which can flip a greedy pick (the base does it beside another base prompt too).
        await eng.unload_version(None)
        base = (await eng.complete(chat("base", text))).text
        loop = asyncio.get_running_loop()
        assert tuned == await loop.run_in_executor(None, lambda: direct(text, lora=True))
        assert base == await loop.run_in_executor(None, lambda: direct(text, lora=False))
        assert tuned != base
        # Unloaded, the adapter is freed and the base still serves; used again, it reloads.
        await eng.unload_version("tuned")
        assert not eng.is_loaded("tuned") and eng.is_loaded(None)
        assert LABELLED.fullmatch((await eng.complete(chat("tuned", text))).text)
    finally:
        await eng.aclose()


async def test_base_and_version_requests_share_one_scheduler_a_group_a_step(monkeypatch) -> None:
    applied: list[str] = []
    original = llama_scheduler.Scheduler._apply

    def spy(self: Any, adapter: Any) -> None:
        if adapter is not self._applied:
            applied.append(adapter.name if adapter is not None else "base")
        original(self, adapter)

    monkeypatch.setattr(llama_scheduler.Scheduler, "_apply", spy)
    texts = ["Best purchase ever!", "It broke.", "Meh. It arrived.", "Refund, now."]
    eng = engine(slots=4)
    try:
        got = await asyncio.gather(
            *(eng.complete(chat(m, t, 12)) for t in texts for m in ("tuned", "base"))
        )
        assert eng._states["tuned"].model is None  # one scheduler: the base's
    finally:
        await eng.aclose()
    # The groups took turns on the one context: switched in both directions, and at
    # most once per turn of ADAPTER_TURN steps.
    assert "tuned" in applied and applied.count("base") >= 1
    answers = dict(zip([(m, t) for t in texts for m in ("tuned", "base")], got, strict=True))
    for text in texts:
        # Each request was decoded under its own adapter: beside the other group's
        # sequences, the version still answers as the adapter, the base as the base.
        tuned, base = answers[("tuned", text)].text, answers[("base", text)].text
        assert LABELLED.fullmatch(tuned), (text, tuned)
        assert not LABELLED.fullmatch(base), (text, base)


async def test_an_unloaded_adapter_fails_its_running_requests_and_spares_the_base() -> None:
    eng = engine(slots=2)
    try:
        await eng.load_version("tuned")
        long = CompletionRequest(
            "tuned", [{"role": "user", "content": "Tell me a long story."}], 400, temperature=0.0
        )
        running = asyncio.create_task(eng.complete(long))
        base = asyncio.create_task(eng.complete(chat("base", "It broke.")))
        await asyncio.sleep(0.5)
        await eng.unload_version("tuned")
        with pytest.raises(BatchyardError) as gone:
            await running
        assert gone.value.code == "model_unloaded" and gone.value.retryable
        assert (await base).text
        assert not eng.is_loaded("tuned")
    finally:
        await eng.aclose()


async def test_idle_versions_are_unloaded_and_the_budget_evicts_the_least_recently_used(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    second = shutil.copyfile(ADAPTER, tmp_path / "second.gguf")
    size = ADAPTER.stat().st_size
    versions = {"a": VersionSpec("lora", ADAPTER), "b": VersionSpec("lora", second)}
    eng = engine(clock, versions=versions, idle_s=60.0, memory_budget=size + size // 2)
    try:
        await eng.complete(chat("a", "It broke.", 2))
        clock.advance(5)
        # b does not fit beside a: a, idle and not kept warm, is unloaded first.
        await eng.complete(chat("b", "It broke.", 2))
        assert eng.loaded_versions() == ["b"]
        # Kept warm, b stays; a cannot load without going over the budget.
        keep = clock.time() + 3600
        eng.keep_loaded("b", keep)
        with pytest.raises(BatchyardError) as full:
            await eng.complete(chat("a", "It broke.", 2))
        assert full.value.code == "model_memory_full" and full.value.status == 503
        assert full.value.retryable
        # Idle time: b is past idle_s but inside its keep-warm window, so it stays.
        clock.advance(120)
        assert await eng.evict_idle() == []
        assert eng.warm_until("b") == keep
        clock.advance(3600)
        assert await eng.evict_idle() == ["b"]
        assert eng.loaded_versions() == [] and eng.is_loaded(None)  # the base stays
    finally:
        await eng.aclose()


async def test_a_version_the_gate_refuses_is_forgotten_and_answered_as_missing() -> None:
    served = {"tuned": True}

    async def gate(name: str) -> bool:
        return served.get(name, True)

    eng = engine(gate=gate)
    try:
        await eng.complete(chat("tuned", "It broke.", 2))
        served["tuned"] = False  # deleted through another process
        with pytest.raises(BatchyardError) as missing:
            await eng.complete(chat("tuned", "It broke.", 2))
        assert (missing.value.status, missing.value.code) == (404, "model_not_found")
        assert "tuned" not in eng.versions and eng.loaded_versions() == []
    finally:
        await eng.aclose()


async def test_a_version_file_changed_at_rest_is_refused_on_the_loading_thread(
    tmp_path: Path,
) -> None:
    from batchyard.engines.model_files import sha256_of

    copy = shutil.copyfile(ADAPTER, tmp_path / "a.gguf")
    spec = VersionSpec("lora", copy, sha256_of(ADAPTER))
    copy.write_bytes(copy.read_bytes()[:-1] + b"\x01")
    eng = engine(versions={"tuned": spec})
    try:
        with pytest.raises(BatchyardError) as corrupt:
            await eng.load_version("tuned")
        assert corrupt.value.code == "model_version_corrupt"
        assert not eng.is_loaded("tuned")
    finally:
        await eng.aclose()


async def test_a_full_weights_version_counts_the_shelf_it_may_fill_in_the_budget() -> None:
    """Full weights get a scheduler of their own, so a shelf of their own, up to its bound."""
    full = {"full": VersionSpec("gguf", default_model_path())}
    sizes = []
    for shelf in (0, 8 << 20):
        eng = engine(versions=dict(full), shelf_bytes=shelf)
        try:
            await eng.load()
            estimated = eng.version_bytes("full")
            await eng.load_version("full")
            sizes.append((estimated, eng.version_bytes("full")))
        finally:
            await eng.aclose()
    (est0, loaded0), (est8, loaded8) = sizes
    assert est8 - est0 == loaded8 - loaded0 == 8 << 20
    assert loaded0 > default_model_path().stat().st_size // 2  # tensors and their KV cache
