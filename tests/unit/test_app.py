"""The composition root: settings in, a wired service out; the limiter the settings ask for."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from batchyard.app import limiter_from_url
from batchyard.core.clock import ManualClock
from batchyard.core.limits import InMemoryLimiter, Limiter
from batchyard.store.sql_limiter import SqlLimiter


async def test_limiter_from_url_picks_by_scheme(clock: ManualClock) -> None:
    engine = sa.create_engine("sqlite://")
    assert isinstance(limiter_from_url(None, clock, engine), InMemoryLimiter)
    assert isinstance(limiter_from_url("memory", clock, engine), InMemoryLimiter)
    assert isinstance(limiter_from_url(None, clock, engine), Limiter)
    assert isinstance(limiter_from_url("sql", clock, engine), SqlLimiter)
    with pytest.raises(ValueError, match="scheme") as raised:
        limiter_from_url("mongodb://user:secret@host", clock, engine)
    assert "secret" not in str(raised.value)
