"""Structured logs: one JSON object a line, with the ``extra=`` fields kept.

Keys and request text never reach a log: handlers log codes, ids and counts,
and this formatter drops any field whose name suggests a secret or content.

Every record logged while the API serves a request carries that request's
``request_id``, the id its answer sent back as ``x-request-id``, so a user who
quotes the id points at every line the request wrote.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

__all__ = ["JsonFormatter", "request_id", "setup_logging"]

#: The id of the API request being served in this context (``None`` outside one).
request_id: ContextVar[str | None] = ContextVar("batchyard_request_id", default=None)

_base_factory = logging.getLogRecordFactory()


def _stamped_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
    """Every record made while a request is served carries its id.

    Stamped when the record is made, in the request's own context, not when it
    is formatted: a handler may format later, elsewhere.
    """
    record = _base_factory(*args, **kwargs)
    rid = request_id.get()
    if rid is not None and not hasattr(record, "request_id"):
        record.request_id = rid
    return record


if getattr(logging.getLogRecordFactory(), "__name__", "") != "_stamped_record":
    logging.setLogRecordFactory(_stamped_record)

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_FORBIDDEN = ("key", "secret", "token", "password", "authorization", "content", "text", "messages")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name in _STANDARD or name.startswith("_"):
                continue
            lowered = name.lower()
            if any(f in lowered for f in _FORBIDDEN) and not lowered.endswith(
                ("_id", "_count", "_tokens")
            ):
                continue
            out[name] = (
                value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
            )
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


#: Libraries whose warnings only restate an error batchyard answers itself with a
#: code: python-multipart logs "Found invalid character 13 in header" just before
#: it raises the parse error that becomes ``400 invalid_upload``.
_QUIET = ("python_multipart",)


def setup_logging(level: str = "INFO") -> None:
    """Every line on stderr one JSON object: batchyard's own, and the libraries' too.

    batchyard's loggers write at ``level``; any other library's warnings reach the
    root logger, which gets the same formatter, so no plain-text line (uvicorn's,
    a parser's) breaks a log that promises one JSON object a line.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    ours = logging.getLogger("batchyard")
    ours.handlers[:] = [handler]
    ours.setLevel(level)
    ours.propagate = False
    root = logging.getLogger()
    kept = [h for h in root.handlers if not isinstance(h.formatter, JsonFormatter)]
    root.handlers[:] = [*kept, handler]
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
