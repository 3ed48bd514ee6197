"""Migration 0017 counts a run's cached prompt tokens; runs and rows already there count none."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Engine, inspect, text

from batchyard.store.migrations import downgrade, upgrade
from tests.integration.store.conftest import add_org


def _columns(db, table: str) -> set[str]:
    return {c["name"] for c in inspect(db.engine).get_columns(table)}


def _add_answered_run(engine: Engine, now: datetime) -> None:
    """``org.1``'s run with one answered row, in the raw SQL of revision 0016."""
    with engine.begin() as c:
        add_org(c, now)
        c.execute(
            text(
                "INSERT INTO projects (id, org_id, name, created_at, updated_at) "
                "VALUES ('p.1', 'org.1', 'p', :now, :now)"
            ),
            {"now": now},
        )
        c.execute(
            text(
                "INSERT INTO datasets (id, org_id, project_id, name, kind, row_count, fields, "
                "created_at, updated_at, ready) "
                "VALUES ('d.1', 'org.1', 'p.1', 'd', 'text', 1, '[]', :now, :now, true)"
            ),
            {"now": now},
        )
        c.execute(
            text(
                "INSERT INTO batch_inference_runs (id, org_id, project_id, dataset_id, status, "
                "spec, rows_total, rows_done, rows_failed, rows_uncertain, rows_canceled, "
                "input_tokens, output_tokens, charge_accum, outputs_written, approved, "
                "created_at, updated_at) VALUES ('run.1', 'org.1', 'p.1', 'd.1', 'running', "
                "'{}', 1, 1, 0, 0, 0, 12, 3, 5, 0, true, :now, :now)"
            ),
            {"now": now},
        )
        c.execute(
            text(
                "INSERT INTO batch_inference_run_items (run_id, row_id, version, input_tokens, "
                "state, usage_input, usage_output, charge, written) "
                "VALUES ('run.1', 1, 1, 12, 'succeeded', 12, 3, 5, false)"
            ),
        )


def test_0017_adds_the_cached_counts_and_existing_runs_count_none(fresh_db):
    upgrade(fresh_db.engine, "0016")
    assert "cached_input_tokens" not in _columns(fresh_db, "batch_inference_runs")
    _add_answered_run(fresh_db.engine, datetime(2026, 1, 1, tzinfo=UTC))

    upgrade(fresh_db.engine, "0017")
    with fresh_db.engine.connect() as c:
        run = c.execute(
            text("SELECT input_tokens, cached_input_tokens FROM batch_inference_runs")
        ).one()
        row = c.execute(text("SELECT usage_input, usage_cached FROM batch_inference_run_items"))
        assert tuple(run) == (12, 0)
        assert tuple(row.one()) == (12, None)

    downgrade(fresh_db.engine, "0016")
    assert "usage_cached" not in _columns(fresh_db, "batch_inference_run_items")
    with fresh_db.engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM batch_inference_runs")).scalar_one() == 1
