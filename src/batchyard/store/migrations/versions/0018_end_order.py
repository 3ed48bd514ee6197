"""end order: the order a batch's items end, so a reader can follow a batch while it runs

Each batch row counts the end numbers its items have taken (``ended_seq``),
and each item keeps its own (``store.end_order``). Items that ended before
this revision have none: a reader following such a batch sees only what
ends from now on, and the final results are unchanged.
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_PARENTS = ("file_batches", "batches")
_ITEMS = (("file_batch_lines", "ix_fbl_ended"), ("batch_items", "ix_batch_items_ended"))


def upgrade() -> None:
    # Plain ALTER TABLE on both backends (see 0017: a batch copy would drop referenced tables).
    for table in _PARENTS:
        op.add_column(
            table, sa.Column("ended_seq", sa.BigInteger(), nullable=False, server_default="0")
        )
    for table, index in _ITEMS:
        op.add_column(table, sa.Column("ended_seq", sa.BigInteger(), nullable=True))
        op.create_index(index, table, ["batch_id", "ended_seq"])


def downgrade() -> None:
    for table, index in _ITEMS:
        op.drop_index(index, table_name=table)
        op.drop_column(table, "ended_seq")
    for table in _PARENTS:
        op.drop_column(table, "ended_seq")
