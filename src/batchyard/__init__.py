"""batchyard: a self-hostable batch inference gateway for large language models.

The top-level package is the client's: ``Client`` and ``AsyncClient`` talk to a
batchyard server over HTTP and need none of the server's dependencies. The
error classes are shared with the server, so a caught exception's ``code`` is
the wire code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchyard.errors import (
    BatchyardError,
    Conflict,
    IdempotencyConflict,
    IdempotencyResponseExpired,
    InsufficientCredit,
    InvalidRequest,
    NotFound,
    RateLimited,
    Unauthorized,
)

if TYPE_CHECKING:
    from batchyard.client import AsyncClient, Client

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "BatchyardError",
    "Client",
    "Conflict",
    "IdempotencyConflict",
    "IdempotencyResponseExpired",
    "InsufficientCredit",
    "InvalidRequest",
    "NotFound",
    "RateLimited",
    "Unauthorized",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Imported on first use so `import batchyard` stays cheap for the server.
    if name in ("Client", "AsyncClient"):
        from batchyard import client

        return getattr(client, name)
    raise AttributeError(f"module 'batchyard' has no attribute {name!r}")
