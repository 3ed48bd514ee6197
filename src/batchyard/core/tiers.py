"""Tiers: the limits an organisation lives under, and how credit moves it up.

docs/reference/http.md: a new organisation starts at tier 0, whose requests limit is 30 a
minute (1,800 texts an hour), and buying credit moves it to a higher tier. The
thresholds are cumulative credit bought, so a refund-free ledger decides the
tier by itself and nobody has to remember to promote anyone.

Each tier also has a *concurrency*: how many requests the organisation may have
in flight at once, across all its keys and processes. It is also the burst the
requests limit tolerates, so a client that starts that many calls together is
admitted at once rather than one per interval (see docs/explanation/limits.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    TypeAdapter,
    ValidationError,
)

from batchyard.core.config_errors import ConfigError, from_validation

__all__ = [
    "DEFAULT_TIERS",
    "Tier",
    "TierEntry",
    "build_tiers",
    "default_concurrency",
    "tier_for_purchases",
    "tiers_from_config",
]


def default_concurrency(requests_per_minute: int) -> int:
    """A tier's in-flight allowance when the config names none: five seconds of its rate.

    At least 2, so two calls may always overlap; at most 100, so one
    organisation cannot hold every connection of a replica.
    """
    return max(2, min(100, math.ceil(requests_per_minute / 12)))


@dataclass(frozen=True, slots=True)
class Tier:
    level: int
    requests_per_minute: int
    tokens_per_minute: int
    estimate_tokens_per_minute: int
    # Cumulative credit bought (US dollars) that unlocks this tier.
    min_purchased: Decimal
    # Requests in flight at once per organisation; 0 means ``default_concurrency``.
    concurrency: int = 0

    @property
    def max_in_flight(self) -> int:
        return self.concurrency or default_concurrency(self.requests_per_minute)

    def effective_limits(self) -> dict[str, int]:
        return {
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "estimate_tokens_per_minute": self.estimate_tokens_per_minute,
            "concurrency": self.max_in_flight,
        }


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier(0, 30, 40_000, 400_000, Decimal("0"), concurrency=5),
    Tier(1, 300, 400_000, 4_000_000, Decimal("50"), concurrency=25),
    Tier(2, 1_000, 2_000_000, 20_000_000, Decimal("500"), concurrency=50),
    Tier(3, 5_000, 10_000_000, 100_000_000, Decimal("5000"), concurrency=100),
)


def tier_for_purchases(tiers: Sequence[Tier], purchased: Decimal) -> Tier:
    """The highest tier whose threshold the purchases meet."""
    best = tiers[0]
    for t in tiers:
        if purchased >= t.min_purchased and t.level >= best.level:
            best = t
    return best


class TierEntry(BaseModel):
    """One entry of ``tiers:`` in the config file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    level: NonNegativeInt
    requests_per_minute: PositiveInt
    tokens_per_minute: PositiveInt
    # 10 x tokens_per_minute when left out.
    estimate_tokens_per_minute: PositiveInt | None = None
    min_purchased: Annotated[Decimal, Field(ge=0, allow_inf_nan=False)] = Decimal(0)
    # 0: ``default_concurrency`` of the requests limit.
    concurrency: NonNegativeInt = 0


_TIER_LIST = TypeAdapter(list[TierEntry])


def build_tiers(entries: Sequence[TierEntry]) -> tuple[Tier, ...]:
    """Checked entries as tiers; none means the defaults. Raises ``ConfigError``."""
    if not entries:
        return DEFAULT_TIERS
    for i, t in enumerate(entries):
        if t.level != i:
            raise ConfigError(
                f"tiers[{i}].level",
                f"is {t.level}, where tier {i} belongs",
                "list the tiers from level 0 upwards, each level once",
            )
    return tuple(
        Tier(
            level=t.level,
            requests_per_minute=t.requests_per_minute,
            tokens_per_minute=t.tokens_per_minute,
            estimate_tokens_per_minute=(
                t.estimate_tokens_per_minute
                if t.estimate_tokens_per_minute is not None
                else 10 * t.tokens_per_minute
            ),
            min_purchased=t.min_purchased,
            concurrency=t.concurrency,
        )
        for t in entries
    )


def tiers_from_config(raw: Iterable[Mapping[str, Any]] | None) -> tuple[Tier, ...]:
    """The ``tiers:`` section of a config file; raises ``ConfigError`` naming the field."""
    if not raw:
        return DEFAULT_TIERS
    try:
        entries = _TIER_LIST.validate_python(raw)
    except ValidationError as exc:
        raise from_validation(exc, prefix=("tiers",)) from None
    return build_tiers(entries)
