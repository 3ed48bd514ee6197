"""Which route a deferred item may spend on, and when it should.

Two questions, kept apart on purpose:

* ``qualifies`` is the *rule*: may this route be paid at all? Both token
  rates must meet the item's minimum discount against fresh direct prices,
  the route must declare hard input/output price caps, and so must every
  fallback the provider could switch to, recursively, each with a fresh price
  that also meets the minimum. Nothing else authorises a spend.
* a ``Policy`` is the *strategy*: among routes that qualify now, dispatch now
  or keep waiting for a deeper discount? A policy can only ever narrow what
  ``qualifies`` allows, never widen it, so a clever policy cannot spend where
  the rule says no.

Routes are ranked by what the request can cost (input tokens x input price +
max output tokens x output price), not by the sum of the two per-token prices
as LiteLLM's cost routing does: a long prompt with a short answer and a short
prompt with a long answer pick different cheapest routes. A route's cost is
the dearest of it and its fallbacks, because any of them may end up serving.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Protocol

from batchyard.core.prices import Price, discount_percent

__all__ = [
    "DeadlineAware",
    "FirstEligible",
    "Item",
    "Policy",
    "RouteOffer",
    "effective_min_discount",
    "expected_cost",
    "offer_cost",
    "policy_by_name",
    "qualifies",
    "rate_meets",
]

_MTOK = Decimal(1_000_000)
_HUNDRED = Decimal(100)


@dataclass(frozen=True, slots=True)
class RouteOffer:
    """A route as the market sees it at one check.

    ``price`` is the route's *fresh* price (``PriceBook.fresh``), or None when
    it has none; the caller must not fill it from an older observation.
    """

    route: str
    price: Price | None
    hard_price_caps: bool
    fallbacks: tuple[RouteOffer, ...] = ()


@dataclass(frozen=True, slots=True)
class Item:
    """One waiting request, with the discount it needs and when it gives up.

    ``min_discount`` is a percentage (``Decimal("90")`` for 90 %), already
    the stricter of the batch's and the request's (``effective_min_discount``).
    """

    id: str
    min_discount: Decimal
    deadline: datetime
    submitted_at: datetime
    input_tokens: int
    max_output_tokens: int


def effective_min_discount(batch_min: Decimal, request_min: Decimal | None) -> Decimal:
    """A request may raise the batch's minimum discount, never lower it."""
    _check_discount(batch_min)
    if request_min is None:
        return batch_min
    _check_discount(request_min)
    return max(batch_min, request_min)


def _check_discount(min_discount: Decimal) -> None:
    if not min_discount.is_finite() or not Decimal(0) <= min_discount <= _HUNDRED:
        raise ValueError("a minimum discount is a percentage from 0 to 100")


def rate_meets(direct: Decimal, offered: Decimal, min_discount: Decimal) -> bool:
    """``offered`` is at least ``min_discount`` % below ``direct``.

    Compared by multiplication, not by the rounded quotient of
    ``discount_percent``, so a rate exactly at the limit qualifies exactly.
    """
    if direct == 0:
        # No direct price to be below: only a free offer with no required discount.
        return offered == 0 and min_discount == 0
    return offered * _HUNDRED <= direct * (_HUNDRED - min_discount)


def qualifies(offer: RouteOffer, direct: Price, min_discount: Decimal) -> bool:
    """May ``offer`` be paid for an item needing ``min_discount`` % off ``direct``?

    ``direct`` must itself be a fresh price; a stale direct price gives no
    limit to measure against, and the caller then has nothing to dispatch.
    """
    _check_discount(min_discount)
    return _qualifies(offer, direct, min_discount)


def _qualifies(offer: RouteOffer, direct: Price, min_discount: Decimal) -> bool:
    price = offer.price
    if price is None or not offer.hard_price_caps:
        return False
    if not rate_meets(direct.input_per_mtok, price.input_per_mtok, min_discount):
        return False
    if not rate_meets(direct.output_per_mtok, price.output_per_mtok, min_discount):
        return False
    return all(_qualifies(fb, direct, min_discount) for fb in offer.fallbacks)


def expected_cost(price: Price, input_tokens: int, max_output_tokens: int) -> Decimal:
    """Dollars for the whole request: the quantity routes are ranked by."""
    return (input_tokens * price.input_per_mtok + max_output_tokens * price.output_per_mtok) / _MTOK


def offer_cost(offer: RouteOffer, input_tokens: int, max_output_tokens: int) -> Decimal:
    """The most the request can cost on ``offer``: the dearest of it and its fallbacks."""
    if offer.price is None:
        raise ValueError(f"route {offer.route!r} has no fresh price")
    cost = expected_cost(offer.price, input_tokens, max_output_tokens)
    for fb in offer.fallbacks:
        cost = max(cost, offer_cost(fb, input_tokens, max_output_tokens))
    return cost


