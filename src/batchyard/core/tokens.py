"""Counting tokens before a model sees them, so quotes and limits are honest.

Quotes are priced and context windows enforced before any model runs, so the
count must never fall short of what the engine will later report: a short
count under-bills and lets oversized prompts through. ``GgufTokenizer`` uses
the model's own vocabulary and chat template, so it matches the embedded
engine; ``FallbackTokenizer`` is for models whose vocabulary we do not have
and over-counts on purpose (one token per UTF-8 byte: no BPE token is shorter
than a byte).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "IMAGE_TOKENS",
    "ChatTemplate",
    "FallbackTokenizer",
    "GgufTokenizer",
    "Tokenizer",
    "message_text",
    "text_messages",
    "tokenizer_for",
]

# The declared cost of one image part, the same for every tokenizer: OpenAI's
# price for a 1024x1024 high-detail image. A flat figure keeps quotes
# predictable; engines that read images report their own usage afterwards.
IMAGE_TOKENS = 765


@runtime_checkable
class Tokenizer(Protocol):
    """Counts tokens the way a model will see them."""

    name: str
    # True when counts equal the model's; False when they only bound it above.
    exact: bool

    def count(self, text: str) -> int: ...

    def count_batch(self, texts: list[str]) -> list[int]: ...

    def count_messages(self, messages: list[dict[str, Any]]) -> int: ...


def message_text(content: Any) -> tuple[str, int]:
    """A message's text and its number of image parts.

    Text parts are joined with newlines, the same way the embedded engine
    flattens them before applying a chat template, so counts and usage agree.
    """
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    texts: list[str] = []
    images = 0
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind in ("image_url", "input_image", "image"):
            images += 1
    return "\n".join(texts), images


def text_messages(messages: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Messages with string content (what chat templates expect), plus the image count."""
    out: list[dict[str, Any]] = []
    images = 0
    for message in messages:
        text, n = message_text(message.get("content"))
        images += n
        out.append({"role": str(message.get("role", "user")), "content": text})
    return out, images


class FallbackTokenizer:
    """Over-counts on purpose for models whose vocabulary we do not hold."""

    name = "fallback"
    exact = False
    # Chat templates wrap each message in a few special tokens and the role;
    # some inject a default system prompt. These bound both from above.
    PER_MESSAGE_OVERHEAD = 16
    CONVERSATION_OVERHEAD = 64

    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))

    def count_batch(self, texts: list[str]) -> list[int]:
        return [len(t.encode("utf-8")) for t in texts]

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        total = self.CONVERSATION_OVERHEAD
        for message in messages:
            text, images = message_text(message.get("content"))
            role = str(message.get("role", ""))
            total += len(text.encode("utf-8")) + len(role.encode("utf-8"))
            total += self.PER_MESSAGE_OVERHEAD + images * IMAGE_TOKENS
        return total


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
        # Imported here: the core does not otherwise depend on the engines.
        from batchyard.engines.model_files import default_model_path

        return GgufTokenizer(default_model_path())
    if spec.startswith("gguf:") and len(spec) > len("gguf:"):
        return GgufTokenizer(Path(spec[len("gguf:") :]))
    raise ValueError(f"unknown tokenizer spec {spec!r}: use gguf:<path>, fallback or default")
