"""Counting tokens before a model sees them, so quotes and limits are honest.

Quotes are priced and context windows enforced before any model runs, so the
count must never fall short of what the engine will later report: a short
count under-bills and lets oversized prompts through. This module holds the
``Tokenizer`` seam and the rules every tokenizer shares (how a message's text
and images are counted). ``FallbackTokenizer`` is for models whose vocabulary
we do not have and over-counts on purpose (one token per UTF-8 byte: no BPE
token is shorter than a byte). The exact tokenizer reads a model file, so it
lives with the engine that reads the same file (``engines.tokenizers``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from batchyard.core.catalog import ModelSpec

__all__ = [
    "IMAGE_TOKENS",
    "FallbackTokenizer",
    "Tokenizer",
    "TokenizerSource",
    "message_text",
    "text_messages",
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


@runtime_checkable
class TokenizerSource(Protocol):
    """Where the tokenizer of a model comes from (``engines.tokenizers.Tokenizers``)."""

    def for_model(self, model: ModelSpec) -> Tokenizer: ...


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
