"""The exact optimal stopping policy, where the law makes it computable.

For one route whose log price is a known daily cycle plus fresh Gaussian
noise at every check (the ``cycle+noise`` family), the prices of different
checks are independent given the time, so the optimal policy is a threshold
per check found by backward induction over every remaining check::

    V[last + 1] = penalty
    V[k] = E[min(cost_k, V[k + 1]) if cost_k qualifies else V[k + 1]]

and the policy stops at check k when the cost there is at most V[k + 1]. It
checks how close the least-squares Monte Carlo reference
(``bench/market/reference.py``) comes to the true optimum where both exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime

import numpy as np
from bench.market.laws import Family
from bench.market.sim import DIRECT, Market, SimItem
from bench.market.trace import LOWEST, Trace, check_at, cycle

from batchyard.core.market import Item, RouteOffer, offer_cost, qualifies

_Z = np.linspace(-6, 6, 241)
_W = np.exp(-0.5 * _Z**2)
_W /= _W.sum()


class ExactStopping:
    name = "exact optimum"

    @staticmethod
    def applies(fam: Family) -> bool:
        (route, *others) = fam.routes
        plain = not (
            route.wander or route.dip_every_h or route.regime_every_h or route.step_minutes
        )
        return not others and plain and not route.gap_every_h and not fam.common and (
            route.noise_df == 0 and not fam.feed_gap_every_h and route.fallback is None
        )  # fmt: skip

    def __init__(
        self, trace: Trace, market: Market, items: Sequence[SimItem], penalty: float = 300.0
    ) -> None:
        (route,) = trace.routes
        law = route.law
        first = min(s.first for s in items)
        last = max(s.last for s in items)
        checks = np.arange(first, last + 2, dtype=np.float64)
        # The price share at each check and noise level, before the clip at LOWEST.
        mean = math.log(law.base) + cycle(law, checks)
        share = np.maximum(np.exp(mean[:, None] + law.noise * _Z[None, :]), LOWEST)
        self._first = first
        skew = 1 + abs(law.skew)
        unit = np.array(
            [(s.item.input_tokens + 4.0 * s.item.max_output_tokens) / 1e6 for s in items]
        )
        limit = np.array([(1 - float(s.item.min_discount) / 100) / skew for s in items])
        ends = np.array([s.last - first for s in items])
        missed = penalty / 100 * unit
        # value[i, j]: expected cost of the optimal policy from check first + j on, for item i.
        value = np.empty((len(items), len(checks)))
        value[:, -1] = missed
        for j in range(len(checks) - 2, -1, -1):
            going_on = value[:, j + 1, None]
            cost = share[j][None, :] * unit[:, None]
            ok = share[j][None, :] <= limit[:, None]
            here = np.where(ok, np.minimum(cost, going_on), going_on) @ _W
            value[:, j] = np.where(j <= ends, here, missed)
        self._values = {s.item.id: value[i] for i, s in enumerate(items)}

    def choose(
        self, item: Item, offers: Sequence[RouteOffer], direct: object, now: datetime
    ) -> RouteOffer | None:
        (offer,) = offers
        if now >= item.deadline or not qualifies(offer, DIRECT, item.min_discount):
            return None
        going_on = self._values[item.id][check_at(now) - self._first + 1]
        cost = float(offer_cost(offer, item.input_tokens, item.max_output_tokens))
        return offer if cost <= going_on else None
