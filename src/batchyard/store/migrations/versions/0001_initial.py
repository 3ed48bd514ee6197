"""The schema of batchyard 0.1.0, in one revision.

Nothing ran before 0.1.0, so its history was folded into this one revision:
every table, index and constraint the store declares (``store/tables.py`` and
each feature's module), on SQLite and PostgreSQL alike. Later changes add a
revision on top of this one.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batch_key_checks",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "decide_calibration",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("decision", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.Integer(), nullable=False),
        sa.Column("content_free", sa.Float(), nullable=False),
        sa.Column("texts", sa.BigInteger(), nullable=False),
        sa.Column("prob_sum", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "fingerprint", "decision", "outcome"),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "key"),
    )
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.create_index("ix_idem_expires", ["expires_at"], unique=False)

    op.create_table(
        "market_history",
        sa.Column("route", sa.String(length=200), nullable=False),
        sa.Column("slot", sa.BigInteger(), nullable=False),
        sa.Column("discount", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("route", "slot"),
    )
    op.create_table(
        "organisations",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("tier", sa.Integer(), nullable=False),
        sa.Column("zero_data_retention", sa.Boolean(), nullable=False),
        sa.Column("auto_topup_threshold", sa.BigInteger(), nullable=True),
        sa.Column("auto_topup_amount", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "rate_limits",
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("tat", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_table(
        "store_probes",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "workspace_signouts",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )
    op.create_table(
        "activity",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("ref", sa.String(length=200), nullable=True),
        sa.Column("reservation_id", sa.String(length=64), nullable=True),
        sa.Column("amount", sa.BigInteger(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("activity", schema=None) as batch_op:
        batch_op.create_index("ix_activity_org", ["org_id", "id"], unique=False)
        batch_op.create_index("ix_activity_reservation", ["reservation_id"], unique=False)

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("display", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_hash"),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_keys_org_id"), ["org_id"], unique=False)

    op.create_table(
        "balances",
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("topups", sa.BigInteger(), nullable=False),
        sa.Column("settled", sa.BigInteger(), nullable=False),
        sa.Column("held", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("org_id"),
    )
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
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.create_index("ix_batches_completed", ["completed_at"], unique=False)
        batch_op.create_index("ix_batches_org", ["org_id", "id"], unique=False)

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
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("file_batches", schema=None) as batch_op:
        batch_op.create_index("ix_file_batches_org", ["org_id", "id"], unique=False)
        batch_op.create_index("ix_file_batches_status", ["status", "expires_at"], unique=False)

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
        sa.Column("key_id", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index("ix_files_org", ["org_id", "id"], unique=False)
        batch_op.create_index("ix_files_status", ["status", "created_at"], unique=False)

    op.create_table(
        "ledger_entries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("reservation_id", sa.String(length=64), nullable=True),
        sa.Column("memo", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.create_index("ix_ledger_org", ["org_id", "id"], unique=False)
        batch_op.create_index("ix_ledger_reservation", ["reservation_id"], unique=False)

    op.create_table(
        "projects",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_projects_org_id"), ["org_id"], unique=False)

    op.create_table(
        "reservations",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("charged", sa.BigInteger(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("ref", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_reservations_org_id"), ["org_id"], unique=False)

    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("events", sa.Text(), nullable=False),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("webhook_endpoints", schema=None) as batch_op:
        batch_op.create_index("ix_webhook_endpoints_org", ["org_id", "id"], unique=False)

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
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_token", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("result_status", sa.Integer(), nullable=True),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_items_custom_id"),
    )
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.create_index("ix_batch_items_batch", ["batch_id", "position"], unique=False)
        batch_op.create_index("ix_batch_items_org", ["org_id", "status"], unique=False)
        batch_op.create_index("ix_batch_items_status", ["status", "deadline"], unique=False)

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
        sa.Column("ready", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.create_index("ix_datasets_project", ["project_id", "id"], unique=False)

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
        sa.Column("lease_token", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("route", sa.String(length=200), nullable=True),
        sa.Column("usage_input", sa.Integer(), nullable=True),
        sa.Column("usage_output", sa.Integer(), nullable=True),
        sa.Column("charge", sa.BigInteger(), nullable=True),
        sa.Column("out", sa.LargeBinary(), nullable=True),
        sa.Column("out_bytes", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["file_batches.id"],
        ),
        sa.PrimaryKeyConstraint("batch_id", "line"),
    )
    with op.batch_alter_table("file_batch_lines", schema=None) as batch_op:
        batch_op.create_index("ix_fbl_lease", ["state", "lease_expires_at"], unique=False)
        batch_op.create_index("ix_fbl_state", ["batch_id", "state", "line"], unique=False)

    op.create_table(
        "file_lines",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("line", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"],
            ["files.id"],
        ),
        sa.PrimaryKeyConstraint("file_id", "line"),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("project_id", sa.String(length=64), nullable=False),
        sa.Column("type", sa.String(length=16), nullable=False),
        sa.Column("base", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("file", sa.String(length=128), nullable=False),
        sa.Column("architecture", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.create_index(
            "ix_model_versions_project", ["org_id", "project_id", "created_at"], unique=False
        )

    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("endpoint_id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column("ref", sa.String(length=64), nullable=True),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_token", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["webhook_endpoints.id"],
        ),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_webhook_deliveries_due", ["status", "next_attempt_at"], unique=False
        )
        batch_op.create_index("ix_webhook_deliveries_endpoint", ["endpoint_id", "id"], unique=False)
        batch_op.create_index(
            "ix_webhook_deliveries_lease", ["status", "lease_expires_at"], unique=False
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
        sa.Column("cached_input_tokens", sa.BigInteger(), server_default="0", nullable=False),
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
        sa.Column("lease_token", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(
            ["dataset_id"],
            ["datasets.id"],
        ),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organisations.id"],
        ),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("batch_inference_runs", schema=None) as batch_op:
        batch_op.create_index("ix_bir_project", ["project_id", "id"], unique=False)
        batch_op.create_index("ix_bir_status", ["status", "lease_expires_at"], unique=False)

    op.create_table(
        "dataset_rows",
        sa.Column("dataset_id", sa.String(length=64), nullable=False),
        sa.Column("row_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("current", sa.Boolean(), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["dataset_id"],
            ["datasets.id"],
        ),
        sa.PrimaryKeyConstraint("dataset_id", "row_id", "version"),
    )
    with op.batch_alter_table("dataset_rows", schema=None) as batch_op:
        batch_op.create_index(
            "ix_dataset_rows_current", ["dataset_id", "current", "row_id"], unique=False
        )

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
        sa.Column("usage_cached", sa.Integer(), nullable=True),
        sa.Column("charge", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("written", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["batch_inference_runs.id"],
        ),
        sa.PrimaryKeyConstraint("run_id", "row_id"),
    )
    with op.batch_alter_table("batch_inference_run_items", schema=None) as batch_op:
        batch_op.create_index("ix_bir_items_state", ["run_id", "state", "row_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("batch_inference_run_items", schema=None) as batch_op:
        batch_op.drop_index("ix_bir_items_state")

    op.drop_table("batch_inference_run_items")
    with op.batch_alter_table("dataset_rows", schema=None) as batch_op:
        batch_op.drop_index("ix_dataset_rows_current")

    op.drop_table("dataset_rows")
    with op.batch_alter_table("batch_inference_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_bir_status")
        batch_op.drop_index("ix_bir_project")

    op.drop_table("batch_inference_runs")
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_webhook_deliveries_lease")
        batch_op.drop_index("ix_webhook_deliveries_endpoint")
        batch_op.drop_index("ix_webhook_deliveries_due")

    op.drop_table("webhook_deliveries")
    with op.batch_alter_table("model_versions", schema=None) as batch_op:
        batch_op.drop_index("ix_model_versions_project")

    op.drop_table("model_versions")
    op.drop_table("file_lines")
    with op.batch_alter_table("file_batch_lines", schema=None) as batch_op:
        batch_op.drop_index("ix_fbl_state")
        batch_op.drop_index("ix_fbl_lease")

    op.drop_table("file_batch_lines")
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_index("ix_datasets_project")

    op.drop_table("datasets")
    with op.batch_alter_table("batch_items", schema=None) as batch_op:
        batch_op.drop_index("ix_batch_items_status")
        batch_op.drop_index("ix_batch_items_org")
        batch_op.drop_index("ix_batch_items_batch")

    op.drop_table("batch_items")
    with op.batch_alter_table("webhook_endpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_webhook_endpoints_org")

    op.drop_table("webhook_endpoints")
    with op.batch_alter_table("reservations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_reservations_org_id"))

    op.drop_table("reservations")
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_projects_org_id"))

    op.drop_table("projects")
    with op.batch_alter_table("ledger_entries", schema=None) as batch_op:
        batch_op.drop_index("ix_ledger_reservation")
        batch_op.drop_index("ix_ledger_org")

    op.drop_table("ledger_entries")
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index("ix_files_status")
        batch_op.drop_index("ix_files_org")

    op.drop_table("files")
    with op.batch_alter_table("file_batches", schema=None) as batch_op:
        batch_op.drop_index("ix_file_batches_status")
        batch_op.drop_index("ix_file_batches_org")

    op.drop_table("file_batches")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_org")
        batch_op.drop_index("ix_batches_completed")

    op.drop_table("batches")
    op.drop_table("balances")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_org_id"))

    op.drop_table("api_keys")
    with op.batch_alter_table("activity", schema=None) as batch_op:
        batch_op.drop_index("ix_activity_reservation")
        batch_op.drop_index("ix_activity_org")

    op.drop_table("activity")
    op.drop_table("workspace_signouts")
    op.drop_table("store_probes")
    op.drop_table("rate_limits")
    op.drop_table("organisations")
    op.drop_table("market_history")
    with op.batch_alter_table("idempotency_keys", schema=None) as batch_op:
        batch_op.drop_index("ix_idem_expires")

    op.drop_table("idempotency_keys")
    op.drop_table("decide_calibration")
    op.drop_table("batch_key_checks")
