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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from batchyard.core.outlook import HistoryScenarios, ScenarioSource
from batchyard.core.prices import Price, discount_percent
from batchyard.core.route_history import SLOT, slot_index
from batchyard.core.stopping import CHARGE, COLUMNS, Plans, solve

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
    too, and saves and restores what it learnt (``work.deferred_batches.price_memory``)."""

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
    """Waits for a deeper discount while the market's own past says it pays and is safe.

    For an item with an offer qualifying at its minimum now, it dispatches on
    the cheapest such offer when the first of these holds, and otherwise waits:

    1. *Safety window.* Less than the larger of ``safety_share`` of the
       item's window and ``safety`` is left: take what qualifies.
    2. *No opinion.* The scenarios (``batchyard.core.outlook``) have too little
       history behind them: act as ``FirstEligible``. A cold worker therefore
       bets no deadline until it has watched the market for a day.
    3. *Risk.* Fewer than ``1 + spare + waiting // per_pass`` qualifying
       chances lie between now and the safety window in the worst ``risk``
       share of the scenarios, where ``waiting`` counts the more urgent items
       this pass already told to wait: a burst competes for the worker's ten
       dispatches a pass, so the later items of a burst need more chances
       than one; ``spare`` more keep a scenario set that barely holds a
       chance from betting a deadline on it.
    4. *Worth.* Taking now costs at most ``1 + slack`` times what the best
       plan of waiting is expected to cost (``batchyard.core.stopping``),
       unless that would take one of the pass's last places from items later
       in the order (as the previous pass listed them) for which this price
       may be the last chance: then it waits a pass and they go first.

    The scenarios come from ``scenarios`` when given (the benchmark hands the
    online optimum the law itself this way), else from per-route histories
    the policy keeps from what the worker shows it, saves and restores. They
    only ever make it dispatch later among offers that qualify now on fresh
    prices; they never authorise a spend. Defaults were chosen on the
    training families of ``bench/market``; see docs/explanation/market.md.
    """

    def __init__(
        self,
        *,
        scenarios: ScenarioSource | None = None,
        slack: float = 0.0,
        penalty: float = 300.0,
        risk: float = 0.0,
        safety: timedelta = timedelta(minutes=5),
        safety_share: Decimal = Decimal("0.02"),
        memory: timedelta = timedelta(days=7),
        per_pass: int = 10,
        spare: int = 2,
        replan: timedelta = timedelta(minutes=4),
        regress: bool = True,
        charge: float | None = None,
        name: str = "deadline-aware",
    ) -> None:
        if not 0 <= risk < 1:
            raise ValueError("risk is a share from 0 to 1")
        if not Decimal(0) <= safety_share < 1:
            raise ValueError("safety_share is a share from 0 to 1")
        if slack <= -1 or penalty < 0:
            raise ValueError("slack must be above -1, and penalty cannot be negative")
        if safety < timedelta(0) or memory <= timedelta(0) or replan <= timedelta(0):
            raise ValueError("durations must be positive")
        if per_pass < 1 or spare < 0:
            raise ValueError("a pass dispatches at least one item; spare cannot be negative")
        self.slack = slack
        self.penalty = penalty
        self.risk = risk
        self.safety = safety
        self.safety_share = safety_share
        self.memory = memory
        self.per_pass = per_pass
        self.spare = spare
        self.regress = regress
        if charge is not None and not 0 <= charge <= 1:
            raise ValueError("charge is a share from 0 to 1")
        self.charge = charge
        self.name = name
        self._replan = max(1, int(replan / SLOT))
        self.histories = HistoryScenarios(memory=memory)
        self.source: ScenarioSource = scenarios if scenarios is not None else self.histories
        self._plans: dict[str, _MarketPlans] = {}
        self._seen: tuple[datetime, Sequence[RouteOffer]] | None = None
        self._pass_at: datetime | None = None
        self._waiting = 0
        self._qualifying: dict[
            tuple[int, Decimal], tuple[Sequence[RouteOffer], list[RouteOffer]]
        ] = {}
        self._taken = 0
        self._roster: list[_Asked] = []
        self._roster_before: list[_Asked] = []
        self._sent: set[str] = set()
        self._sent_before: set[str] = set()

    def charges(self, routes: Sequence[str], now: datetime) -> float | npt.NDArray[np.float64]:
        """What a stop in each wide column is charged (``stopping.solve``'s ``charge``).

        Measured on the routes' own past (``outlook.first_crossing``) unless
        given; ``stopping.CHARGE`` for a width the past cannot tell yet.
        """
        if self.charge is not None:
            return self.charge
        measured = self.histories.charges(routes, now)
        return np.array([measured.get(int(w), CHARGE) for w in COLUMNS.widths.tolist()])

    def safety_window(self, item: Item) -> timedelta:
        """How close to its deadline an item takes any qualifying offer."""
        return max(self.safety, (item.deadline - item.submitted_at) * float(self.safety_share))

    def observe(self, offers: Sequence[RouteOffer], direct: Price, now: datetime) -> None:
        """Record each route's guaranteed discount now; ``choose`` calls this itself.

        A worker also calls it on passes with nothing waiting, so that the
        first item after a quiet spell does not meet a blank history.
        """
        if self._seen is not None and self._seen[0] == now and self._seen[1] is offers:
            return  # every item of a pass shows the same market
        self._seen = (now, offers)
        slot = slot_index(now)
        for offer in offers:
            self.histories.history(offer.route).put(slot, _payable_discount(offer, direct))

    def saved(self, since: int | None = None) -> dict[str, list[tuple[int, float | None]]]:
        """Every route's slots from ``since`` on, for the worker to store."""
        return {route: h.saved(since) for route, h in self.histories.histories.items()}

    def restore(self, markets: dict[str, list[tuple[int, float | None]]]) -> None:
        """Routes' histories a previous worker stored: a restart does not start blind."""
        for route, slots in markets.items():
            self.histories.history(route).restore(slots)

    def choose(
        self, item: Item, offers: Sequence[RouteOffer], direct: Price, now: datetime
    ) -> RouteOffer | None:
        _check_discount(item.min_discount)
        self.observe(offers, direct, now)
        if now >= item.deadline:
            return None
        if self._pass_at is None or abs(now - self._pass_at) > _SAME_PASS:
            self._new_pass(now)
        market = self._market(offers)
        minimum = float(item.min_discount)
        market.asked(minimum, now, self)
        self._roster.append(_Asked(item.deadline, item.id, minimum, market))
        # Which routes qualify is the same for every item of a pass with this minimum.
        # (The entry holds the offers, so their id cannot be reused while it is kept.)
        key = (id(offers), item.min_discount)
        cached = self._qualifying.get(key)
        if cached is None or cached[0] is not offers:
            payable = [o for o in offers if _qualifies(o, direct, item.min_discount)]
            self._qualifying[key] = (offers, payable)
        else:
            payable = cached[1]
        best = _cheapest(item, payable, direct, Decimal(0)) if len(payable) > 1 else None
        if best is None:
            if not payable:
                return None
            best = payable[0]
        if self._decide(item, best, market, offers, direct, now):
            self._taken += 1
            self._sent.add(item.id)
            return best
        self._waiting += 1
        return None

    def _new_pass(self, now: datetime) -> None:
        self._pass_at, self._waiting, self._taken, self._qualifying = now, 0, 0, {}
        self._roster_before, self._roster = self._roster, []
        self._sent_before, self._sent = self._sent, set()

    def _decide(
        self,
        item: Item,
        best: RouteOffer,
        market: _MarketPlans,
        offers: Sequence[RouteOffer],
        direct: Price,
        now: datetime,
    ) -> bool:
        """Take ``best`` now (True) or wait; see the class docstring."""
        left = item.deadline - now
        window = self.safety_window(item)
        if left <= window:
            return True
        minimum = float(item.min_discount)
        plans = market.plans(self, now, minimum)
        got = (
            None if plans is None else plans.lookup(minimum, _checks(left), _checks(left - window))
        )
        if plans is None or got is None:
            return True  # nothing learnt yet: no bet on the deadline
        value, chances = got
        if chances < 1 + self.spare + self._waiting // self.per_pass:
            return True
        cost_now = 100.0 - float(_offer_discount(best, direct))
        # A price as good as the best plan of waiting is taken now: waiting for a tie
        # only bets the deadline (the tolerance absorbs the log scale's rounding).
        if cost_now > value * (1 + self.slack) + _TIE:
            return False
        return not self._crowds(item, market, plans, offers, direct, now)

    def _crowds(
        self,
        item: Item,
        market: _MarketPlans,
        plans: Plans,
        offers: Sequence[RouteOffer],
        direct: Price,
        now: datetime,
    ) -> bool:
        """Would taking this item leave no room this pass for scarcer items behind it?

        The worker asks in deadline order and stops at ``per_pass`` dispatches.
        An item that could safely wait should not take the last places of a
        pass from items later in the order (as the previous pass listed them)
        for which this price may be the last chance: they have no other.
        """
        deepest: float | None = None
        behind = 0
        for asked in self._roster_before:
            if (
                asked.market is not market
                or asked.deadline <= item.deadline
                or asked.deadline <= now
                or asked.id in self._sent
                or asked.id in self._sent_before
            ):
                continue
            if deepest is None:
                deepest = max(
                    (float(_offer_discount(o, direct)) for o in offers if _payable(o)),
                    default=-math.inf,
                )
            if deepest < asked.minimum:
                continue
            left = asked.deadline - now
            got = plans.lookup(asked.minimum, _checks(left), _checks(left - self.safety))
            if got is None or got[1] < 1 + self.spare:
                behind += 1
        return self._taken + 1 + behind > self.per_pass

    def _market(self, offers: Sequence[RouteOffer]) -> _MarketPlans:
        key = market_key(offers)
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = _MarketPlans(sorted(o.route for o in offers))
        return got


@dataclass(frozen=True, slots=True)
class _Asked:
    """An item the worker asked about in a pass, in the order it asked."""

    deadline: datetime
    id: str
    minimum: float
    market: _MarketPlans


class _MarketPlans:
    """One market's scenarios and plans, rebuilt every ``replan`` slots."""

    def __init__(self, routes: list[str]) -> None:
        self.routes = routes
        self.bucket: int | None = None
        self.scenarios: tuple[npt.NDArray[np.float64], int] | None = None
        self.solved: list[Plans] = []
        self.charge: float | npt.NDArray[np.float64] = CHARGE
        #: Minima asked about, with the bucket they were last asked in.
        self.minima: dict[float, int] = {}

    def asked(self, minimum: float, now: datetime, policy: DeadlineAware) -> None:
        """Note a minimum asked about, so the next plans are solved for it too."""
        self.minima[minimum] = slot_index(now) // policy._replan

    def plans(self, policy: DeadlineAware, now: datetime, minimum: float) -> Plans | None:
        bucket = slot_index(now) // policy._replan
        self.minima[minimum] = bucket
        if bucket != self.bucket:
            self.bucket = bucket
            self.scenarios = policy.source.scenarios(self.routes, now)
            self.charge = policy.charges(self.routes, now)
            self.solved = []
            # Solve for every minimum asked about lately at once: items come back each pass.
            for m, last in list(self.minima.items()):
                if bucket - last > 30:
                    del self.minima[m]
            if self.scenarios is not None:
                self.solved.append(self._solve(policy, sorted(self.minima)))
        if self.scenarios is None:
            return None
        for plans in self.solved:
            if minimum in plans.minima:
                return plans
        plans = self._solve(policy, [minimum])
        self.solved.append(plans)
        return plans

    def _solve(self, policy: DeadlineAware, minima: list[float]) -> Plans:
        assert self.scenarios is not None
        discounts, cover = self.scenarios
        return solve(
            discounts,
            minima,
            cover,
            penalty=policy.penalty,
            risk=policy.risk,
            regress=policy.regress,
            charge=self.charge,
        )


#: Points of the direct price within which waiting is no better than taking now.
_TIE = 1e-6

#: Items asked about this close together belong to one pass (a caller whose clock
#: ticks between items still has its burst counted as one).
_SAME_PASS = timedelta(seconds=1)


def _checks(span: timedelta) -> int:
    """Checks still to come within ``span`` (the next one is a slot away)."""
    return max(0, int(span / SLOT))


def _payable_discount(offer: RouteOffer, direct: Price) -> float | None:
    """The discount a route guarantees now, or None if it cannot be paid at any price."""
    if not _payable(offer):
        return None
    return float(_offer_discount(offer, direct))


def _payable(offer: RouteOffer) -> bool:
    return (
        offer.price is not None
        and offer.hard_price_caps
        and all(_payable(fb) for fb in offer.fallbacks)
    )


def market_key(offers: Sequence[RouteOffer]) -> str:
    """The name a market's history is kept under: the routes it offers, sorted."""
    return ",".join(sorted(offer.route for offer in offers))


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
