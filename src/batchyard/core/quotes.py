"""What a call can cost at most, and whether it fits the model: one rule for every door.

Every door holds the most a call can cost before anything runs (402 before a
token is spent), and refuses a prompt that leaves no room for its answer in
the model's context window (a coded 400, nothing held). A chat completion, a
line of a batch file, a run's rows and a deferred item are quoted and checked
by these functions, so the doors cannot drift apart on either rule.
"""

from __future__ import annotations

from batchyard.core.catalog import ModelSpec
from batchyard.core.money import quote_ticks
from batchyard.core.prices import Price
from batchyard.errors import ContextWindowExceeded

__all__ = ["check_context", "direct_price", "fits", "quote", "room"]


def direct_price(model: ModelSpec) -> Price:
    """The model's own price (the catalog's), which a call is charged without a market route."""
    return Price(model.input_per_mtok, model.output_per_mtok)


def quote(model: ModelSpec, input_tokens: int, max_tokens: int, n: int = 1) -> int:
    """The most a call can cost, in ticks: its prompt, and ``n`` answers of ``max_tokens`` each.

    Rounded up to the tick: a hold never falls short of the charge.
    """
    return quote_ticks(direct_price(model).cost(input_tokens, max_tokens * max(1, n)))


def room(model: ModelSpec, max_tokens: int) -> int:
    """The most prompt tokens that leave room for an answer of ``max_tokens`` in the window."""
    return model.context_window - max_tokens


def fits(model: ModelSpec, prompt_tokens: int, max_tokens: int) -> bool:
    """Whether ``prompt_tokens`` and an answer of ``max_tokens`` fit the model's context window."""
    return prompt_tokens <= room(model, max_tokens)


def check_context(
    model: ModelSpec,
    prompt_tokens: int,
    max_tokens: int,
    *,
    param: str,
    where: str = "",
    output: str = "max_tokens",
) -> None:
    """``ContextWindowExceeded`` (400) naming ``param`` when the call cannot fit the window.

    ``where`` prefixes the message with the request's place in a batch
    (``"requests[3]: "``); ``output`` is the field the door calls the answer's
    length; ``max_tokens`` 0 is an input alone (embeddings).
    """
    if fits(model, prompt_tokens, max_tokens):
        return
    asked = f"{prompt_tokens} prompt tokens" + (f" + {output} {max_tokens}" if max_tokens else "")
    raise ContextWindowExceeded(
        f"{where}{asked} exceed the {model.context_window}-token context window of {model.id}",
        param=param,
    )
