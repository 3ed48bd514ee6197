"""The market worker's memory of prices, for a policy that learns from them.

``DeadlineAware`` judges a wait by what followed moments like now in the last
week of its market. Kept only in the worker, that week would be lost at every
deploy and the policy would act as first-eligible for a day and more; so each
pass saves the bins seen since the last save, and a starting worker restores
them (``store.market_history``). A policy that learns nothing is left alone.
"""

from __future__ import annotations

import logging

from batchyard.core.clock import Clock
from batchyard.core.market import LearningPolicy, Policy
from batchyard.core.outlook import bin_index
from batchyard.store import market_history
from batchyard.store.database import Database

__all__ = ["MarketMemory"]

log = logging.getLogger("batchyard.market")


class MarketMemory:
    """Saves and restores one worker's policy history."""

    def __init__(self, db: Database, clock: Clock, policy: Policy) -> None:
        self.db = db
        self.clock = clock
        self.policy = policy if isinstance(policy, LearningPolicy) else None
        self._saved_from: int | None = None

    async def restore(self) -> int:
        """Give the policy what earlier workers saw; returns the bins restored."""
        policy = self.policy
        if policy is None:
            return 0
        since = bin_index(self.clock.now() - policy.memory)
        markets = await self.db.read(lambda c: market_history.load_history(c, since))
        policy.restore(markets)
        return sum(len(bins) for bins in markets.values())

    async def save(self) -> None:
        """Store the bins seen since the last save (the last one may still move)."""
        policy = self.policy
        if policy is None:
            return
        now = self.clock.now()
        markets = policy.saved(self._saved_from)
        here = bin_index(now)
        # Prune once per bin, not on every pass.
        keep_from = bin_index(now - policy.memory) if here != self._saved_from else None
        try:
            await self.db.write(
                lambda c: market_history.save_history(c, markets, keep_from=keep_from)
            )
        except Exception:
            # The history only sharpens the policy; a pass must not fail for it.
            # The next pass saves from the same bin again.
            log.warning("market history not saved", extra={"event": "market_history_error"})
            return
        self._saved_from = here
