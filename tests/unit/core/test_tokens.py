"""Token counting rules every tokenizer shares, and the fallback that over-counts."""

from __future__ import annotations

from batchyard.core.tokens import (
    IMAGE_TOKENS,
    FallbackTokenizer,
    Tokenizer,
    message_text,
    text_messages,
)

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def test_message_text_flattens_parts_and_counts_images() -> None:
    assert message_text("plain") == ("plain", 0)
    assert message_text(None) == ("", 0)
    parts = [{"type": "text", "text": "a"}, IMAGE, {"type": "text", "text": "b"}, IMAGE]
    assert message_text(parts) == ("a\nb", 2)
    plain, images = text_messages([{"role": "user", "content": parts}, {"role": "assistant"}])
    assert plain == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]
    assert images == 2


def test_fallback_counts_utf8_bytes_and_is_not_exact() -> None:
    tok = FallbackTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.exact is False
    assert tok.count("héllo") == 6
    assert tok.count_batch(["a", "ü", ""]) == [1, 2, 0]


def test_fallback_messages_add_overheads_and_image_cost() -> None:
    tok = FallbackTokenizer()
    one = tok.count_messages([{"role": "user", "content": "hi"}])
    assert one == tok.CONVERSATION_OVERHEAD + len("user") + 2 + tok.PER_MESSAGE_OVERHEAD
    with_image = tok.count_messages(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]
    )
    assert with_image == one + IMAGE_TOKENS
