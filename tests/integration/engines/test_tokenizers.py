"""The GGUF tokenizer matches the model's vocabulary; the fallback never counts below it."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchyard.core.tokens import IMAGE_TOKENS, FallbackTokenizer
from batchyard.engines.model_files import default_model_path
from batchyard.engines.tokenizers import GgufTokenizer, _vocab_for, tokenizer_for

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


@pytest.fixture(scope="module")
def gguf() -> GgufTokenizer:
    tok = tokenizer_for("default")
    assert isinstance(tok, GgufTokenizer)
    return tok


@pytest.mark.model
def test_gguf_counts_match_the_model_vocabulary(gguf: GgufTokenizer) -> None:
    llama = _vocab_for(gguf.path).llama
    texts = ["hello world", "", "naïve café ☕", "x" * 9000, "<|im_end|> is text here"]
    expected = [len(llama.tokenize(t.encode(), add_bos=False)) for t in texts]
    assert [gguf.count(t) for t in texts] == expected
    assert gguf.count_batch(texts) == expected
    assert gguf.exact is True
    assert gguf.name == "gguf:SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.model
def test_gguf_vocab_is_cached_per_path(gguf: GgufTokenizer) -> None:
    again = tokenizer_for(f"gguf:{default_model_path()}")
    assert isinstance(again, GgufTokenizer)
    assert again._vocab is gguf._vocab


@pytest.mark.model
def test_gguf_messages_include_the_chat_template_and_images(gguf: GgufTokenizer) -> None:
    messages = [{"role": "user", "content": "hello world"}]
    with_template = gguf.count_messages(messages)
    # <|im_start|>, role, newline, text, <|im_end|>, newline, the default system
    # prompt the template injects, and the assistant opening.
    assert with_template > gguf.count("hello world") + 10
    image_messages = [{"role": "user", "content": [{"type": "text", "text": "hello world"}, IMAGE]}]
    assert gguf.count_messages(image_messages) == with_template + IMAGE_TOKENS


@pytest.mark.model
def test_gguf_count_is_thread_safe(gguf: GgufTokenizer) -> None:
    texts = [f"row {i} " * (i % 50) for i in range(400)]
    expected = gguf.count_batch(texts)
    results: list[list[int]] = []

    def work() -> None:
        results.append([gguf.count(t) for t in texts])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 4


@pytest.mark.model
@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_fallback_never_counts_below_the_real_tokenizer(text: str) -> None:
    gguf = tokenizer_for("default")
    assert FallbackTokenizer().count(text) >= gguf.count(text)
    messages = [{"role": "system", "content": text}, {"role": "user", "content": text}]
    assert FallbackTokenizer().count_messages(messages) >= gguf.count_messages(messages)
