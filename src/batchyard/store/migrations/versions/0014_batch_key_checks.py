"""batch key checks: the fingerprint of the key this database's data is sealed with"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # One row, written by the first process with a key: a later process with
    # another key (or none, or a fresh batch.key) is refused at start.
    op.create_table(
        "batch_key_checks",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("batch_key_checks")
