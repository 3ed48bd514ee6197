"""one cancel spelling: file batches say canceling/canceled, as every other state does

File batches kept OpenAI's spelling (``cancelling``/``cancelled``) in the store
while deferred batches, request and line states and Message Batches said
``canceling``/``canceled``. The store now has one word per state; the OpenAI
view writes OpenAI's spelling on the wire (``service.batch_views.openai_status``),
so nothing a client reads changes.
"""

from alembic import op

revision = "0015"
down_revision = "0013"
branch_labels = None
depends_on = None

_WORDS = (("cancelling", "canceling"), ("cancelled", "canceled"))


def upgrade() -> None:
    for old, new in _WORDS:
        op.execute(f"UPDATE file_batches SET status = '{new}' WHERE status = '{old}'")


def downgrade() -> None:
    for old, new in _WORDS:
        op.execute(f"UPDATE file_batches SET status = '{old}' WHERE status = '{new}'")
