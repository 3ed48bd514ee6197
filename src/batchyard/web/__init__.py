"""The Batches workspace: server-rendered pages for deferred batches (docs/reference/batches.md).

A front door like ``api``: it submits, shows, cancels and downloads batches
through the API module's own functions, for people who would rather paste
JSON into a page than call ``/v1/batches`` with curl.
"""

from __future__ import annotations

from batchyard.web.routes import router

__all__ = ["router"]
