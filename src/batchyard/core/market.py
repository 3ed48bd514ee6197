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

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Protocol, runtime_checkable

from batchyard.core.outlook import Analogues, MarketHistory
from batchyard.core.prices import Price, discount_percent

__all__ = [
    "DeadlineAware",
    "FirstEligible",
    "Item",
    "LearningPolicy",
    "Policy",
    "RouteOffer",
    "effective_min_discount",
    "expected_cost",
    "market_key",
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


@runtime_checkable
class LearningPolicy(Policy, Protocol):
    """A policy that learns from the market: the worker shows it quiet passes
    too, and saves and restores what it learnt (``work.market_memory``)."""

    memory: timedelta

    def observe(self, offers: Sequence[RouteOffer], direct: Price, now: datetime) -> None: ...

    def saved(self, since: int | None = None) -> dict[str, list[tuple[int, float | None]]]: ...

    def restore(self, markets: dict[str, list[tuple[int, float | None]]]) -> None: ...


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
    """Waits for a deeper discount than the minimum, but never past the last safe chance.

    For an item with at least one offer qualifying at its own minimum now, it
    dispatches on the cheapest such offer when the first of these holds, and
    otherwise waits:

    1. *Safety window.* Less than the larger of ``safety_share`` of the
       item's window and ``safety`` is left: take what qualifies.
    2. *Risk.* Fewer than ``assurance`` of the market's analogues (the past
       moments that looked most like now, see ``batchyard.core.outlook``)
       went on to offer any qualifying price in the time left: take it while
       it is there.
    3. *Worth.* Taking now costs no more than ``1 + slack`` times what the
       best plan of waiting cost on the analogues' futures (a future where
       nothing qualified by the deadline counting ``analogues.penalty``
       points of the direct price). ``slack`` pays for the optimism of picking the best
       plan on the same few futures it is judged by.

    Until a market's history spans ``min_memory`` (a fresh worker with
    nothing restored), or while it holds too few analogues, it knows nothing
    that would justify betting a deadline, and takes the first qualifying
    offer as ``FirstEligible`` does.

    History only ever makes the policy dispatch sooner among offers that
    qualify now on fresh prices; it never authorises a spend. The history
    lives in this object; the market worker saves it and restores it on
    start (``saved``/``restore``). Defaults were chosen with
    ``bench/market.py``; see docs/explanation/market.md for what they achieve.
    """

    def __init__(
        self,
        *,
        assurance: float = 0.97,
        slack: float = 0.1,
        analogues: Analogues | None = None,
        safety: timedelta = timedelta(minutes=5),
        safety_share: Decimal = Decimal("0.02"),
        memory: timedelta = timedelta(days=7),
        min_memory: timedelta = timedelta(hours=12),
        name: str = "deadline-aware",
    ) -> None:
        if not 0 <= assurance <= 1:
            raise ValueError("assurance is a share from 0 to 1")
        if not Decimal(0) <= safety_share < 1:
            raise ValueError("safety_share is a share from 0 to 1")
        if slack < 0:
            raise ValueError("slack cannot be negative")
        if safety < timedelta(0) or min_memory < timedelta(0) or memory <= timedelta(0):
            raise ValueError("durations cannot be negative")
        self.assurance = assurance
        self.slack = slack
        self.analogues = analogues or Analogues()
        self.safety = safety
        self.safety_share = safety_share
        self.memory = memory
        self.min_memory = min_memory
        self.name = name
        self._markets: dict[str, MarketHistory] = {}

    def safety_window(self, item: Item) -> timedelta:
        """How close to its deadline an item takes any qualifying offer."""
        return max(self.safety, (item.deadline - item.submitted_at) * float(self.safety_share))

    def history(self, market: str) -> MarketHistory:
        """The history kept for ``market`` (``market_key`` of its offers)."""
        history = self._markets.get(market)
        if history is None:
            history = self._markets[market] = MarketHistory(self.memory, analogues=self.analogues)
        return history

    def observe(self, offers: Sequence[RouteOffer], direct: Price, now: datetime) -> None:
        """Record the market as it stands; ``choose`` calls this itself.

        A worker also calls it on passes with nothing waiting, so that the
        first item after a quiet spell does not meet a blank history.
        """
        self.history(market_key(offers)).add(now, _best_discount(offers, direct))

    def saved(self, since: int | None = None) -> dict[str, list[tuple[int, float | None]]]:
        """Every market's history from bin ``since`` on, for the worker to store."""
        return {market: history.saved(since) for market, history in self._markets.items()}

    def restore(self, markets: dict[str, list[tuple[int, float | None]]]) -> None:
        """Histories a previous worker stored: a restart does not start blind."""
        for market, bins in markets.items():
            self.history(market).restore(bins)

    def choose(
        self, item: Item, offers: Sequence[RouteOffer], direct: Price, now: datetime
    ) -> RouteOffer | None:
        _check_discount(item.min_discount)
        self.observe(offers, direct, now)
        if now >= item.deadline:
            return None
        best = _cheapest(item, offers, direct, item.min_discount)
        if best is None:
            return None
        left = item.deadline - now
        if left <= self.safety_window(item):
            return best
        history = self.history(market_key(offers))
        view = None
        if history.span() >= self.min_memory:
            waiting = left - self.safety_window(item)
            bins = int(waiting.total_seconds() // history.bin_s)
            view = history.outlook(now).waiting(bins, float(item.min_discount))
        if view is None:
            return best  # nothing learnt yet: no bet on the deadline
        chance, wait_cost = view
        if chance < self.assurance:
            return best
        cost_now = 100.0 - float(_offer_discount(best, direct))
        return best if cost_now <= wait_cost * (1 + self.slack) else None


def market_key(offers: Sequence[RouteOffer]) -> str:
    """The name a market's history is kept under: the routes it offers, sorted."""
    return ",".join(sorted(offer.route for offer in offers))


def _best_discount(offers: Sequence[RouteOffer], direct: Price) -> float | None:
    """The deepest discount any payable route offers now (None: nothing payable)."""
    best: Decimal | None = None
    for offer in offers:
        if _qualifies(offer, direct, Decimal(0)):
            discount = _offer_discount(offer, direct)
            if best is None or discount > best:
                best = discount
    return None if best is None else float(best)


def _offer_discount(offer: RouteOffer, direct: Price) -> Decimal:
    """The discount an offer guarantees: the shallowest over both rates and all fallbacks."""
    if offer.price is None:
        return Decimal("-Infinity")
    worst = min(discount_percent(direct, offer.price))
    for fb in offer.fallbacks:
        worst = min(worst, _offer_discount(fb, direct))
    return worst


def policy_by_name(name: str) -> Policy:
    """The policy a configuration names: first-eligible or deadline-aware."""
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
