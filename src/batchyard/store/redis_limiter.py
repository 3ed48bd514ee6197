"""GCRA limits shared by every replica through Redis.

Each operation is one Lua script, so a multi-limit check is atomic on the
server: two replicas can never both read a TAT, both admit, and both write. The
scripts repeat the steps of ``batchyard.core.limits.gcra_many``,
``gcra_adjust`` and ``gcra_penalize``; the shared contract tests run the same
cases against this and the in-process limiter to keep them in step.

Redis down fails closed: a step that cannot reach it raises
``LimiterUnavailable`` (503, retryable), so nothing is admitted, called or
charged on a guess; the client reconnects by itself once Redis is back (a
restarted Redis has lost its scripts and keys: the scripts are loaded again
and the limits start afresh). Only admissions fail closed (``try_acquire``,
``take_slot``): giving a slot back or renewing it (its lease frees it anyway),
a correction and an upstream's penalty (both often after a call that already
happened) are logged when Redis cannot be reached, not raised.

``now`` comes from the injected clock as an argument rather than from Redis
``TIME``, so tests move time with ``ManualClock`` and every replica's view of
time is the one it would use anyway. Keys are hash-tagged on the caller's key
(``batchyard:{org:org.123}:rpm``) so one request's limits share a cluster slot,
and expire once their TAT has passed, when they mean the same as missing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import redis.asyncio as redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from batchyard.core.clock import Clock
from batchyard.core.limits import (
    EPSILON,
    PENALTY,
    Admission,
    Limit,
    LimiterBase,
    SlotGrant,
    binding_name,
    line_horizon,
    line_signature,
    log_penalty,
    new_slot_token,
    request_cells,
    retry_for_place,
    standing_of,
    storage_keys,
)
from batchyard.errors import LimiterUnavailable

__all__ = ["RedisLimiter"]

log = logging.getLogger("batchyard.limits")

#: How long one step waits for Redis before the limiter calls it unavailable. A stopped
#: Redis refuses at once; this only bounds one that accepts and never answers. The
#: event loop measures it, and a late loop finds the reply and the timeout due together
#: and runs the timeout first, so it stays well above any stall a loaded machine gives
#: a loop (two seconds turned a busy loop into 503s).
TIMEOUT_S = 10.0


@asynccontextmanager
async def _reachable() -> AsyncIterator[None]:
    """Turn "Redis cannot be reached" into ``LimiterUnavailable``."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise LimiterUnavailable(
            f"the shared limiter cannot be reached ({type(exc).__name__}); nothing was run "
            "or charged, send the request again shortly"
        ) from exc


# Floats are written with %.17g: Lua's tostring keeps only 14 digits, which at
# epoch scale would round TATs to tens of microseconds and drift the schedule.
# A value returned to Redis as a Lua number is truncated to an integer, so
# waits come back as strings too.
_ACQUIRE = """
local now = tonumber(ARGV[1])
local eps = tonumber(ARGV[2])
local max_delay = tonumber(ARGV[3])
local wait, binding = 0, -1
local tats, new_tats = {}, {}
for i = 1, #KEYS do
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  local inc = tonumber(ARGV[2 + 2 * i])
  local tol = tonumber(ARGV[3 + 2 * i])
  local new_tat = math.max(tat, now) + inc
  local w = new_tat - tol - now
  tats[i] = string.format('%.17g', tat)
  new_tats[i] = new_tat
  if w > wait then wait, binding = w, i - 1 end
end
if wait > max_delay + eps then
  return {0, string.format('%.17g', wait), binding, tats}
end
local written = {}
for i = 1, #KEYS do
  if tonumber(ARGV[2 + 2 * i]) > 0 then
    local ttl = math.ceil((new_tats[i] - now) * 1000) + 1000
    redis.call('SET', KEYS[i], string.format('%.17g', new_tats[i]), 'PX', string.format('%d', ttl))
    written[i] = string.format('%.17g', new_tats[i])
  else
    written[i] = tats[i]
  end
end
return {1, string.format('%.17g', wait), -1, written}
"""

