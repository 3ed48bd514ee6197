"""Qualification rules and the two dispatch policies, with datetimes moved by hand."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import numpy as np
import pytest

from batchyard.core.clock import ManualClock
from batchyard.core.market import (
    DeadlineAware,
    FirstEligible,
    Item,
    LearningPolicy,
    RouteOffer,
    effective_min_discount,
    expected_cost,
    offer_cost,
    policy_by_name,
    qualifies,
)
from batchyard.core.prices import Price, PriceBook, PricePoint
from batchyard.core.stopping import COLUMNS

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
DIRECT = Price(Decimal("1.00"), Decimal("4.00"))
MAX_AGE = timedelta(minutes=5)


def price(level: str, out_level: str | None = None) -> Price:
    """A price at ``level`` x direct for input (and ``out_level`` for output)."""
    return Price(Decimal(level), Decimal(out_level or level) * 4)


def offer(route: str, level: str | None, caps: bool = True, *fallbacks: RouteOffer) -> RouteOffer:
    return RouteOffer(route, None if level is None else price(level), caps, tuple(fallbacks))


def item(min_discount: int = 50, hours: int = 24, **kw: object) -> Item:
    return Item(
        id=str(kw.get("id", "i1")),
        min_discount=Decimal(min_discount),
        deadline=T0 + timedelta(hours=hours),
        submitted_at=T0,
        input_tokens=int(kw.get("input_tokens", 1000)),  # type: ignore[call-overload]
        max_output_tokens=int(kw.get("max_output_tokens", 1000)),  # type: ignore[call-overload]
    )


# --- the rule ---------------------------------------------------------------------------


def test_exactly_at_the_limit_qualifies_and_one_step_over_does_not() -> None:
    assert qualifies(offer("a", "0.5"), DIRECT, Decimal(50))
    assert not qualifies(offer("a", "0.5001"), DIRECT, Decimal(50))


def test_both_rates_must_meet() -> None:
    cheap_input = RouteOffer("a", price("0.1", "0.6"), True)
    cheap_output = RouteOffer("b", price("0.6", "0.1"), True)
    assert not qualifies(cheap_input, DIRECT, Decimal(50))
    assert not qualifies(cheap_output, DIRECT, Decimal(50))


def test_stale_price_never_qualifies() -> None:
    book = PriceBook([PricePoint("a", price("0.01"), T0)])
    later = T0 + MAX_AGE + timedelta(seconds=1)
    stale = RouteOffer("a", book.fresh("a", later, MAX_AGE), True)
    assert stale.price is None
    assert not qualifies(stale, DIRECT, Decimal(0))
    assert FirstEligible().choose(item(), [stale], DIRECT, later) is None


def test_route_without_hard_caps_never_qualifies() -> None:
    assert not qualifies(offer("a", "0.01", False), DIRECT, Decimal(10))


def test_every_fallback_must_qualify_recursively() -> None:
    good = offer("fb", "0.2")
    assert qualifies(offer("a", "0.1", True, good), DIRECT, Decimal(50))
    uncapped = offer("fb", "0.2", False)
    assert not qualifies(offer("a", "0.1", True, uncapped), DIRECT, Decimal(50))
    dear = offer("fb", "0.9")
    assert not qualifies(offer("a", "0.1", True, dear), DIRECT, Decimal(50))
    stale = offer("fb", None)
    assert not qualifies(offer("a", "0.1", True, stale), DIRECT, Decimal(50))
    deep = offer("a", "0.1", True, offer("fb", "0.2", True, offer("fb2", "0.3", False)))
    assert not qualifies(deep, DIRECT, Decimal(50))


def test_per_request_min_discount_raises_never_weakens() -> None:
    assert effective_min_discount(Decimal(50), Decimal(80)) == 80
    assert effective_min_discount(Decimal(50), Decimal(20)) == 50
    assert effective_min_discount(Decimal(50), None) == 50
    raised = item(min_discount=int(effective_min_discount(Decimal(50), Decimal(80))))
    at_60 = offer("a", "0.4")
    assert qualifies(at_60, DIRECT, Decimal(50))
    assert FirstEligible().choose(raised, [at_60], DIRECT, T0) is None
    with pytest.raises(ValueError):
        effective_min_discount(Decimal(-1), None)
    with pytest.raises(ValueError):
        qualifies(at_60, DIRECT, Decimal(101))


def test_zero_direct_rate_gives_no_discount() -> None:
    free_direct = Price(Decimal(0), Decimal(4))
    assert not qualifies(
        RouteOffer("a", Price(Decimal(0), Decimal(1)), True), free_direct, Decimal(10)
    )


def test_ranking_is_by_request_cost_not_by_summed_token_prices() -> None:
    # Summed token prices rank b first (1.60 < 2.10) whatever the request;
    # the request's own cost ranks a first for a long prompt, b for a long answer.
    a = RouteOffer("a", Price(Decimal("0.10"), Decimal("2.00")), True)
    b = RouteOffer("b", Price(Decimal("0.40"), Decimal("1.20")), True)
    direct = Price(Decimal("1.00"), Decimal("4.00"))
    long_prompt = item(min_discount=50, input_tokens=100_000, max_output_tokens=100)
    long_answer = item(min_discount=50, input_tokens=100, max_output_tokens=4000)
    assert expected_cost(a.price, 100_000, 100) < expected_cost(b.price, 100_000, 100)  # type: ignore[arg-type]
    assert FirstEligible().choose(long_prompt, [b, a], direct, T0) is a
    assert FirstEligible().choose(long_answer, [a, b], direct, T0) is b


def test_offer_cost_is_the_dearest_of_route_and_fallbacks() -> None:
    chain = offer("a", "0.1", True, offer("fb", "0.3"))
    assert offer_cost(chain, 1_000_000, 0) == Decimal("0.3")
    cheap_alone = offer("b", "0.2")
    assert FirstEligible().choose(item(), [chain, cheap_alone], DIRECT, T0) is cheap_alone


# --- the policies -----------------------------------------------------------------------


def test_first_eligible_takes_the_first_check_with_a_qualifying_route() -> None:
    policy = FirstEligible()
    clock = ManualClock(T0)
    it = item(min_discount=50)
    assert policy.choose(it, [offer("a", "0.7")], DIRECT, clock.now()) is None
    clock.advance(15)
    chosen = policy.choose(it, [offer("a", "0.45"), offer("b", "0.40")], DIRECT, clock.now())
    assert chosen is not None and chosen.route == "b"
    assert policy.choose(it, [offer("b", "0.1")], DIRECT, it.deadline) is None


def test_deadline_aware_cold_bets_no_deadline() -> None:
    # No history yet: nothing says waiting would pay, so it does not wait.
    policy = DeadlineAware()
    it = item(min_discount=50, hours=24)
    at_60 = [offer("a", "0.40")]
    assert policy.choose(it, [offer("a", "0.55")], DIRECT, T0) is None
    assert policy.choose(it, at_60, DIRECT, T0 + timedelta(seconds=15)) == at_60[0]


def test_deadline_aware_never_dispatches_what_does_not_qualify() -> None:
    policy = DeadlineAware()
    it = item(min_discount=50, hours=1)
    clock = ManualClock(T0)
    uncapped = offer("a", "0.01", False)
    shallow = offer("b", "0.6")
    while clock.now() < it.deadline:
        assert policy.choose(it, [uncapped, shallow], DIRECT, clock.now()) is None
        clock.advance(15)


def _watch(
    policy: DeadlineAware, clock: ManualClock, level: Callable[[int], str], hours: int
) -> None:
    """Let the policy watch route ``a`` for ``hours``, one pass every 15 s."""
    for k in range(hours * 240):
        policy.observe([offer("a", level(k))], DIRECT, clock.now())
        clock.advance(15)


def _two_hours_each(k: int) -> str:
    return "0.40" if (k // 480) % 2 == 0 else "0.60"


def test_deadline_aware_warm_holds_out_for_what_the_market_usually_gives() -> None:
    # Two hours at 0.40, then two at 0.60 (qualifying at 30 % off), for two days.
    policy = DeadlineAware()
    clock = ManualClock(T0)
    _watch(policy, clock, _two_hours_each, 48)
    it = Item("w", Decimal(30), clock.now() + timedelta(hours=6), clock.now(), 1000, 1000)
    # The price qualifies, but a 6 h window has always held 60 % off: wait.
    assert policy.choose(it, [offer("a", "0.60")], DIRECT, clock.now()) is None
    clock.advance(15)
    assert policy.choose(it, [offer("a", "0.40")], DIRECT, clock.now()) is not None


def test_deadline_aware_warm_takes_a_chance_the_market_rarely_gives() -> None:
    # 30 % off shows up for one hour a day: a 1 h item must not let it go.
    policy = DeadlineAware()
    clock = ManualClock(T0)
    _watch(policy, clock, lambda k: "0.69" if k % 5760 < 240 else "0.80", 48)
    it = Item("l", Decimal(30), clock.now() + timedelta(hours=1), clock.now(), 1000, 1000)
    edge = offer("a", "0.695")
    assert policy.choose(it, [edge], DIRECT, clock.now()) == edge


def _dips(k: int) -> str:
    """0.60, with a ten-minute dip to 0.10 every three hours: plateaus, not fresh draws."""
    return "0.10" if k % 720 < 40 else "0.60"


def test_deadline_aware_charges_a_wide_column_as_the_routes_past_says() -> None:
    # A stop in a wide column lands where the first check past the threshold lies:
    # on plateaus that is the column's deepest price, not half way to the threshold.
    decided = {}
    for charge in (None, 0.5):
        policy = DeadlineAware(charge=charge)
        clock = ManualClock(T0)
        _watch(policy, clock, _dips, 72)
        clock.advance(15 * 200)  # between two dips
        if charge is None:
            measured = np.asarray(policy.charges(["a"], clock.now()))
            assert (measured[(COLUMNS.widths == 4) | (COLUMNS.widths == 16)] == 0).all()
        it = Item("d", Decimal(30), clock.now() + timedelta(hours=6), clock.now(), 1000, 1000)
        decided[charge] = policy.choose(it, [offer("a", "0.15")], DIRECT, clock.now())
    # 85 % off now: half way, a dip at 90 % looks little better; measured, it is worth it.
    assert decided[None] is None
    assert decided[0.5] is not None


class Fixed:
    """Scenarios handed in, as the benchmark hands the policy the law."""

    def __init__(self, discounts: list[float]) -> None:
        self.discounts = discounts
        self.asked = 0

    def scenarios(self, routes: object, now: datetime) -> tuple[np.ndarray, int]:
        self.asked += 1
        cols = len(COLUMNS.widths)
        return np.tile(np.array(self.discounts)[:, None], (1, cols)), int(COLUMNS.ends[-1])


def test_deadline_aware_waits_when_its_scenarios_say_waiting_pays() -> None:
    # Every scenario offers 80 % off from the next check on; now 50 % is on offer.
    source = Fixed([80.0] * 16)
    policy = DeadlineAware(scenarios=source)
    assert policy.choose(item(min_discount=40), [offer("a", "0.5")], DIRECT, T0) is None
    assert policy.choose(item(min_discount=40), [offer("a", "0.15")], DIRECT, T0) is not None
    # ... but never inside the safety window, whatever the scenarios say.
    late = T0 + timedelta(hours=24) - timedelta(minutes=4)
    assert policy.choose(item(min_discount=40), [offer("a", "0.5")], DIRECT, late) is not None
    assert source.asked == 1  # one plan per market and replan interval, shared by items


def test_deadline_aware_takes_now_when_any_scenario_may_miss() -> None:
    # One scenario in sixteen never qualifies at 40 % again: that deadline is not bet.
    source = Fixed([80.0] * 15 + [10.0])
    policy = DeadlineAware(scenarios=source)
    assert policy.choose(item(min_discount=40), [offer("a", "0.5")], DIRECT, T0) is not None


def test_a_burst_beyond_what_the_chances_can_carry_is_dispatched_now() -> None:
    # Scenarios hold chances for so many items a pass; the later ones of a burst
    # would queue behind the earlier ones, so they take the price now.
    discounts = np.full((16, len(COLUMNS.widths)), -np.inf)
    discounts[:, :6] = 80.0  # six qualifying checks, then nothing
    source = Fixed([0.0])
    source.scenarios = lambda routes, now: (discounts, int(COLUMNS.ends[-1]))  # type: ignore[method-assign]
    policy = DeadlineAware(scenarios=source, per_pass=2, spare=0)
    now = [offer("a", "0.5")]
    waited = [policy.choose(item(40, id=f"b{n}"), now, DIRECT, T0) is None for n in range(20)]
    # Six chances carry two items each: the first twelve may wait, the rest may not.
    assert waited == [True] * 12 + [False] * 8


def test_an_item_that_can_wait_leaves_the_pass_to_one_that_cannot() -> None:
    # Scenarios: 60 % off all along. An item needing 40 % can always wait for it;
    # one needing 80 % never sees it again after this pass.
    source = Fixed([60.0] * 16)
    policy = DeadlineAware(scenarios=source, per_pass=1)
    easy = item(40, hours=2, id="easy")
    hard = item(80, hours=3, id="hard")
    # A pass at 50 % off: the easy item waits for 60 %, the hard one cannot go.
    for it in (easy, hard):
        assert policy.choose(it, [offer("a", "0.5")], DIRECT, T0) is None
    # Next pass, 85 % off: worth taking for both, but only one place a pass and the
    # hard item has no other chance, so the easy one (asked first) lets it go first.
    later = T0 + timedelta(seconds=15)
    deep = [offer("a", "0.15")]
    assert policy.choose(easy, deep, DIRECT, later) is None
    assert policy.choose(hard, deep, DIRECT, later) == deep[0]


def test_policy_by_name() -> None:
    assert isinstance(policy_by_name("first_eligible"), FirstEligible)
    assert isinstance(policy_by_name("deadline-aware"), DeadlineAware)
    assert isinstance(policy_by_name("Deadline_Aware"), DeadlineAware)
    assert policy_by_name("deadline-aware") is not policy_by_name("deadline-aware")
    # Only a policy that learns is shown quiet passes and has its history saved.
    assert isinstance(DeadlineAware(), LearningPolicy)
    assert not isinstance(FirstEligible(), LearningPolicy)
    with pytest.raises(ValueError):
        policy_by_name("cheapest-ever")


def test_a_saved_history_restores_into_a_fresh_policy() -> None:
    clock = ManualClock(T0)
    policy = DeadlineAware()
    policy.observe([offer("b", None), offer("c", "0.1", False)], DIRECT, clock.now())
    _watch(policy, clock, _two_hours_each, 2)
    saved = policy.saved()
    # One series per route; a route with no payable price is saved as such.
    assert sorted(saved) == ["a", "b", "c"]
    assert len(saved["a"]) == 2 * 240 and saved["b"] == saved["c"] == [(saved["b"][0][0], None)]
    assert saved["a"][0][1] == pytest.approx(60.0)
    fresh = DeadlineAware()
    fresh.restore(saved)
    assert fresh.saved() == saved
    # Only what came after a given slot, for a worker that saved up to it.
    last = saved["a"][-1][0]
    assert policy.saved(since=last)["a"] == [saved["a"][-1]]


# --- the benchmark, small -----------------------------------------------------------------


def test_bench_small_deadline_aware_meets_every_chance_first_eligible_meets() -> None:
    """A small replay of the market bench: a behaviour check, not a timing one.

    ``replay`` asserts that every dispatched offer qualifies at the item's
    minimum; here the waiting policy must also meet every deadline
    first-eligible meets, and pay less.
    """
    from bench.market.run import CONTENDERS, run_family

    chosen = [c for c in CONTENDERS if c.name in ("first-eligible", "deadline-aware")]
    result = run_family("cycle+noise", 7, 40, chosen)
    first, waiting = result.paid["first-eligible"], result.paid["deadline-aware"]
    chances = [s for s in result.items if s.best is not None]
    assert len(chances) > 20
    assert set(first) <= set(waiting)
    assert sum(waiting.values()) < sum(first[i] for i in waiting)
