"""Decide's calibration state on SQLite and PostgreSQL: per organisation, safe to share."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import inspect

from batchyard.store.calibration import add_texts, load_state, save_content_free


def test_stores_priors_and_adds_texts_per_organisation(fresh_db):
    fresh_db.migrate()
    assert "decide_calibration" in inspect(fresh_db.engine).get_table_names()
    assert fresh_db.read_sync(lambda c: load_state(c, "org", "fp")) is None
    prior = [[0.7, 0.2, 0.1], [0.5, 0.5]]
    fresh_db.transact_sync(lambda c: save_content_free(c, "org", "fp", prior))
    # A second estimate (another process, a moment later) does not replace the first.
    fresh_db.transact_sync(
        lambda c: save_content_free(c, "org", "fp", [[0.1, 0.1, 0.8], [0.9, 0.1]])
    )
    fresh_db.transact_sync(lambda c: add_texts(c, "org", "fp", [[0.6, 0.3, 0.1], [0.2, 0.8]]))
    fresh_db.transact_sync(lambda c: add_texts(c, "org", "fp", [[0.2, 0.3, 0.5], [0.4, 0.6]]))
    state = fresh_db.read_sync(lambda c: load_state(c, "org", "fp"))
    assert state is not None
    assert state.content_free == prior
    assert state.texts == [2, 2]
    assert state.prob_sums[0] == pytest.approx([0.8, 0.6, 0.6])
    assert state.prob_sums[1] == pytest.approx([0.6, 1.4])
    # Per organisation: another one's texts never move these sums.
    assert fresh_db.read_sync(lambda c: load_state(c, "other", "fp")) is None


def test_concurrent_texts_are_all_counted(fresh_db):
    fresh_db.migrate()
    fresh_db.transact_sync(lambda c: save_content_free(c, "org", "fp", [[0.5, 0.5]]))

    def one(_: int) -> None:
        fresh_db.transact_sync(lambda c: add_texts(c, "org", "fp", [[0.25, 0.75]]))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(40)))
    state = fresh_db.read_sync(lambda c: load_state(c, "org", "fp"))
    assert state is not None and state.texts == [40]
    assert state.prob_sums[0] == pytest.approx([10.0, 30.0])
