"""Qualification rules and the two dispatch policies, with datetimes moved by hand."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

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


def test_deadline_aware_takes_a_deep_offer_at_once() -> None:
    policy = DeadlineAware()
    deep = [offer("a", "0.05")]
    assert policy.choose(item(min_discount=50), deep, DIRECT, T0) == deep[0]


def test_deadline_aware_never_dispatches_what_does_not_qualify() -> None:
    policy = DeadlineAware()
    it = item(min_discount=50, hours=1)
    clock = ManualClock(T0)
    uncapped = offer("a", "0.01", False)
    shallow = offer("b", "0.6")
    while clock.now() < it.deadline:
        assert policy.choose(it, [uncapped, shallow], DIRECT, clock.now()) is None
        clock.advance(15)


def _warm(
    policy: DeadlineAware, clock: ManualClock, level: Callable[[int], str], hours: int
) -> None:
    """Let the policy watch route ``a`` for ``hours``, one pass every 15 s."""
    for k in range(hours * 240):
        policy.observe([offer("a", level(k))], DIRECT, clock.now())
        clock.advance(15)


def test_deadline_aware_warm_holds_out_for_what_the_market_usually_gives() -> None:
    # Two hours at 0.40, then two at 0.60 (qualifying at 30 % off), all day.
    policy = DeadlineAware(min_memory=timedelta(hours=12))
    clock = ManualClock(T0)
    _warm(policy, clock, lambda k: "0.40" if (k // 480) % 2 == 0 else "0.60", 24)
    it = Item("w", Decimal(30), clock.now() + timedelta(hours=6), clock.now(), 1000, 1000)
    # The price qualifies, but a 6 h window has always held 60 % off: wait.
    assert policy.choose(it, [offer("a", "0.60")], DIRECT, clock.now()) is None
    clock.advance(15)
    assert policy.choose(it, [offer("a", "0.40")], DIRECT, clock.now()) is not None


def test_deadline_aware_warm_takes_the_last_chance_before_it_goes() -> None:
    # Qualifying prices (30 % off) show up one hour a day, and fall in steps
    # of a point: a 1 h item at the edge of the minimum must not wait.
    policy = DeadlineAware(min_memory=timedelta(hours=12))
    clock = ManualClock(T0)
    _warm(policy, clock, lambda k: "0.69" if k % 5760 < 240 else "0.80", 24)
    it = Item("l", Decimal(30), clock.now() + timedelta(hours=1), clock.now(), 1000, 1000)
    policy.observe([offer("a", "0.68")], DIRECT, clock.now())
    clock.advance(15)
    edge = offer("a", "0.695")
    assert policy.choose(it, [edge], DIRECT, clock.now()) == edge


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


# --- the benchmark, small -----------------------------------------------------------------


def _load_bench() -> object:
    path = Path(__file__).resolve().parents[3] / "bench" / "market.py"
    spec = importlib.util.spec_from_file_location("bench_market", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_market"] = module
    spec.loader.exec_module(module)
    return module


def test_bench_small_deadline_aware_meets_every_chance_and_saves() -> None:
    """A small replay of the benchmark: a behaviour check, not a timing one.

    ``replay`` asserts that every dispatched offer qualifies at the item's
    minimum; here the waiting policy must also dispatch every item that had a
    qualifying price before its deadline, and pay less than first-eligible.
    """
    bench = _load_bench()
    chances = met = 0
    contenders = [
        bench.Contender("first", FirstEligible),  # type: ignore[attr-defined]
        bench.Contender("waiting", DeadlineAware),  # type: ignore[attr-defined]
    ]
    for scenario in bench.scenarios(3):  # type: ignore[attr-defined]
        first, waiting = bench.run_scenario(scenario, contenders, 3, 30)  # type: ignore[attr-defined]
        assert first.met == first.chances
        assert waiting.ratio_total < first.ratio_total, scenario.name
        chances += waiting.chances
        met += waiting.met
    assert chances > 100
    assert met == chances


def test_a_saved_history_restores_into_a_fresh_policy() -> None:
    clock = ManualClock(T0)
    policy = DeadlineAware()
    _warm(policy, clock, lambda k: "0.40" if (k // 480) % 2 == 0 else "0.60", 13)
    saved = policy.saved()
    assert list(saved) == ["a"] and len(saved["a"]) == 13 * 30
    fresh = DeadlineAware()
    fresh.restore(saved)
    assert fresh.history("a").span() == policy.history("a").span()
    # Only what came after a given bin, for a worker that saved up to it.
    last = saved["a"][-1][0]
    assert policy.saved(since=last) == {"a": [saved["a"][-1]]}
