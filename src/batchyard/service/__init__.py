"""The service layer: one deployment's parts, and what the front doors share.

``Service`` holds the parts the composition root (``batchyard.app``) built;
``batches``, ``batch_requests`` and ``idempotency`` are the operations that
both the API and the workspace perform, kept below both so that neither door
imports the other.
"""

from batchyard.service.deployment import Service, service_of

__all__ = ["Service", "service_of"]
