"""fencing tokens: every lease carries a number that grows with each claim"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Each leased object: a run, a file batch's line, a deferred batch item.
_LEASED = ("batch_inference_runs", "file_batch_lines", "batch_items")


def upgrade() -> None:
    # A claim adds one; every write its holder makes names the token it was given,
    # so a worker that comes back after another claimed the object changes nothing.
    for table in _LEASED:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(
                sa.Column("lease_token", sa.BigInteger(), nullable=False, server_default="0")
            )


def downgrade() -> None:
    for table in reversed(_LEASED):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("lease_token")