def _cheapest(
    item: Item, offers: Sequence[RouteOffer], direct: Price, min_discount: Decimal
) -> RouteOffer | None:
    best: RouteOffer | None = None
    best_key: tuple[Decimal, str] | None = None
    for offer in offers:
        if not _qualifies(offer, direct, min_discount):
            continue
        # The route name breaks ties so the same market always picks the same route.
        key = (offer_cost(offer, item.input_tokens, item.max_output_tokens), offer.route)
        if best_key is None or key < best_key:
            best, best_key = offer, key
    return best


class Policy(Protocol):
    """Dispatch now on a route, or wait (None). Must only return qualifying offers."""

    name: str

    def choose(
        self, item: Item, offers: Sequence[RouteOffer], direct: Price, now: datetime
    ) -> RouteOffer | None: ...


class FirstEligible:
    """The documented default: the cheapest qualifying route at the first check with one.

    It cannot know the future, so it pays whatever first meets the minimum;
    on a market that swings it pays several times the best price the window
    offered (see docs/explanation/market.md).
    """

    def __init__(self, name: str = "first-eligible") -> None:
        self.name = name

    def choose(
        self, item: Item, offers: Sequence[RouteOffer], direct: Price, now: datetime
    ) -> RouteOffer | None:
        _check_discount(item.min_discount)
        if now >= item.deadline:
            return None
        return _cheapest(item, offers, direct, item.min_discount)


class DeadlineAware:
    """Waits for a deeper discount than the minimum while the deadline allows.

    Three rules decide, for an item with at least one offer qualifying at its
    own minimum; the first that fires dispatches on the cheapest such offer:

    1. *Schedule.* Dispatch when an offer meets the required discount
       ``min + depth x (100 - min) x g^curve``, where ``g`` is the share of the
       window left, rescaled to reach 0 where the final stretch begins. So the
       bar starts high and relaxes to the item's minimum; in the final stretch
       (the larger of ``final_share`` of the window and ``final_min``) any
       qualifying offer is taken.
    2. *Trailing stop.* Once the item has seen a qualifying offer, dispatch
       when the cheapest qualifying cost rises more than ``stop`` (a share)
       above the lowest it has seen, once no more than ``stop_share`` of the
       window is left: the price has turned, and what is left of the window
       may hold nothing better, or nothing at all.
    3. *Edge.* Dispatch when that cost has risen from the item's low and the
       offer's discount is within ``edge`` percentage points of the minimum:
       the next move may take the last qualifying price of the window away.
    4. *Rare discount.* Dispatch when the offer's discount is among the deepest
       ``rare`` share of what its route showed over the last ``memory`` (once
       at least ``min_memory`` of it is known): a short deep dip is taken
       while it lasts instead of waiting for the schedule to reach it.

    Observed history only ever makes the policy dispatch *sooner* among
    offers that qualify now on fresh prices; it never authorises a spend.
    The state (per-item lowest cost, per-route history) lives in this object:
    a restarted worker forgets it and falls back to the schedule alone, which
    is still safe. Defaults were tuned with ``bench/market.py``; see
    docs/explanation/market.md.
    """

    def __init__(
        self,
        *,
        depth: Decimal = Decimal("0.5"),
        curve: Decimal = Decimal("2"),
        final_share: Decimal = Decimal("0.1"),
        final_min: timedelta = timedelta(minutes=5),
        stop: Decimal = Decimal("0.15"),
        stop_share: Decimal = Decimal("0.3"),
        edge: Decimal = Decimal("1"),
        rare: Decimal = Decimal("0.05"),
        memory: timedelta = timedelta(hours=24),
        min_memory: timedelta = timedelta(hours=2),
        name: str = "deadline-aware",
    ) -> None:
        if not Decimal(0) <= depth <= 1:
            raise ValueError("depth is a share from 0 to 1")
        if curve <= 0:
            raise ValueError("curve must be positive")
        if not Decimal(0) <= final_share < 1:
            raise ValueError("final_share is a share from 0 to below 1")
        if final_min < timedelta(0) or min_memory < timedelta(0) or memory <= timedelta(0):
            raise ValueError("durations cannot be negative")
        if stop < 0 or not Decimal(0) <= rare <= 1:
            raise ValueError("stop must be >= 0 and rare a share from 0 to 1")
        self.depth = depth
        self.curve = curve
        self.final_share = final_share
        self.final_min = final_min
        self.stop = stop
        self.stop_share = stop_share
        self.edge = edge
        self.rare = rare
        self.memory = memory
        self.min_memory = min_memory
        self.name = name
        self._lowest: dict[str, tuple[Decimal, datetime]] = {}  # item id -> (cost, deadline)
        self._history: dict[str, _History] = {}
        self._pruned_at: datetime | None = None

    def required_discount(self, item: Item, now: datetime) -> Decimal:
        """The discount the schedule holds out for at ``now`` (never below the minimum)."""
        minimum = item.min_discount
        window = (item.deadline - item.submitted_at).total_seconds()
        left = (item.deadline - now).total_seconds()
        if window <= 0 or left <= 0 or item.deadline - now <= self.final_min:
            return minimum
        share_left = min(Decimal(1), Decimal(left) / Decimal(window))
        if share_left <= self.final_share:
            return minimum
        scaled = (share_left - self.final_share) / (1 - self.final_share)
        return minimum + self.depth * (_HUNDRED - minimum) * scaled**self.curve

    def choose(
        self, item: Item, offers: Sequence[RouteOffer], direct: Price, now: datetime
    ) -> RouteOffer | None:
        _check_discount(item.min_discount)
        self._observe(offers, direct, now)
        if now >= item.deadline:
            self._lowest.pop(item.id, None)
            return None
        best = _cheapest(item, offers, direct, item.min_discount)
        if best is None:
            return None
        required = max(item.min_discount, self.required_discount(item, now))
        scheduled = _cheapest(item, offers, direct, required)
        if scheduled is not None:
            return self._dispatch(item, scheduled)
        cost = offer_cost(best, item.input_tokens, item.max_output_tokens)
        lowest = self._lowest.get(item.id)
        if (
            lowest is not None
            and cost > lowest[0] * (1 + self.stop)
            and _share_left(item, now) <= self.stop_share
        ):
            return self._dispatch(item, best)
        if (
            lowest is not None
            and cost > lowest[0]
            and _offer_discount(best, direct) - item.min_discount <= self.edge
        ):
            # Rising and within ``edge`` points of the limit: the next move may
            # take the last qualifying price of the window away.
            return self._dispatch(item, best)
        if self._is_rare(best, direct, now):
            return self._dispatch(item, best)
        if lowest is None or cost < lowest[0]:
            self._lowest[item.id] = (cost, item.deadline)
        return None

    def _dispatch(self, item: Item, offer: RouteOffer) -> RouteOffer:
        self._lowest.pop(item.id, None)
        return offer

    def _is_rare(self, offer: RouteOffer, direct: Price, now: datetime) -> bool:
        history = self._history.get(offer.route)
        if history is None or not history.spans(self.min_memory, now):
            return False
        return _offer_discount(offer, direct) >= history.quantile(1 - self.rare)

    def _observe(self, offers: Sequence[RouteOffer], direct: Price, now: datetime) -> None:
        for offer in offers:
            if offer.price is None:
                continue
            history = self._history.get(offer.route)
            if history is None:
                history = self._history[offer.route] = _History(self.memory)
            history.add(now, _offer_discount(offer, direct))
        # Items that were dispatched elsewhere or cancelled never come back to
        # say so; forget them once their deadline has passed.
        if self._pruned_at is None or now - self._pruned_at > timedelta(minutes=5):
            self._pruned_at = now
            self._lowest = {k: v for k, v in self._lowest.items() if v[1] > now}


