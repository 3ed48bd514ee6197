"""How one sequence of the embedded engine picks its next token, and what it reports of it.

Every sequence in the scheduler's batch has its own llama.cpp sampler chain,
so two requests with different temperatures, seeds, penalties or grammars
share one ``llama_decode`` and still sample as if each ran alone. The chain
is llama.cpp's own (``llama_sampler_chain_*``), in the order llama-cpp-python
builds it: logit bias, penalties, grammar, then greedy at temperature 0 or
top-k / top-p / min-p / temperature / a seeded draw.

Log-probabilities are read from the raw logits row before the chain touches
it (OpenAI reports the model's distribution, not the sampler's), and stop
strings are matched on the decoded text, holding back a tail that could
still become one so a stream never shows a stop string's first characters.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchyard.engines.json_grammar import gbnf, resolved

__all__ = [
    "SamplingParams",
    "StopMatcher",
    "build_sampler",
    "grammar_for",
    "log_softmax",
    "token_piece",
    "top_logprobs",
]

# llama-cpp-python's defaults for what a request leaves unset (its chat and
# text completion entry points differ only in temperature).
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
CHAT_TEMPERATURE = 0.2
TEXT_TEMPERATURE = 0.8
PENALTY_LAST_N = 64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What one sequence samples with; ``None`` fields take llama-cpp-python's defaults."""

    temperature: float
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    min_p: float = DEFAULT_MIN_P
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    #: A compiled ``LlamaGrammar`` (json_schema answers, tool calls), or ``None``.
    grammar: Any = None

    @property
    def plain_greedy(self) -> bool:
        """Whether the chain is greedy alone: its pick is then the logits row's argmax.

        llama.cpp's sampler copies the whole vocabulary (49,152 entries on the
        embedded model) into a candidate array before its greedy pick, about a
        tenth of a millisecond a token on the step thread; the argmax of the row
        picks the same token (the first of equal maxima, as llama.cpp's greedy does).
        """
        return (
            self.temperature <= 0.0
            and self.grammar is None
            and not self.logit_bias
            and not self.frequency_penalty
            and not self.presence_penalty
        )


_grammars: dict[str, Any] = {}


def grammar_for(
    schema: dict[str, Any] | None, *, param: str = "response_format.json_schema.schema"
) -> Any:
    """llama-cpp-python's grammar for a JSON schema (any JSON object when ``None``), cached.

    The schema's references are resolved and its properties kept in the
    order written (``json_grammar``); one the grammar cannot hold is a 400
    ``unsupported_schema`` naming ``param``, never a grammar for any JSON in
    its place. A compiled grammar is only its GBNF text; each sequence gets
    its own grammar sampler from it, so one compilation serves every request
    with the same schema.
    """
    from llama_cpp import llama_grammar

    key = json.dumps(schema) if schema is not None else ""
    found = _grammars.get(key)
    if found is None:
        if schema is None:
            found = llama_grammar.LlamaGrammar.from_string(llama_grammar.JSON_GBNF, verbose=False)
        else:
            defs: dict[str, Any] = {}
            root = resolved(schema, defs, prefix="def-", param=param)
            text = gbnf({**root, "$defs": defs} if defs else root, param=param)
            found = llama_grammar.LlamaGrammar.from_string(text, verbose=False)
        if len(_grammars) > 256:
            _grammars.clear()
        _grammars[key] = found
    return found


def build_sampler(model: Any, n_vocab: int, params: SamplingParams) -> Any:
    """A fresh sampler chain (``llama_cpp._internals.LlamaSampler``) for one sequence."""
    import llama_cpp
    from llama_cpp import _internals

    make: Any = _internals.LlamaSampler
    sampler = make()
    if params.logit_bias:
        sampler.add_logit_bias(n_vocab, params.logit_bias)
    if params.frequency_penalty or params.presence_penalty:
        sampler.add_penalties(
            n_vocab=n_vocab,
            penalty_last_n=PENALTY_LAST_N,
            penalty_repeat=1.0,
            penalty_freq=params.frequency_penalty,
            penalty_present=params.presence_penalty,
        )
    if params.grammar is not None:
        sampler.add_grammar(model, params.grammar)
    if params.temperature <= 0.0:
        sampler.add_greedy()
    else:
        seed = llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
        sampler.add_top_k(params.top_k)
        sampler.add_top_p(params.top_p, 1)
        sampler.add_min_p(params.min_p, 1)
        sampler.add_temp(params.temperature)
        sampler.add_dist(seed)
    return sampler


def log_softmax(row: Any) -> Any:
    """Log-probabilities of a logits row, in float64."""
    row64 = np.asarray(row, dtype=np.float64)
    peak = float(row64.max())
    return row64 - (peak + float(np.log(np.exp(row64 - peak).sum())))


def top_logprobs(logprobs: Any, top: int) -> list[tuple[int, float]]:
    """The ``top`` likeliest tokens of a log-probability row, best first."""
    if top <= 0:
        return []
    best = np.argpartition(-logprobs, top - 1)[:top]
    best = best[np.argsort(-logprobs[best])]
    return [(int(t), float(logprobs[t])) for t in best]


def token_piece(vocab: Any, token: int) -> bytes:
    """The bytes a token stands for (special tokens render as nothing)."""
    import llama_cpp

    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    return bytes(buf.raw[: max(0, n)])


class StopMatcher:
    """Stop strings over text that arrives piece by piece.

    ``feed`` returns the text that may be shown now and whether a stop string
    ended the answer; text that could still be the start of a stop string is
    held back until the next piece decides it. ``matched`` is the stop string
    that ended the answer (the earliest in the text), for Anthropic's
    ``stop_sequence``.
    """

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.matched: str | None = None
        self.text = ""
        self.shown = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        if not self.stops:
            out, self.shown = self.text[self.shown :], len(self.text)
            return out, False
        window = max(0, self.shown - max(len(s) for s in self.stops))
        hits = [(i, s) for s, i in ((s, self.text.find(s, window)) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.text = self.text[:at]
            out, self.shown = self.text[self.shown :], len(self.text)
            return out, True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        safe = max(self.shown, len(self.text) - hold)
        out, self.shown = self.text[self.shown : safe], safe
        return out, False

    def flush(self) -> str:
        out, self.shown = self.text[self.shown :], len(self.text)
        return out
