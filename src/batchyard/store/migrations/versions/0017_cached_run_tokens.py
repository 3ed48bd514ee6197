"""cached run tokens: how many of a run's prompt tokens the engine read from its cache

``batch_inference_run_items.usage_cached`` per answered row, and the run's sum
in ``batch_inference_runs.cached_input_tokens``: a run's rows usually share a
system prompt, and a route with a cached-input price charges those tokens less.
Rows answered before this revision count none.
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE on both backends: a batch (copy-and-move) would drop the runs
    # table, which its rows' foreign keys forbid once it holds a run.
    op.add_column(
        "batch_inference_runs",
        sa.Column("cached_input_tokens", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.add_column(
        "batch_inference_run_items", sa.Column("usage_cached", sa.Integer(), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("batch_inference_run_items", "usage_cached")
    op.drop_column("batch_inference_runs", "cached_input_tokens")
