"""Whether llama.cpp's own grammar sampler lets a text through: the grammar as the engine runs it.

The embedded model's vocabulary is loaded alone (``vocab_only``: no weights,
no context), the text is tokenized with it, and each token is offered to a
grammar sampler (``llama_sampler_init_grammar``) as the only candidate: the
sampler masks a token the grammar forbids to -inf, and the text passes when
every token survives and the end-of-generation token may follow.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path
from typing import Any

import llama_cpp

__all__ = ["Vocab"]


class Vocab:
    def __init__(self, path: Path) -> None:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self._model, f"could not load {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.eos = llama_cpp.llama_vocab_eos(self.vocab)

    def close(self) -> None:
        llama_cpp.llama_model_free(self._model)

    def tokens(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        assert n >= 0
        return list(buf[:n])

    def compiles(self, gbnf: str) -> bool:
        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        if not sampler:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True

    def accepts(self, gbnf: str, text: str) -> bool:
        """Whether the grammar lets ``text`` through whole, and lets it end there."""
        sampler = llama_cpp.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        assert sampler, "the grammar does not parse"
        try:
            for token in self.tokens(text):
                if not self._allowed(sampler, token):
                    return False
                llama_cpp.llama_sampler_accept(sampler, token)
            return self._allowed(sampler, self.eos)
        finally:
            llama_cpp.llama_sampler_free(sampler)

    @staticmethod
    def _allowed(sampler: Any, token: int) -> bool:
        data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
        array = llama_cpp.llama_token_data_array(
            ctypes.cast(data, llama_cpp.llama_token_data_p), 1, -1, False
        )
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
        return not math.isinf(data[0].logit)
