"""what a file batch's line would have cost at the direct price

A line of a batch that waited for a price (a window longer than 24 h) is
charged its route's offered price; ``direct_charge`` is what its usage would
have cost at the model's direct price, the one the batch's quote held at, so
the batch object can say what waiting saved. Lines that ended before this
revision have none (they count as saving nothing).
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("file_batch_lines", sa.Column("direct_charge", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("file_batch_lines", "direct_charge")
