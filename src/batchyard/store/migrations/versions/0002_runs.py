"""projects, datasets with versioned rows, batch inference runs and their rows"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "projects",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["org_id"], ["organisations.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_projects_org_id"), ["org_id"], unique=False)

    op.create_table(
        "datasets",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("project_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("row_count", sa.Integer(), nullable=False),
        sa.Column("fields", sa.Text(), nullable=False),
        sa.Column("source_run_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["org_id"], ["organisations.id"]),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.create_index("ix_datasets_project", ["project_id", "id"], unique=False)

    op.create_table(
        "dataset_rows",
        sa.Column("dataset_id", sa.String(length=64), nullable=False),
        sa.Column("row_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("current", sa.Boolean(), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"]),
        sa.PrimaryKeyConstraint("dataset_id", "row_id", "version"),
    )
    with op.batch_alter_table("dataset_rows", schema=None) as batch_op:
        batch_op.create_index(
            "ix_dataset_rows_current", ["dataset_id", "current", "row_id"], unique=False
        )

    op.create_table(
        "batch_inference_runs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("project_id", sa.String(length=64), nullable=False),
        sa.Column("dataset_id", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("blocked_reason", sa.String(length=32), nullable=True),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("quote_rows", sa.Integer(), nullable=True),
        sa.Column("quote_input_tokens", sa.BigInteger(), nullable=True),
        sa.Column("quote_max_output_tokens", sa.BigInteger(), nullable=True),
        sa.Column("quote_max_cost", sa.BigInteger(), nullable=True),
        sa.Column("quote_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rows_total", sa.Integer(), nullable=False),
        sa.Column("rows_done", sa.Integer(), nullable=False),
        sa.Column("rows_failed", sa.Integer(), nullable=False),
        sa.Column("rows_uncertain", sa.Integer(), nullable=False),
        sa.Column("rows_canceled", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("charge_accum", sa.BigInteger(), nullable=False),
        sa.Column("charge", sa.BigInteger(), nullable=True),
        sa.Column("reservation_id", sa.String(length=64), nullable=True),
        sa.Column("output_dataset_id", sa.String(length=64), nullable=True),
        sa.Column("outputs_written", sa.Integer(), nullable=False),
        sa.Column("approved", sa.Boolean(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["dataset_id"], ["datasets.id"]),
        sa.ForeignKeyConstraint(["org_id"], ["organisations.id"]),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("batch_inference_runs", schema=None) as batch_op:
        batch_op.create_index("ix_bir_project", ["project_id", "id"], unique=False)
        batch_op.create_index("ix_bir_status", ["status", "lease_expires_at"], unique=False)

    op.create_table(
        "batch_inference_run_items",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("row_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("outputs", sa.Text(), nullable=True),
        sa.Column("usage_input", sa.Integer(), nullable=True),
        sa.Column("usage_output", sa.Integer(), nullable=True),
        sa.Column("charge", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("written", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["batch_inference_runs.id"]),
        sa.PrimaryKeyConstraint("run_id", "row_id"),
    )
    with op.batch_alter_table("batch_inference_run_items", schema=None) as batch_op:
        batch_op.create_index("ix_bir_items_state", ["run_id", "state", "row_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("batch_inference_run_items", schema=None) as batch_op:
        batch_op.drop_index("ix_bir_items_state")
    op.drop_table("batch_inference_run_items")
    with op.batch_alter_table("batch_inference_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_bir_status")
        batch_op.drop_index("ix_bir_project")
    op.drop_table("batch_inference_runs")
    with op.batch_alter_table("dataset_rows", schema=None) as batch_op:
        batch_op.drop_index("ix_dataset_rows_current")
    op.drop_table("dataset_rows")
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_index("ix_datasets_project")
    op.drop_table("datasets")
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_projects_org_id"))
    op.drop_table("projects")
