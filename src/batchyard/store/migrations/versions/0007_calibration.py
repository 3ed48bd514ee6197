"""decide's calibration state: content-free priors and running batch sums per decision set"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
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


def downgrade() -> None:
    op.drop_table("decide_calibration")
