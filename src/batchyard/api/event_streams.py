"""One loop for every streamed answer, whichever dialect writes its events.

OpenAI's chunks (``openai_door``) and Anthropic's events (``messages``) are
the same stream underneath: the dispatcher's pieces of the answer, then its
settled result. ``events`` walks that stream once for both; a ``Dialect``
only says what each step looks like on the wire: the opening events, the
events of one piece (perhaps none), the whole answer and the closing events,
the error event a failure after the status line becomes, and a saved answer
replayed as the stream it was.

The events end with the whole answer (``service.idempotency.Whole``), which
``run_once`` keeps under the request's Idempotency-Key; a stream that does not
end whole closes the dispatcher's stream, which stops the engine and bills
exactly the tokens produced.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

from batchyard.engines.protocol import Delta
from batchyard.errors import BatchyardError, InternalError
from batchyard.service.idempotency import Whole
from batchyard.work.dispatcher import DispatchResult

__all__ = ["DONE", "Dialect", "Piece", "events", "sse"]

Piece = Delta | DispatchResult

#: OpenAI's last event.
DONE = b"data: [DONE]\n\n"


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event of JSON ``data``, named where the dialect names its events."""
    head = f"event: {event}\n".encode() if event is not None else b""
    return head + b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class Dialect(Protocol):
    """How one answer's stream is written in one dialect (state may live here: blocks open)."""

    def opening(self) -> list[bytes]:
        """The events before the first piece."""
        ...

    def piece(self, piece: Delta) -> list[bytes]:
        """The events of one piece of the answer (none for an empty piece)."""
        ...

    def whole(self, result: DispatchResult) -> dict[str, Any]:
        """The whole answer, as a non-streamed call answers it and as it is kept."""
        ...

    def closing(self, whole: dict[str, Any]) -> list[bytes]:
        """The events after the last piece."""
        ...

    def error(self, exc: BatchyardError) -> bytes:
        """A failure after the status line has gone, as the dialect's clients read it."""
        ...

    def replay(self, whole: dict[str, Any]) -> bytes:
        """A kept answer as the stream it was (the same request again under its key)."""
        ...


async def events(
    dialect: Dialect, first: Piece, pieces: AsyncIterator[Piece]
) -> AsyncGenerator[bytes | Whole, None]:
    """The stream's events in ``dialect``, then its whole answer; see the module docstring.

    ``first`` is the piece the door awaited before answering (so a refusal
    was an ordinary error answer); ``pieces`` are the rest.
    """
    finished = False
    try:
        for event in dialect.opening():
            yield event
        piece = first
        while not isinstance(piece, DispatchResult):
            for event in dialect.piece(piece):
                yield event
            piece = await anext(pieces)
        whole = dialect.whole(piece)
        for event in dialect.closing(whole):
            yield event
        finished = True
        yield Whole(whole)
    except BatchyardError as exc:
        yield dialect.error(exc)
    except StopAsyncIteration:
        yield dialect.error(InternalError("the stream ended without a result"))
    finally:
        if not finished:
            await pieces.aclose()  # type: ignore[attr-defined]