# A check with a line: the last key is the line's sorted set (places scored by
# their time). The steps are ``core.limits.settle_in_line``'s: drop expired
# places; take back the earliest place due within max_delay (after any
# penalty); else the GCRA check, and a refusal within the horizon moves the
# TATs as for an admission and gives the request a place.
_ACQUIRE_IN_LINE = """
local now = tonumber(ARGV[1])
local eps = tonumber(ARGV[2])
local max_delay = tonumber(ARGV[3])
local hold = tonumber(ARGV[4])
local horizon = tonumber(ARGV[5])
local member = ARGV[6]
local line = KEYS[#KEYS]
local n = #KEYS - 1
redis.call('ZREMRANGEBYSCORE', line, '-inf', '(' .. string.format('%.17g', now - hold))
local tats = {}
for i = 1, n do
  tats[i] = tonumber(redis.call('GET', KEYS[i]) or '0')
end
local function fmt(list)
  local out = {}
  for i = 1, #list do out[i] = string.format('%.17g', list[i]) end
  return out
end
local first = redis.call('ZRANGE', line, 0, 0, 'WITHSCORES')
if #first > 0 and tonumber(first[2]) <= now + max_delay + eps then
  local delay = math.max(tonumber(first[2]) - now, tats[1] - now, 0)
  if delay > max_delay + eps then
    return {0, string.format('%.17g', delay), 0, fmt(tats)}
  end
  redis.call('ZREM', line, first[1])
  return {1, string.format('%.17g', delay), -1, fmt(tats)}
end
local wait, binding = 0, -1
local new_tats = {}
for i = 1, n do
  local inc = tonumber(ARGV[5 + 2 * i])
  local tol = tonumber(ARGV[6 + 2 * i])
  local new_tat = math.max(tats[i], now) + inc
  local w = new_tat - tol - now
  new_tats[i] = new_tat
  if w > wait then wait, binding = w, i - 1 end
end
local admit = wait <= max_delay + eps
if not admit and (binding == 0 or wait > horizon + eps) then
  return {0, string.format('%.17g', wait), binding, fmt(tats)}
end
local written = {}
for i = 1, n do
  if tonumber(ARGV[5 + 2 * i]) > 0 then
    local ttl = math.ceil((new_tats[i] - now) * 1000) + 1000
    redis.call('SET', KEYS[i], string.format('%.17g', new_tats[i]), 'PX', string.format('%d', ttl))
    written[i] = new_tats[i]
  else
    written[i] = tats[i]
  end
end
if admit then
  return {1, string.format('%.17g', wait), -1, fmt(written)}
end
redis.call('ZADD', line, string.format('%.17g', now + wait), member)
local last = tonumber(redis.call('ZRANGE', line, -1, -1, 'WITHSCORES')[2])
redis.call('PEXPIRE', line, math.ceil((last + hold - now) * 1000) + 1000)
return {2, string.format('%.17g', wait), binding, fmt(written)}
"""

# Concurrency slots: a sorted set of lease tokens scored by when each lease runs
# out. A check drops the expired ones first, so a crashed holder's slot frees
# itself; the set expires once its last lease would have.
_TAKE_SLOT = """
local now = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local untl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.17g', now))
local n = redis.call('ZCARD', KEYS[1])
if n >= cap then
  return {0, n}
end
redis.call('ZADD', KEYS[1], string.format('%.17g', untl), ARGV[4])
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])
redis.call('PEXPIRE', KEYS[1], math.ceil((last - now) * 1000) + 1000)
return {1, n + 1}
"""

