"""The service layer: one deployment's parts, and what the front doors share.

Kept below both doors, so that neither imports the other.
"""

from batchyard.service.deployment import Service, service_of

__all__ = ["Service", "service_of"]
