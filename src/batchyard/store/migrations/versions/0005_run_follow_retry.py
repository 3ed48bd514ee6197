"""runs followed and retried: the order a run's rows end, and retry links

A batch inference run counts the end numbers its rows have taken
(``ended_seq``) and each row keeps its own (``store.end_order``), as file
batches and deferred batches do since 0002. Rows that ended before this
revision have none: a reader following such a run sees only what ends from
now on. A run names the run it retries (``retry_of``) and the run that
retried it (``retried_by``).
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE on both backends (a batch copy would drop tables that other rows reference).
    op.add_column(
        "batch_inference_runs",
        sa.Column("ended_seq", sa.BigInteger(), nullable=False, server_default="0"),
    )
    for column in ("retry_of", "retried_by"):
        op.add_column("batch_inference_runs", sa.Column(column, sa.String(64), nullable=True))
    op.add_column(
        "batch_inference_run_items", sa.Column("ended_seq", sa.BigInteger(), nullable=True)
    )
    # Partial: a row enters it when it ends, so freezing pending rows pays nothing for it.
    op.create_index(
        "ix_bir_items_ended",
        "batch_inference_run_items",
        ["run_id", "ended_seq"],
        sqlite_where=sa.text("ended_seq IS NOT NULL"),
        postgresql_where=sa.text("ended_seq IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_bir_items_ended", table_name="batch_inference_run_items")
    op.drop_column("batch_inference_run_items", "ended_seq")
    for column in ("retried_by", "retry_of", "ended_seq"):
        op.drop_column("batch_inference_runs", column)
