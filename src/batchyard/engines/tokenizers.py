"""Exact token counts from a GGUF model file: its vocabulary and its chat template.

Quotes must count what the engine will later report, so the embedded engine
and the tokenizer build prompts from the same ``ChatTemplate``. Both read the
model file, which is why they live here at the edge with the engine and not
in the core (``core.tokens`` holds the ``Tokenizer`` seam they fit).
"""

from __future__ import annotations

import atexit
import threading
from pathlib import Path
from typing import Any

from batchyard.core.catalog import ModelSpec
from batchyard.core.tokens import (
    IMAGE_TOKENS,
    FallbackTokenizer,
    Tokenizer,
    text_messages,
)
from batchyard.engines.model_files import default_model_path

__all__ = ["ChatTemplate", "GgufTokenizer", "Tokenizers", "tokenizer_for"]


class ChatTemplate:
    """A GGUF's own chat template, rendered exactly as llama-cpp renders it.

    Both the tokenizer and the embedded engine's scorer build prompts here, so
    a quoted count and the engine's reported usage come from the same text.
    """

    _MARK = "\x00batchyard-reply\x00"

    def __init__(self, template: str, eos_token: str, bos_token: str) -> None:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self._prompt: Any = Jinja2ChatFormatter(
            template=template, eos_token=eos_token, bos_token=bos_token
        )
        self._closed: Any = Jinja2ChatFormatter(
            template=template,
            eos_token=eos_token,
            bos_token=bos_token,
            add_generation_prompt=False,
        )

    @classmethod
    def from_llama(cls, llama: Any) -> ChatTemplate | None:
        template = llama.metadata.get("tokenizer.chat_template")
        if not template:
            return None
        eos, bos = llama.token_eos(), llama.token_bos()
        model = llama._model
        return cls(
            template,
            model.token_get_text(eos) if eos != -1 else "",
            model.token_get_text(bos) if bos != -1 else "",
        )

    def prompt(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text up to where the assistant's reply begins (string contents)."""
        return str(self._prompt(messages=messages).prompt)

    def reply_suffix(self) -> str:
        """What the template writes after an assistant reply: its end-of-turn marker."""
        rendered = str(
            self._closed(
                messages=[
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": self._MARK},
                ]
            ).prompt
        )
        return rendered.split(self._MARK, 1)[1] if self._MARK in rendered else ""


class _Vocab:
    """A vocab-only model: loads in milliseconds and is read-only, so threads share it."""

    def __init__(self, path: Path) -> None:
        import llama_cpp
        from llama_cpp._utils import suppress_stdout_stderr

        # Even with verbose=False llama.cpp warns about the dummy context of a
        # vocab-only load; it is noise, not a problem.
        with suppress_stdout_stderr(disable=False):
            self.llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self.vocab = self.llama._model.vocab
        self.tokenize_fn = llama_cpp.llama_tokenize
        self.token_array = llama_cpp.llama_token
        self.template = ChatTemplate.from_llama(self.llama)


_vocabs: dict[Path, _Vocab] = {}
_vocabs_lock = threading.Lock()


@atexit.register
def _close_vocabs() -> None:
    # Llama's finaliser fails if it runs after llama_cpp's module teardown.
    with _vocabs_lock:
        for vocab in _vocabs.values():
            vocab.llama.close()
        _vocabs.clear()


def _vocab_for(path: Path) -> _Vocab:
    key = path.resolve()
    vocab = _vocabs.get(key)
    if vocab is not None:
        return vocab
    with _vocabs_lock:
        vocab = _vocabs.get(key)
        if vocab is None:
            vocab = _Vocab(key)
            _vocabs[key] = vocab
        return vocab


class GgufTokenizer:
    """Exact counts from a GGUF's own vocabulary and chat template.

    Calls ``llama_tokenize`` directly into a per-thread buffer that is reused
    across calls: ``Llama.tokenize`` allocates a context-sized array and a
    list per call, which dominates when quoting millions of short rows.
    """

    exact = True

    def __init__(self, model_path: Path | str) -> None:
        self.path = Path(model_path)
        self.name = f"gguf:{self.path.name}"
        v = _vocab_for(self.path)
        self._vocab = v.vocab
        self._tokenize = v.tokenize_fn
        self._token_array = v.token_array
        self._template = v.template
        self._local = threading.local()

    def _buffer(self, need: int) -> tuple[Any, int]:
        buf = getattr(self._local, "buf", None)
        cap: int = getattr(self._local, "cap", 0)
        if buf is None or cap < need:
            cap = max(need, 4096)
            buf = (self._token_array * cap)()
            self._local.buf, self._local.cap = buf, cap
        return buf, cap

    def _count_bytes(self, data: bytes, buf: Any, cap: int, special: bool) -> int:
        n: int = self._tokenize(self._vocab, data, len(data), buf, cap, False, special)
        if n < 0:
            buf, cap = self._buffer(-n)
            n = self._tokenize(self._vocab, data, len(data), buf, cap, False, special)
        return n

    def count(self, text: str) -> int:
        data = text.encode("utf-8")
        buf, cap = self._buffer(len(data) + 8)
        return self._count_bytes(data, buf, cap, False)

    def count_batch(self, texts: list[str]) -> list[int]:
        tokenize, vocab = self._tokenize, self._vocab
        buf, cap = self._buffer(4096)
        out: list[int] = []
        append = out.append
        for text in texts:
            data = text.encode("utf-8")
            n = tokenize(vocab, data, len(data), buf, cap, False, False)
            if n < 0:
                buf, cap = self._buffer(-n)
                n = tokenize(vocab, data, len(data), buf, cap, False, False)
            append(n)
        return out

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of the rendered prompt, exactly as the embedded engine builds it."""
        plain, images = text_messages(messages)
        extra = images * IMAGE_TOKENS
        if self._template is None:
            # No template in the file: count each message with a generous wrapper.
            wrap = FallbackTokenizer.PER_MESSAGE_OVERHEAD
            return extra + wrap + sum(self.count(m["content"]) + wrap for m in plain)
        prompt = self._template.prompt(plain).encode("utf-8")
        buf, cap = self._buffer(len(prompt) + 8)
        return extra + self._count_bytes(prompt, buf, cap, True)


def tokenizer_for(spec: str) -> Tokenizer:
    """A tokenizer from config: ``gguf:<path>``, ``fallback`` or ``default``."""
    if spec == "fallback":
        return FallbackTokenizer()
    if spec == "default":
        return GgufTokenizer(default_model_path())
    if spec.startswith("gguf:") and len(spec) > len("gguf:"):
        return GgufTokenizer(Path(spec[len("gguf:") :]))
    raise ValueError(f"unknown tokenizer spec {spec!r}: use gguf:<path>, fallback or default")


class Tokenizers:
    """One tokenizer per model's tokenizer spec, built on first use and shared.

    ``default`` means the embedded model's own file: the configured path, or
    the one the package ships.
    """

    def __init__(self, embedded_model_path: str | None = None) -> None:
        self._embedded = embedded_model_path
        self._made: dict[str, Tokenizer] = {}

    def for_model(self, model: ModelSpec) -> Tokenizer:
        spec = model.tokenizer
        if spec == "default" and self._embedded:
            spec = f"gguf:{self._embedded}"
        tok = self._made.get(spec)
        if tok is None:
            tok = self._made[spec] = tokenizer_for(spec)
        return tok
