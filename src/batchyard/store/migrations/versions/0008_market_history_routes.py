"""the market history per route and 15-second slot, not per market and 2-minute bin"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The old rows hold the deepest discount over a market's routes per 2-minute bin,
    # which cannot be split back into routes. They only ever sharpened a policy, so they
    # go: a worker upgraded from them learns the market again (see docs/how-to/operate.md).
    op.drop_table("market_history")
    op.create_table(
        "market_history",
        sa.Column("route", sa.String(length=200), nullable=False),
        sa.Column("slot", sa.BigInteger(), nullable=False),
        sa.Column("discount", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("route", "slot"),
    )


def downgrade() -> None:
    op.drop_table("market_history")
    op.create_table(
        "market_history",
        sa.Column("market", sa.String(length=400), nullable=False),
        sa.Column("bin", sa.BigInteger(), nullable=False),
        sa.Column("best", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("market", "bin"),
    )
