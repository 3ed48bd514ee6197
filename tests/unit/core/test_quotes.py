"""The one pricing rule (``core.quotes.charge``) and the audit's reading of it (``repriced``)."""

from __future__ import annotations

from decimal import Decimal

from batchyard.core.catalog import RouteSpec
from batchyard.core.money import charge_ticks, quote_ticks
from batchyard.core.prices import Price
from batchyard.core.quotes import charge, repriced
from batchyard.engines.protocol import Usage

PRICE = Price(Decimal("1000"), Decimal("2000"))
ROUTE = RouteSpec("r", "m", "openai_http", "up", base_url="http://up.invalid")
#: The same route with a cached-input price: $250 a million prompt tokens read from cache.
CACHED = RouteSpec(
    "r", "m", "openai_http", "up", base_url="http://up.invalid", cached_input_per_mtok=Decimal(250)
)


def test_a_charge_is_its_usage_at_the_route_s_price_cached_tokens_included() -> None:
    # 2 tokens in at $0.001, 2 cached at $0.00025, 3 out at $0.002.
    assert charge(PRICE, CACHED, Usage(4, 3, 2)).ticks == charge_ticks(Decimal("0.0085"))
    # A route without a cached price charges cached tokens as any other.
    assert charge(PRICE, ROUTE, Usage(4, 3, 2)).ticks == charge_ticks(Decimal("0.010"))
    # Embeddings are the same rule with no output.
    assert charge(PRICE, ROUTE, Usage(7, 0)).ticks == charge_ticks(Decimal("0.007"))
    # Never above the quote of the same tokens: the hold bounds the charge.
    assert charge(PRICE, ROUTE, Usage(4, 3)).ticks <= quote_ticks(PRICE.cost(4, 3))


def test_a_record_of_a_charge_is_priced_again_to_the_same_ticks() -> None:
    for route in (ROUTE, CACHED):
        for usage in (Usage(4, 3, 2), Usage(123, 0), Usage(1, 1)):
            made = charge(PRICE, route, usage)
            assert repriced(made.detail()) == made.ticks
    # A record that names no price (a batch's sum) is not priced again.
    assert repriced({"input_tokens": 4, "output_tokens": 3}) is None
