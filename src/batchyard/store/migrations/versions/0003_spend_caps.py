"""spend caps: a total and a monthly cap on an API key or a project, checked at every hold

``spend_caps`` holds one row per capped key or project with its running
sums, and each reservation names the key and project it is spent by.
Reservations made before this revision name neither: a cap set later counts
only what is held and charged from now on.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "spend_caps",
        sa.Column("holder", sa.String(80), primary_key=True),
        sa.Column("org_id", sa.String(64), sa.ForeignKey("organisations.id"), nullable=False),
        sa.Column("total_cap", sa.BigInteger(), nullable=True),
        sa.Column("monthly_cap", sa.BigInteger(), nullable=True),
        sa.Column("total_held", sa.BigInteger(), nullable=False),
        sa.Column("total_settled", sa.BigInteger(), nullable=False),
        sa.Column("month", sa.String(7), nullable=False),
        sa.Column("month_held", sa.BigInteger(), nullable=False),
        sa.Column("month_settled", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_spend_caps_org_id", "spend_caps", ["org_id"])
    # Plain ALTER TABLE on both backends (a batch copy would drop tables that other rows reference).
    op.add_column("reservations", sa.Column("key_id", sa.String(64), nullable=True))
    op.add_column("reservations", sa.Column("project_id", sa.String(64), nullable=True))
    op.create_index("ix_reservations_key", "reservations", ["key_id", "created_at"])
    op.create_index("ix_reservations_project", "reservations", ["project_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_reservations_project", table_name="reservations")
    op.drop_index("ix_reservations_key", table_name="reservations")
    op.drop_column("reservations", "project_id")
    op.drop_column("reservations", "key_id")
    op.drop_index("ix_spend_caps_org_id", table_name="spend_caps")
    op.drop_table("spend_caps")
