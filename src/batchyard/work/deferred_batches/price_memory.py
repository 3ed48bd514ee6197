"""The deferred-batch worker's memory of prices, for a policy that learns from them.

``DeadlineAware`` builds its scenarios from each route's past week. Kept only
in the worker, that week would be lost at every deploy and the policy would
bet no deadline for a day; so each pass saves the slots seen since the last
save, and a starting worker restores them (``store.market_history``). A
policy that learns nothing is left alone.
"""

from __future__ import annotations

import logging

from batchyard.core.clock import Clock
from batchyard.core.market import LearningPolicy, Policy
from batchyard.core.route_history import slot_index
from batchyard.store import market_history
from batchyard.store.database import Database

__all__ = ["PriceMemory"]

log = logging.getLogger("batchyard.deferred_batches")

#: Prune old slots once in this many slots (an hour), not on every pass.
_PRUNE_EVERY = 240


class PriceMemory:
    """Saves and restores one worker's policy history."""

    def __init__(self, db: Database, clock: Clock, policy: Policy) -> None:
        self.db = db
        self.clock = clock
        self.policy = policy if isinstance(policy, LearningPolicy) else None
        self._saved_from: int | None = None
        self._pruned_at: int | None = None

    async def restore(self) -> int:
        """Give the policy what earlier workers saw; returns the slots restored."""
        policy = self.policy
        if policy is None:
            return 0
        since = slot_index(self.clock.now() - policy.memory)
        routes = await self.db.read(lambda c: market_history.load_history(c, since))
        policy.restore(routes)
        return sum(len(slots) for slots in routes.values())

    async def save(self) -> None:
        """Store the slots seen since the last save (the last one may still move)."""
        policy = self.policy
        if policy is None:
            return
        now = self.clock.now()
        routes = policy.saved(self._saved_from)
        here = slot_index(now)
        prune = self._pruned_at is None or here - self._pruned_at >= _PRUNE_EVERY
        keep_from = slot_index(now - policy.memory) if prune else None
        try:
            await self.db.write(
                lambda c: market_history.save_history(c, routes, keep_from=keep_from)
            )
        except Exception:
            # The history only sharpens the policy; a pass must not fail for it.
            # The next pass saves from the same slot again.
            log.warning("market history not saved", extra={"event": "market_history_error"})
            return
        self._saved_from = here
        if prune:
            self._pruned_at = here
