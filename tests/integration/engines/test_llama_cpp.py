"""The embedded engine on the real SmolLM2 GGUF: answers, scores, versions, and a free loop."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from batchyard.engines.llama.requests import candidate_tokens
from batchyard.engines.llama_cpp import LlamaCppEngine, VersionSpec
from batchyard.engines.model_files import default_model_path
from batchyard.engines.protocol import CompletionRequest, Engine, ScoringEngine
from batchyard.engines.tokenizers import GgufTokenizer, tokenizer_for
from batchyard.errors import ContextWindowExceeded, UnsupportedInput
from tests.support.waits import settles

# One engine (and one event loop: its queues belong to a loop) for the module,
# so the model loads once.
pytestmark = [pytest.mark.model, pytest.mark.asyncio(loop_scope="module")]

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[LlamaCppEngine]:
    path = default_model_path()
    eng = LlamaCppEngine(path, n_ctx=512, slots=2, versions={"copy": VersionSpec("gguf", path)})
    yield eng
    await eng.aclose()


def ask(messages: list[dict], max_tokens: int = 12, **options: object) -> CompletionRequest:
    return CompletionRequest("smollm2", messages, max_tokens, **options)  # type: ignore[arg-type]


async def test_lazy_load_then_a_completion_with_real_usage(engine: LlamaCppEngine) -> None:
    assert isinstance(engine, Engine) and isinstance(engine, ScoringEngine)
    assert not engine.loaded
    done = await engine.complete(ask(CAPITAL, temperature=0.0))
    assert engine.loaded and engine.is_loaded()
    assert done.text.strip()
    assert 0 < done.usage.output_tokens <= 12
    assert done.usage.input_tokens == tokenizer_for("default").count_messages(CAPITAL)
    assert engine.last_load_seconds is not None and engine.last_load_seconds > 0


async def test_n_samples_and_generated_logprobs(engine: LlamaCppEngine) -> None:
    done = await engine.complete(ask(CAPITAL, max_tokens=4, n=2, seed=3, logprobs=True))
    assert len(done.choices) == 2
    for choice in done.choices:
        logprobs = choice.logprobs or []
        assert logprobs, "logprobs were asked for"
        assert "".join(lp["token"] for lp in logprobs) == choice.text
        assert all(math.isfinite(lp["logprob"]) and lp["logprob"] <= 0 for lp in logprobs)


async def test_scoring_prefers_the_right_answer(engine: LlamaCppEngine) -> None:
    scores, usage = await engine.score("smollm2", CAPITAL, ["Paris", "Tokyo", "Banana"])
    assert all(math.isfinite(s) and s < 0 for s in scores)
    assert scores[0] == max(scores)
    assert usage.input_tokens == tokenizer_for("default").count_messages(CAPITAL)
    # Output usage is the sum of candidate tokens, each being evaluated.
    gguf = tokenizer_for("default")
    assert usage.output_tokens == sum(gguf.count(c) for c in ["Paris", "Tokyo", "Banana"])
    again, _ = await engine.score("smollm2", CAPITAL, ["Paris", "Tokyo", "Banana"])
    assert again.index(max(again)) == 0


async def test_candidates_tokenize_as_they_would_after_the_whole_prompt(
    engine: LlamaCppEngine,
) -> None:
    # Scoring tokenizes each candidate after the prompt's last special token only.
    await engine.load()
    model = engine._states[None].model
    assert model is not None
    tokenize = model.llama.tokenize
    messages = [*CAPITAL, {"role": "assistant", "content": "Paris."}, *CAPITAL]
    text = model.prompt_text(messages)
    prompt = tokenize(text.encode("utf-8"), False, True)
    candidates = ["Paris", " Paris", "paris: yes", "Ünïcödé ✓", "<|im_end|>", "a\nb"]
    whole = [tokenize((text + c).encode("utf-8"), False, True)[len(prompt) :] for c in candidates]
    assert candidate_tokens(model, text, prompt, candidates, turn_end=False) == whole
    # Kept per turn opening and candidates: another prompt's text gives the same tokens,
    # and what the caller does to the answer does not reach what is kept.
    other = model.prompt_text([{"role": "user", "content": "Something else entirely."}])
    other_prompt = tokenize(other.encode("utf-8"), False, True)
    got = candidate_tokens(model, other, other_prompt, candidates, turn_end=False)
    assert got == whole
    got[0].append(7)
    assert candidate_tokens(model, other, other_prompt, candidates, turn_end=False) == whole
    assert candidate_tokens(model, text, prompt, candidates, turn_end=True) == [
        [*w, model.turn_end] for w in whole
    ]


async def test_json_schema_constrains_the_output(engine: LlamaCppEngine) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    done = await engine.complete(ask(CAPITAL, max_tokens=24, response_format=fmt))
    assert json.loads(done.text)["city"] in {"Paris", "Rome"}


async def test_generation_does_not_block_the_event_loop(engine: LlamaCppEngine) -> None:
    # If generation ran on the loop, nothing else could run until it ended:
    # the ticker would get no turn between the first token and the last.
    ticks_while_generating = 0
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    work = asyncio.gather(*[engine.complete(ask(story, max_tokens=48)) for _ in range(2)])
    while not work.done():
        await asyncio.sleep(0)
        ticks_while_generating += 1
    done = await work
    assert all(c.usage.output_tokens > 0 for c in done)
    assert ticks_while_generating > 100


async def test_a_cancelled_call_returns_its_context_to_the_pool(engine: LlamaCppEngine) -> None:
    story = [{"role": "user", "content": "Tell me everything about the ocean."}]
    tasks = [asyncio.create_task(engine.complete(ask(story, max_tokens=40))) for _ in range(2)]
    await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    done = await settles(engine.complete(ask(CAPITAL, max_tokens=3)))
    assert done.usage.output_tokens > 0


async def test_versions_load_on_demand_and_report_observed_load_time(
    engine: LlamaCppEngine,
) -> None:
    assert not engine.is_loaded("copy")
    assert engine.load_seconds("copy") is None
    seconds = await engine.load_version("copy")
    assert engine.is_loaded("copy")
    assert seconds > 0 and engine.load_seconds("copy") == seconds == engine.last_load_seconds
    assert await engine.load_version("copy") == seconds  # already loaded: no reload
    done = await engine.complete(ask(CAPITAL, max_tokens=3, temperature=0.0))
    assert done.usage.output_tokens > 0
    copy = await engine.complete(CompletionRequest("copy", CAPITAL, 3, temperature=0.0))
    assert copy.model == "copy" and copy.usage.input_tokens == done.usage.input_tokens
    await engine.unload_version("copy")
    assert not engine.is_loaded("copy")
    with pytest.raises(KeyError):
        engine.is_loaded("nope")


async def test_images_and_oversized_prompts_are_refused(engine: LlamaCppEngine) -> None:
    image = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
    ]
    with pytest.raises(UnsupportedInput):
        await engine.complete(ask([{"role": "user", "content": image}]))
    huge = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(ContextWindowExceeded):
        await engine.score("smollm2", huge, ["yes"])
    with pytest.raises(ContextWindowExceeded):
        await engine.complete(ask(huge))


@pytest.mark.parametrize(
    "messages",
    [
        CAPITAL,
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour. ☀️ naïve"},
        ],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": [{"type": "text", "text": "Count to three."}]},
        ],
    ],
)
async def test_tokenizer_never_undercounts_the_engine(
    engine: LlamaCppEngine, messages: list[dict]
) -> None:
    tokenizer = tokenizer_for("default")
    assert isinstance(tokenizer, GgufTokenizer)
    done = await engine.complete(ask(messages, max_tokens=2))
    assert tokenizer.count_messages(messages) >= done.usage.input_tokens
    assert tokenizer.count_messages(messages) == done.usage.input_tokens  # exact, in fact


async def test_llama_cpp_warnings_do_not_reach_stderr_raw() -> None:
    """llama.cpp's log lines go through logging, not printed raw over a JSON log.

    llama-cpp-python's quiet mode maps ggml's levels by an older enum, so its
    warnings (the shared cache's ``n_ctx_seq > n_ctx_train``) were printed to
    stderr. A fresh process, since the callback is installed once per process.
    """
    import subprocess
    import sys

    script = (
        "import asyncio\n"
        "from batchyard.engines.llama_cpp import LlamaCppEngine\n"
        "from batchyard.engines.model_files import default_model_path\n"
        "async def main():\n"
        "    eng = LlamaCppEngine(default_model_path(), n_ctx=16384, slots=2)\n"
        "    await eng.load()\n"
        "    await eng.aclose()\n"
        "asyncio.run(main())\n"
    )
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "n_ctx_seq" not in done.stderr
    assert "llama_context" not in done.stderr


async def test_inputs_embedded_together_equal_each_alone(engine: LlamaCppEngine) -> None:
    """A text's vector does not depend on what it was sent with.

    Short inputs share a decode while their rows stay under 64 (flash attention's
    row-by-row kernel, as when read alone); a float's last bit may move with the
    pooling's matrix shape, nothing more.
    """
    texts = [
        "The cat sat on the mat, watching the rain run down the window all afternoon.",
        "hello",
        "Prices rose sharply in March, analysts said, as shipping costs climbed again "
        "and retailers passed the increase on to customers across the region.",
        "A short note.",
        "Our quarterly report shows revenue up eight percent, costs flat, and a new "
        "office opening in Lisbon next spring, pending the board's approval in May.",
    ]
    together = await engine.embed("smollm2", texts)
    alone = [await engine.embed("smollm2", [t]) for t in texts]
    for got, one in zip(together.vectors, alone, strict=True):
        assert got == pytest.approx(one.vectors[0], abs=1e-6)
        assert math.fsum(x * x for x in got) == pytest.approx(1.0, abs=1e-5)
    assert together.usage.input_tokens == sum(one.usage.input_tokens for one in alone)
