"""Tiers: the limits an organisation lives under, and how credit moves it up.

Seed 000: a new organisation starts at tier 0, whose requests limit is 30 a
minute (1,800 texts an hour), and buying credit moves it to a higher tier. The
thresholds are cumulative credit bought, so a refund-free ledger decides the
tier by itself and nobody has to remember to promote anyone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

__all__ = ["DEFAULT_TIERS", "Tier", "tier_for_purchases", "tiers_from_config"]


@dataclass(frozen=True, slots=True)
class Tier:
    level: int
    requests_per_minute: int
    tokens_per_minute: int
    estimate_tokens_per_minute: int
    # Cumulative credit bought (US dollars) that unlocks this tier.
    min_purchased: Decimal

    def effective_limits(self) -> dict[str, int]:
        return {
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "estimate_tokens_per_minute": self.estimate_tokens_per_minute,
        }


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier(0, 30, 40_000, 400_000, Decimal("0")),
    Tier(1, 300, 400_000, 4_000_000, Decimal("50")),
    Tier(2, 1_000, 2_000_000, 20_000_000, Decimal("500")),
    Tier(3, 5_000, 10_000_000, 100_000_000, Decimal("5000")),
)


def tier_for_purchases(tiers: Sequence[Tier], purchased: Decimal) -> Tier:
    """The highest tier whose threshold the purchases meet."""
    best = tiers[0]
    for t in tiers:
        if purchased >= t.min_purchased and t.level >= best.level:
            best = t
    return best


def tiers_from_config(raw: Iterable[Mapping[str, Any]] | None) -> tuple[Tier, ...]:
    if not raw:
        return DEFAULT_TIERS
    tiers = tuple(
        Tier(
            level=int(t["level"]),
            requests_per_minute=int(t["requests_per_minute"]),
            tokens_per_minute=int(t["tokens_per_minute"]),
            estimate_tokens_per_minute=int(
                t.get("estimate_tokens_per_minute", 10 * int(t["tokens_per_minute"]))
            ),
            min_purchased=Decimal(str(t.get("min_purchased", "0"))),
        )
        for t in raw
    )
    levels = [t.level for t in tiers]
    if sorted(levels) != levels or len(set(levels)) != len(levels) or levels[0] != 0:
        raise ValueError("tiers must be listed from level 0 upwards, each level once")
    return tiers
