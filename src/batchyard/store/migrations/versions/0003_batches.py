"""deferred batches and their items"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("min_discount", sa.String(length=16), nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("request_count", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("purged_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["org_id"], ["organisations.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.create_index("ix_batches_org", ["org_id", "id"], unique=False)
        batch_op.create_index("ix_batches_completed", ["completed_at"], unique=False)

    op.create_table(
        "batch_items",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("min_discount", sa.String(length=16), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=True),
        sa.Column("route", sa.String(length=200), nullable=True),
        sa.Column("reservation_id", sa.String(length=64), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("result_status", sa.Integer(), nullable=True),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_items_custom_id"),
    )
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.create_index("ix_batch_items_batch", ["batch_id", "position"], unique=False)
        batch_op.create_index("ix_batch_items_status", ["status", "deadline"], unique=False)
        batch_op.create_index("ix_batch_items_org", ["org_id", "status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.drop_index("ix_batch_items_org")
        batch_op.drop_index("ix_batch_items_status")
        batch_op.drop_index("ix_batch_items_batch")
    op.drop_table("batch_items")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_completed")
        batch_op.drop_index("ix_batches_org")
    op.drop_table("batches")
