"""calls marked sent, runs and files that know their key, uploads that appear whole, a probe"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Set just before the engine call: only a call that really started can be uncertain.
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("batch_inference_run_items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("file_batch_lines", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))
    # The key that started a run: revoking it stops the run.
    with op.batch_alter_table("batch_inference_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("key_id", sa.String(length=64), nullable=True))
    # The key that uploaded a file (or whose batch wrote it): an inference key sees its own.
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.add_column(sa.Column("key_id", sa.String(length=64), nullable=True))
    # An upload is invisible until its last row is in: a failed one leaves no half dataset.
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("ready", sa.Boolean(), nullable=False, server_default=sa.true())
        )
    # Finding the activity of a hold (a stranded one is reported once).
    with op.batch_alter_table("activity", schema=None) as batch_op:
        batch_op.create_index("ix_activity_reservation", ["reservation_id"], unique=False)
    # /readyz writes here to learn whether the store can still write.
    op.create_table(
        "store_probes",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("store_probes")
    with op.batch_alter_table("activity", schema=None) as batch_op:
        batch_op.drop_index("ix_activity_reservation")
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_column("ready")
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_column("key_id")
    with op.batch_alter_table("batch_inference_runs", schema=None) as batch_op:
        batch_op.drop_column("key_id")
    with op.batch_alter_table("file_batch_lines", schema=None) as batch_op:
        batch_op.drop_column("sent_at")
    with op.batch_alter_table("batch_inference_run_items", schema=None) as batch_op:
        batch_op.drop_column("sent_at")
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.drop_column("sent_at")
