"""files and file batches: OpenAI's Files and Batches beside deferred batches"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=True),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        sa.Column("kind", sa.String(length=8), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["org_id"], ["organisations.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_files_org", "files", ["org_id", "id"])
    op.create_index("ix_files_status", "files", ["status", "created_at"])
    op.create_table(
        "file_lines",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("line", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"]),
        sa.PrimaryKeyConstraint("file_id", "line"),
    )
    op.create_table(
        "file_batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("metadata", sa.Text(), nullable=True),
        sa.Column("min_discount", sa.String(length=16), nullable=True),
        sa.Column("errors", sa.Text(), nullable=True),
        sa.Column("request_count", sa.Integer(), nullable=False),
        sa.Column("max_cost", sa.BigInteger(), nullable=False),
        sa.Column("reservation_id", sa.String(length=64), nullable=True),
        sa.Column("charge", sa.BigInteger(), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("in_progress_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finalizing_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelling_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["org_id"], ["organisations.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_file_batches_org", "file_batches", ["org_id", "id"])
    op.create_index("ix_file_batches_status", "file_batches", ["status", "expires_at"])
    op.create_table(
        "file_batch_lines",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("line", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("route", sa.String(length=200), nullable=True),
        sa.Column("usage_input", sa.Integer(), nullable=True),
        sa.Column("usage_output", sa.Integer(), nullable=True),
        sa.Column("charge", sa.BigInteger(), nullable=True),
        sa.Column("out", sa.LargeBinary(), nullable=True),
        sa.Column("out_bytes", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["batch_id"], ["file_batches.id"]),
        sa.PrimaryKeyConstraint("batch_id", "line"),
    )
    op.create_index("ix_fbl_state", "file_batch_lines", ["batch_id", "state", "line"])
    op.create_index("ix_fbl_lease", "file_batch_lines", ["state", "lease_expires_at"])


def downgrade() -> None:
    op.drop_index("ix_fbl_lease", table_name="file_batch_lines")
    op.drop_index("ix_fbl_state", table_name="file_batch_lines")
    op.drop_table("file_batch_lines")
    op.drop_index("ix_file_batches_status", table_name="file_batches")
    op.drop_index("ix_file_batches_org", table_name="file_batches")
    op.drop_table("file_batches")
    op.drop_table("file_lines")
    op.drop_index("ix_files_status", table_name="files")
    op.drop_index("ix_files_org", table_name="files")
    op.drop_table("files")
