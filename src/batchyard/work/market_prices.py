"""The market as the worker sees it: catalog routes priced from the book or the catalog.

A route's price comes from one of two places. ``fixed`` routes charge what
the catalog says (their own rates, or the model's where they name none), set
by the operator and unable to move, so they are always fresh. ``feed`` routes
charge what the operator's price feed last said, and only while that is
younger than ``price_max_age_s``: a stale observation is no price at all.
The catalog's model prices are the direct prices discounts are measured
against.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from batchyard.core.catalog import Catalog, RouteSpec
from batchyard.core.market import RouteOffer
from batchyard.core.prices import Price, PriceBook
from batchyard.core.quotes import direct_price

__all__ = ["MarketPrices"]


class MarketPrices:
    def __init__(self, catalog: Catalog, book: PriceBook, max_age: timedelta) -> None:
        self.catalog = catalog
        self.book = book
        self.max_age = max_age

    def direct(self, model_id: str) -> Price:
        return direct_price(self.catalog.model(model_id))

    def route_price(self, route: RouteSpec, now: datetime) -> Price | None:
        """The route's fresh price, or None when it has none that may authorise a spend."""
        if route.price_source == "feed":
            return self.book.fresh(route.id, now, self.max_age)
        model = self.catalog.models[route.model]
        return Price(
            route.input_per_mtok if route.input_per_mtok is not None else model.input_per_mtok,
            route.output_per_mtok if route.output_per_mtok is not None else model.output_per_mtok,
        )

    def offer(self, route_id: str, now: datetime) -> RouteOffer:
        return self._offer(route_id, now, ())

    def _offer(self, route_id: str, now: datetime, path: tuple[str, ...]) -> RouteOffer:
        route = self.catalog.routes[route_id]
        chain = (*path, route_id)
        # A fallback already on the chain is being checked further up; a cycle
        # adds no route the rule has not seen.
        fallbacks = tuple(self._offer(fb, now, chain) for fb in route.fallbacks if fb not in chain)
        return RouteOffer(
            route=route.id,
            price=self.route_price(route, now),
            hard_price_caps=route.hard_price_caps,
            fallbacks=fallbacks,
        )

    def offers(self, model_id: str, now: datetime) -> list[RouteOffer]:
        """Every route serving ``model_id``, with its fallbacks, priced at ``now``."""
        return [self._offer(r.id, now, ()) for r in self.catalog.routes_for(model_id)]
