"""Choosing a tokenizer by its spec (the GGUF tokenizer's counts need the model: integration)."""

from __future__ import annotations

import pytest

from batchyard.core.tokens import FallbackTokenizer
from batchyard.engines.tokenizers import tokenizer_for


def test_unknown_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer spec"):
        tokenizer_for("tiktoken:cl100k")
    assert isinstance(tokenizer_for("fallback"), FallbackTokenizer)
