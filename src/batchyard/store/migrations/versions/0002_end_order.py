"""end order and retries: follow a batch while it runs; retry only what failed

Each batch row counts the end numbers its items have taken (``ended_seq``),
and each item keeps its own (``store.end_order``). Items that ended before
this revision have none: a reader following such a batch sees only what
ends from now on, and the final results are unchanged. A file batch names
the batch it retries (``retry_of``) and the batch that retried it
(``retried_by``).
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_PARENTS = ("file_batches", "batches")
_ITEMS = (("file_batch_lines", "ix_fbl_ended"), ("batch_items", "ix_batch_items_ended"))


def upgrade() -> None:
    # Plain ALTER TABLE on both backends (a batch copy would drop tables that other rows reference).
    for table in _PARENTS:
        op.add_column(
            table, sa.Column("ended_seq", sa.BigInteger(), nullable=False, server_default="0")
        )
    for table, index in _ITEMS:
        op.add_column(table, sa.Column("ended_seq", sa.BigInteger(), nullable=True))
        op.create_index(index, table, ["batch_id", "ended_seq"])
    for column in ("retry_of", "retried_by"):
        op.add_column("file_batches", sa.Column(column, sa.String(64), nullable=True))


def downgrade() -> None:
    for column in ("retried_by", "retry_of"):
        op.drop_column("file_batches", column)
    for table, index in _ITEMS:
        op.drop_index(index, table_name=table)
        op.drop_column(table, "ended_seq")
    for table in _PARENTS:
        op.drop_column(table, "ended_seq")
