"""What a call can cost at most, what it is charged, and whether it fits: one rule each.

Every door holds the most a call can cost before anything runs (402 before a
token is spent), and refuses a prompt that leaves no room for its answer in
the model's context window (a coded 400, nothing held). A chat completion, a
line of a batch file, a run's rows and a deferred item are quoted and checked
by these functions, so the doors cannot drift apart on either rule.

What a call is charged is ``charge``: its usage at its route's price, cached
prompt tokens at the route's cached-input price, rounded half-even to the
tick. Every settlement follows it (a door's call, a stream cut short, a list of
prompts, embeddings, decide, a run's row, a file batch's line, a deferred
item), and its ``Charge.detail`` is what the settlement's activity record says
of the usage and the price, so ``batchyard audit`` can price it again
(``repriced``) and list a charge that differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from batchyard.core.catalog import ModelSpec, RouteSpec
from batchyard.core.money import charge_ticks, quote_ticks
from batchyard.core.prices import Price
from batchyard.errors import ContextWindowExceeded

__all__ = [
    "Charge",
    "Used",
    "charge",
    "check_context",
    "direct_price",
    "fits",
    "quote",
    "repriced",
    "room",
]


class Used(Protocol):
    """What a call used, as an engine reports it (``engines.protocol.Usage``)."""

    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def cached_input_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Charge:
    """A call's charge in ticks, and the usage and price it was worked out from."""

    ticks: int
    price: Price
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0

    def detail(self) -> dict[str, Any]:
        """What the settlement's activity record says of it: enough to price it again."""
        p = self.price
        price = {"input_per_mtok": str(p.input_per_mtok), "output_per_mtok": str(p.output_per_mtok)}
        if p.cached_input_per_mtok is not None:
            price["cached_input_per_mtok"] = str(p.cached_input_per_mtok)
        out: dict[str, Any] = {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "price": price,
        }
        if self.cached_input_tokens:
            out["cached_input_tokens"] = self.cached_input_tokens
        return out


def charge(price: Price, route: RouteSpec | None, usage: Used) -> Charge:
    """What a call really cost: its usage at ``price``, cached prompt tokens at the route's
    cached-input price; the one rule every settlement follows.

    Quotes and holds price every prompt token uncached, so a call that used no
    more than it was quoted for is never charged above its hold.
    """
    priced = price if route is None else price.for_route(route.cached_input_per_mtok)
    cached = min(max(0, usage.cached_input_tokens), usage.input_tokens)
    cost = priced.cost(usage.input_tokens, usage.output_tokens, cached)
    return Charge(charge_ticks(cost), priced, usage.input_tokens, usage.output_tokens, cached)


def repriced(detail: Mapping[str, Any]) -> int | None:
    """The ticks a settlement record's usage comes to at its recorded price (``Charge.detail``);
    ``None`` for a record that names no price (a batch's sum, an older record)."""
    price = detail.get("price")
    if not isinstance(price, Mapping):
        return None
    cached = price.get("cached_input_per_mtok")
    at = Price(
        Decimal(price["input_per_mtok"]),
        Decimal(price["output_per_mtok"]),
        None if cached is None else Decimal(cached),
    )
    tokens = (int(detail.get(k) or 0) for k in ("input_tokens", "output_tokens"))
    used_in, used_out = tokens
    return charge_ticks(at.cost(used_in, used_out, int(detail.get("cached_input_tokens") or 0)))


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
