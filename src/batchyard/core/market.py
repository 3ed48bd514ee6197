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
from typing import Protocol

from batchyard.core.outlook import MarketHistory, Outlook
from batchyard.core.prices import Price, discount_percent

__all__ = [
    "DeadlineAware",
    "FirstEligible",
    "Item",
    "OptimalStopping",
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
    """Waits for a deeper discount than the minimum, but never past the last safe chance.

    For an item with at least one offer qualifying at its own minimum now, it
    dispatches on the cheapest such offer when the first of these holds, and
    otherwise waits:

    1. *Safety window.* Less than the larger of ``safety_share`` of the
       item's window and ``safety`` is left: take what qualifies.
    2. *Reserve.* The offer's discount reaches the ``reserve`` quantile of the
       best discount that past windows as long as the time left held (see
       ``batchyard.core.outlook``). As the deadline nears, the windows
       compared get shorter and their best gets shallower, so the bar relaxes
       towards the minimum on its own.
    3. *Last chance.* The share of past windows as long as the time left that
       held any qualifying price is below ``assurance``, and the offer's
       discount is within one pass's largest observed drop (times
       ``move_factor``) of the minimum, and the market's last move was not a
       deepening: the next pass may take the chance away for good.

    Until a market's history spans ``min_memory`` (a fresh worker), a
    schedule stands in for 2 and 3: hold out for
    ``min + depth x (100 - min) x g^curve`` (``g`` the share of the window
    left), and take any qualifying offer that has come down from the item's
    best once it is within ``cold_edge`` points of the minimum.

    History only ever makes the policy dispatch sooner among offers that
    qualify now on fresh prices; it never authorises a spend. The state lives
    in this object: a restarted worker forgets it and starts cold, which is
    still safe. Defaults were chosen with ``bench/market.py``; see
    docs/explanation/market.md for what they achieve and where they fall short.
    """

    def __init__(
        self,
        *,
        reserve: float = 0.5,
        assurance: float = 0.98,
        move_factor: float = 1.5,
        safety: timedelta = timedelta(minutes=5),
        safety_share: Decimal = Decimal("0.02"),
        memory: timedelta = timedelta(hours=48),
        min_memory: timedelta = timedelta(hours=12),
        depth: Decimal = Decimal("0.5"),
        curve: Decimal = Decimal("2"),
        cold_edge: Decimal = Decimal("5"),
        name: str = "deadline-aware",
    ) -> None:
        if not 0 <= reserve <= 1 or not 0 <= assurance <= 1:
            raise ValueError("reserve and assurance are shares from 0 to 1")
        if not Decimal(0) <= depth <= 1 or not Decimal(0) <= safety_share < 1:
            raise ValueError("depth and safety_share are shares from 0 to 1")
        if curve <= 0 or move_factor < 0 or cold_edge < 0:
            raise ValueError("curve must be positive, move_factor and cold_edge not negative")
        if safety < timedelta(0) or min_memory < timedelta(0) or memory <= timedelta(0):
            raise ValueError("durations cannot be negative")
        self.reserve = reserve
        self.assurance = assurance
        self.move_factor = move_factor
        self.safety = safety
        self.safety_share = safety_share
        self.memory = memory
        self.min_memory = min_memory
        self.depth = depth
        self.curve = curve
        self.cold_edge = cold_edge
        self.name = name
        self._markets: dict[tuple[str, ...], MarketHistory] = {}

    def safety_window(self, item: Item) -> timedelta:
        """How close to its deadline an item takes any qualifying offer."""
        return max(self.safety, (item.deadline - item.submitted_at) * float(self.safety_share))

    def required_discount(self, item: Item, now: datetime) -> Decimal:
        """The cold-start schedule's bar at ``now`` (never below the minimum)."""
        minimum = item.min_discount
        if item.deadline - now <= self.safety_window(item):
            return minimum
        return minimum + self.depth * (_HUNDRED - minimum) * _share_left(item, now) ** self.curve

    def observe(self, offers: Sequence[RouteOffer], direct: Price, now: datetime) -> None:
        """Record the market as it stands; ``choose`` calls this itself.

        A worker may also call it on passes with nothing waiting, so that the
        first item after a quiet spell does not meet a blank history.
        """
        key = tuple(sorted(offer.route for offer in offers))
        history = self._markets.get(key)
        if history is None:
            history = self._markets[key] = MarketHistory(self.memory)
        history.add(now, _best_discount(offers, direct))

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
        discount = _offer_discount(best, direct)
        history = self._markets[tuple(sorted(offer.route for offer in offers))]
        improved = history.rising
        if history.span() < self.min_memory:
            return self._cold(item, offers, direct, now, best, discount, improved)
        outlook = history.outlook(now)
        waiting = left - self.safety_window(item)
        deep = _cheapest(
            item, offers, direct, max(item.min_discount, self.bar(outlook, item, waiting))
        )
        if deep is not None:
            return deep
        minimum = float(item.min_discount)
        if (
            outlook.chance(waiting, minimum) < self.assurance
            and float(discount) - minimum <= outlook.move * self.move_factor
        ):
            return best
        return None

    def bar(self, outlook: Outlook, item: Item, waiting: timedelta) -> Decimal:
        """The discount worth taking now: what past windows this long held."""
        return _bar(outlook.reserve(waiting, self.reserve))

    def _cold(
        self,
        item: Item,
        offers: Sequence[RouteOffer],
        direct: Price,
        now: datetime,
        best: RouteOffer,
        discount: Decimal,
        improved: bool,
    ) -> RouteOffer | None:
        scheduled = _cheapest(item, offers, direct, self.required_discount(item, now))
        if scheduled is not None:
            return scheduled
        if not improved and discount - item.min_discount <= self.cold_edge:
            return best
        return None


class OptimalStopping(DeadlineAware):
    """Backward induction over the looks left, from the market's own distribution.

    With ``n`` independent looks left (the time left over the trace's
    decorrelation time, see ``Outlook.stopping``), the offer worth taking
    now is the one at least as deep as what waiting is worth in expectation,
    a miss being worth ``miss`` (a discount: -100 is paying twice the direct
    price, the request run elsewhere at full price plus its lateness). The
    iid model cannot see that a market may dry up, so the safety window and
    last-chance rules of ``DeadlineAware`` still apply, and so does its cold
    start. It narrows ``qualifies`` like every policy.
    """

    def __init__(
        self, *, miss: float = -100.0, name: str = "optimal-stopping", **kw: object
    ) -> None:
        super().__init__(name=name, **kw)  # type: ignore[arg-type]
        self.miss = miss

    def bar(self, outlook: Outlook, item: Item, waiting: timedelta) -> Decimal:
        """What waiting is worth with the looks left: deeper than this, take it."""
        minimum = float(item.min_discount)
        return _bar(outlook.stopping(minimum, self.miss, outlook.draws(waiting)))


def _bar(discount: float) -> Decimal:
    return Decimal(str(max(0.0, min(100.0, discount))))


def _best_discount(offers: Sequence[RouteOffer], direct: Price) -> float | None:
    """The deepest discount any payable route offers now (None: nothing payable)."""
    best: Decimal | None = None
    for offer in offers:
        if _qualifies(offer, direct, Decimal(0)):
            discount = _offer_discount(offer, direct)
            if best is None or discount > best:
                best = discount
    return None if best is None else float(best)


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


def policy_by_name(name: str) -> Policy:
    """The policy a configuration names: first-eligible, deadline-aware, optimal-stopping."""
    # A fresh object each call: DeadlineAware keeps state that must not be shared.
    factories: dict[str, type[FirstEligible] | type[DeadlineAware]] = {
        "first-eligible": FirstEligible,
        "deadline-aware": DeadlineAware,
        "optimal-stopping": OptimalStopping,
    }
    factory = factories.get(name.strip().lower().replace("_", "-"))
    if factory is None:
        known = ", ".join(sorted(factories))
        raise ValueError(f"unknown market policy {name!r} (known: {known})")
    return factory()
