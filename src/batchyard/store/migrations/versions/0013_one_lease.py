"""one lease: every leased row has an owner, an expiry named lease_expires_at, and a token"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Runs and file-batch lines already carry lease_owner, lease_expires_at and
    # lease_token; a deferred item named its expiry lease_until and had no owner
    # (its claim was fenced by the token and the reservation alone). Now every
    # leased row is fenced the same way, by its holder and its claim's token
    # (store.leases). An item dispatched before this keeps its expiry; with no
    # owner, only recovery (a lapsed lease) can end it, which is what a worker of
    # the old code that is gone would need.
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.alter_column(
            "lease_until",
            new_column_name="lease_expires_at",
            existing_type=sa.DateTime(timezone=True),
            existing_nullable=True,
        )
        batch_op.add_column(sa.Column("lease_owner", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.drop_column("lease_owner")
        batch_op.alter_column(
            "lease_expires_at",
            new_column_name="lease_until",
            existing_type=sa.DateTime(timezone=True),
            existing_nullable=True,
        )