_RENEW_SLOT = """
local now = tonumber(ARGV[1])
local untl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', string.format('%.17g', untl), ARGV[3])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if #last > 0 then
  redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(last[2]) - now) * 1000) + 1000)
end
return 1
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
        self._redis: redis.Redis = redis.Redis.from_url(
            redis_url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self._prefix = prefix
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._acquire_in_line = self._redis.register_script(_ACQUIRE_IN_LINE)
        self._adjust = self._redis.register_script(_ADJUST)
        self._penalize = self._redis.register_script(_PENALIZE)
        self._take_slot = self._redis.register_script(_TAKE_SLOT)
        self._renew_slot = self._redis.register_script(_RENEW_SLOT)

    def _key(self, storage_key: str) -> str:
        # storage_key is "<key>:<name>"; the limit name never holds a colon.
        caller_key, _, name = storage_key.rpartition(":")
        return f"{self._prefix}{{{caller_key}}}:{name}"

    async def try_acquire(
        self,
        key: str,
        limits: Sequence[tuple[Limit, float]],
        *,
        max_delay: float = 0.0,
        hold_s: float = 0.0,
    ) -> Admission:
        keys = [self._key(k) for k in storage_keys(key, limits)]
        now = self._clock.time()
        if hold_s > 0 and limits:
            return await self._try_in_line(key, limits, keys, now, max_delay, hold_s)
        args: list[str | float] = [repr(now), repr(EPSILON), repr(max(0.0, max_delay))]
        for cell in request_cells(limits):
            args += [repr(cell.increment), repr(cell.tolerance)]
        async with _reachable():
            allowed, wait, binding, raw_tats = await self._acquire(keys=keys, args=args)
        tats = [float(t) for t in raw_tats]
        standing = standing_of(limits, tats, now)
        if int(allowed):
            delay = float(wait)
            return Admission(True, 0.0, None, delay if delay > EPSILON else 0.0, standing)
        return Admission(False, float(wait), binding_name(limits, int(binding)), 0.0, standing)

    async def _try_in_line(
        self,
        key: str,
        limits: Sequence[tuple[Limit, float]],
        keys: list[str],
        now: float,
        max_delay: float,
        hold_s: float,
    ) -> Admission:
        max_delay = max(0.0, max_delay)
        line = f"{self._prefix}{{{key}}}:!line:{line_signature(limits)}"
        args: list[str | float] = [
            repr(now),
            repr(EPSILON),
            repr(max_delay),
            repr(hold_s),
            repr(line_horizon(max_delay)),
            new_slot_token()[:16],
        ]
        for cell in request_cells(limits):
            args += [repr(cell.increment), repr(cell.tolerance)]
        async with _reachable():
            verdict, raw_wait, binding, raw_tats = await self._acquire_in_line(
                keys=[*keys, line], args=args
            )
        standing = standing_of(limits, [float(t) for t in raw_tats], now)
        wait = float(raw_wait)
        if int(verdict) == 1:
            return Admission(True, 0.0, None, wait if wait > EPSILON else 0.0, standing)
        name = binding_name(limits, int(binding))
        if int(verdict) == 2:
            # Refused with a place in line: come back in time to wait the rest here.
            return Admission(False, retry_for_place(wait, max_delay), name, 0.0, standing)
        return Admission(False, wait, name, 0.0, standing)

    def _slots_key(self, key: str) -> str:
        return f"{self._prefix}{{{key}}}:!slots"

    async def take_slot(self, key: str, capacity: int, lease_s: float) -> SlotGrant:
        now = self._clock.time()
        token = new_slot_token()
        async with _reachable():
            ok, n = await self._take_slot(
                keys=[self._slots_key(key)],
                args=[repr(now), str(capacity), repr(now + lease_s), token],
            )
        return SlotGrant(token if int(ok) else None, int(n))

    async def renew_slot(self, key: str, token: str, lease_s: float) -> None:
        now = self._clock.time()
        try:
            async with _reachable():
                await self._renew_slot(
                    keys=[self._slots_key(key)], args=[repr(now), repr(now + lease_s), token]
                )
        except LimiterUnavailable:
            log.warning("could not renew a concurrency slot; its lease frees it")

    async def _free_slot(self, key: str, token: str) -> None:
        try:
            async with _reachable():
                await self._redis.zrem(self._slots_key(key), token)
        except LimiterUnavailable:
            log.warning("could not give a concurrency slot back; its lease frees it")

    async def adjust(self, key: str, limit: Limit, delta: float) -> None:
        try:
            async with _reachable():
                await self._adjust(
                    keys=[self._key(f"{key}:{limit.name}")],
                    args=[repr(self._clock.time()), repr(delta * limit.interval)],
                )
        except LimiterUnavailable:
            # A correction after the fact: the call it corrects already happened.
            log.warning("could not correct a limit; the limiter cannot be reached")

    async def penalize(self, key: str, until: float) -> None:
        now = self._clock.time()
        try:
            async with _reachable():
                await self._penalize(
                    keys=[self._key(f"{key}:{PENALTY}")], args=[repr(now), repr(until)]
                )
        except LimiterUnavailable:
            # Advice from an upstream, often read after its call landed: never fail that call.
            log.warning("could not record an upstream's penalty; the limiter cannot be reached")
            return
        log_penalty(key, until, now)

    async def close(self) -> None:
        await self._redis.aclose()
