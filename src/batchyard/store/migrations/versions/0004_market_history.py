"""the market history the deadline-aware policy learns from"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "market_history",
        sa.Column("market", sa.String(length=400), nullable=False),
        sa.Column("bin", sa.BigInteger(), nullable=False),
        sa.Column("best", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("market", "bin"),
    )


def downgrade() -> None:
    op.drop_table("market_history")