def _share_left(item: Item, now: datetime) -> Decimal:
    window = (item.deadline - item.submitted_at).total_seconds()
    if window <= 0:
        return Decimal(0)
    left = (item.deadline - now).total_seconds()
    return max(Decimal(0), min(Decimal(1), Decimal(left) / Decimal(window)))


def _offer_discount(offer: RouteOffer, direct: Price) -> Decimal:
    """The discount an offer guarantees: the shallowest over both rates and all fallbacks."""
    if offer.price is None:
        return Decimal("-Infinity")
    worst = min(discount_percent(direct, offer.price))
    for fb in offer.fallbacks:
        worst = min(worst, _offer_discount(fb, direct))
    return worst


class _History:
    """A route's observed discounts over a trailing window, kept sorted for quantiles."""

    #: Several items ask in one worker pass; one sample per pass is enough.
    SPACING = timedelta(seconds=10)

    def __init__(self, span: timedelta) -> None:
        self._span = span
        self._samples: deque[tuple[datetime, Decimal]] = deque()
        self._sorted: list[Decimal] = []

    def add(self, now: datetime, discount: Decimal) -> None:
        if self._samples and now - self._samples[-1][0] < self.SPACING:
            return
        self._samples.append((now, discount))
        insort(self._sorted, discount)
        while self._samples and self._samples[0][0] < now - self._span:
            _, old = self._samples.popleft()
            del self._sorted[bisect_left(self._sorted, old)]

    def spans(self, needed: timedelta, now: datetime) -> bool:
        return bool(self._samples) and now - self._samples[0][0] >= needed

    def quantile(self, q: Decimal) -> Decimal:
        index = int(q * (len(self._sorted) - 1))
        return self._sorted[index]


def policy_by_name(name: str) -> Policy:
    """The policy a configuration names: ``first-eligible`` or ``deadline-aware``."""
    # A fresh object each call: DeadlineAware keeps state that must not be shared.
    factories: dict[str, type[FirstEligible] | type[DeadlineAware]] = {
        "first-eligible": FirstEligible,
        "deadline-aware": DeadlineAware,
    }
    factory = factories.get(name.strip().lower().replace("_", "-"))
    if factory is None:
        known = ", ".join(sorted(factories))
        raise ValueError(f"unknown market policy {name!r} (known: {known})")
    return factory()
