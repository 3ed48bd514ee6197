"""GCRA limits shared by every replica through Redis.

Each operation is one Lua script, so a multi-limit check is atomic on the
server: two replicas can never both read a TAT, both admit, and both write. The
scripts repeat the steps of ``batchyard.core.limits.gcra_many``,
``gcra_adjust`` and ``gcra_penalize``; the shared contract tests run the same
cases against this and the in-process limiter to keep them in step.

``now`` comes from the injected clock as an argument rather than from Redis
``TIME``, so tests move time with ``ManualClock`` and every replica's view of
time is the one it would use anyway. Keys are hash-tagged on the caller's key
(``batchyard:{org:org.123}:rpm``) so one request's limits share a cluster slot,
and expire once their TAT has passed, when they mean the same as missing.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as redis

from batchyard.core.clock import Clock
from batchyard.core.limits import (
    EPSILON,
    PENALTY,
    Admission,
    Limit,
    LimiterBase,
    binding_name,
    log_penalty,
    request_cells,
    storage_keys,
)

__all__ = ["RedisLimiter"]

# Floats are written with %.17g: Lua's tostring keeps only 14 digits, which at
# epoch scale would round TATs to tens of microseconds and drift the schedule.
# A value returned to Redis as a Lua number is truncated to an integer, so
# waits come back as strings too.
_ACQUIRE = """
local now = tonumber(ARGV[1])
local eps = tonumber(ARGV[2])
local wait, binding = 0, -1
local new_tats = {}
for i = 1, #KEYS do
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  local inc = tonumber(ARGV[1 + 2 * i])
  local tol = tonumber(ARGV[2 + 2 * i])
  local new_tat = math.max(tat, now) + inc
  local w = new_tat - tol - now
  new_tats[i] = new_tat
  if w > wait then wait, binding = w, i - 1 end
end
if wait > eps then
  return {0, string.format('%.17g', wait), binding}
end
for i = 1, #KEYS do
  if tonumber(ARGV[1 + 2 * i]) > 0 then
    local ttl = math.ceil((new_tats[i] - now) * 1000) + 1000
    redis.call('SET', KEYS[i], string.format('%.17g', new_tats[i]), 'PX', string.format('%d', ttl))
  end
end
return {1, '0', -1}
"""

_ADJUST = """
local now = tonumber(ARGV[1])
local inc = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local new_tat = math.max(math.max(tat, now) + inc, now)
if new_tat > now then
  local ttl = math.ceil((new_tat - now) * 1000) + 1000
  redis.call('SET', KEYS[1], string.format('%.17g', new_tat), 'PX', string.format('%d', ttl))
else
  redis.call('DEL', KEYS[1])
end
return 1
"""

_PENALIZE = """
local now = tonumber(ARGV[1])
local untl = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local new_tat = math.max(tat, untl)
if new_tat > now then
  local ttl = math.ceil((new_tat - now) * 1000) + 1000
  redis.call('SET', KEYS[1], string.format('%.17g', new_tat), 'PX', string.format('%d', ttl))
end
return 1
"""


class RedisLimiter(LimiterBase):
    """Limits shared across processes and hosts; one round trip per check."""

    def __init__(self, redis_url: str, clock: Clock, prefix: str = "batchyard:") -> None:
        super().__init__(clock)
        self._redis: redis.Redis = redis.Redis.from_url(redis_url)
        self._prefix = prefix
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._adjust = self._redis.register_script(_ADJUST)
        self._penalize = self._redis.register_script(_PENALIZE)

    def _key(self, storage_key: str) -> str:
        # storage_key is "<key>:<name>"; the limit name never holds a colon.
        caller_key, _, name = storage_key.rpartition(":")
        return f"{self._prefix}{{{caller_key}}}:{name}"

    async def try_acquire(self, key: str, limits: Sequence[tuple[Limit, float]]) -> Admission:
        keys = [self._key(k) for k in storage_keys(key, limits)]
        args: list[str | float] = [repr(self._clock.time()), repr(EPSILON)]
        for cell in request_cells(limits):
            args += [repr(cell.increment), repr(cell.tolerance)]
        allowed, wait, binding = await self._acquire(keys=keys, args=args)
        if int(allowed):
            return Admission(True, 0.0)
        return Admission(False, float(wait), binding_name(limits, int(binding)))

    async def adjust(self, key: str, limit: Limit, delta: float) -> None:
        await self._adjust(
            keys=[self._key(f"{key}:{limit.name}")],
            args=[repr(self._clock.time()), repr(delta * limit.interval)],
        )

    async def penalize(self, key: str, until: float) -> None:
        now = self._clock.time()
        await self._penalize(keys=[self._key(f"{key}:{PENALTY}")], args=[repr(now), repr(until)])
        log_penalty(key, until, now)

    async def close(self) -> None:
        await self._redis.aclose()
