"""A multipart upload read as it arrives: the file part to disk, the few fields to memory.

``POST /v1/files`` (the OpenAI SDK's ``files.create``) and the workspace's
upload form both send ``multipart/form-data``. The body is fed chunk by chunk
to a streaming parser; the file part goes straight to a temporary file on
disk and is counted as it goes, so an upload over the limit is refused as
soon as it crosses it, never held whole, and never written past it. Other
fields are small (a kilobyte at most) and must be ones the caller expects.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from batchyard.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType

__all__ = ["Upload", "read_multipart"]

FIELD_LIMIT = 1024


@dataclass
class Upload:
    """What a multipart body held: its small fields and the file part (on disk)."""

    fields: dict[str, str] = field(default_factory=dict)
    file: IO[bytes] | None = None
    filename: str = ""
    size: int = 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class _Reader:
    def __init__(
        self,
        file_field: str,
        allowed: set[str],
        max_file_bytes: int,
        spool: Callable[[], IO[bytes]] = tempfile.TemporaryFile,
    ) -> None:
        self.spool = spool
        self.file_field = file_field
        self.allowed = allowed
        self.max_file_bytes = max_file_bytes
        self.upload = Upload()
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._name = ""
        self._buffer = bytearray()
        self._to_file = False

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: self._header_name.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _part_begin(self) -> None:
        self._headers = {}
        self._buffer = bytearray()
        self._to_file = False

    def _header_end(self) -> None:
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == self.file_field:
            if self.upload.file is not None:
                raise InvalidRequest(
                    f"send one {self.file_field} part", param=self.file_field, code="invalid_upload"
                )
            self.upload.file = self.spool()
            self.upload.filename = params.get(b"filename", b"").decode("utf-8", "replace")
            self._to_file = True
        elif self._name not in self.allowed:
            raise InvalidRequest(
                f"{self._name or 'a part without a name'} is not a field of this upload",
                param=self._name or None,
                code="unsupported_parameter",
            )

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._to_file:
            assert self.upload.file is not None
            self.upload.size += len(chunk)
            if self.upload.size > self.max_file_bytes:
                raise PayloadTooLarge(
                    f"the file is over {self.max_file_bytes} bytes",
                    param=self.file_field,
                    code="file_too_large",
                )
            self.upload.file.write(chunk)
            return
        self._buffer.extend(chunk)
        if len(self._buffer) > FIELD_LIMIT:
            raise InvalidRequest(f"{self._name} is too long", param=self._name)

    def _part_end(self) -> None:
        if not self._to_file:
            try:
                self.upload.fields[self._name] = self._buffer.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequest(f"{self._name} is not UTF-8 text", param=self._name) from None


async def read_multipart(
    chunks: AsyncIterator[bytes],
    content_type: str | None,
    *,
    file_field: str,
    fields: Iterable[str],
    max_file_bytes: int,
    spool: Callable[[], IO[bytes]] = tempfile.TemporaryFile,
) -> Upload:
    """Read a ``multipart/form-data`` body; the caller closes the returned ``Upload``.

    ``spool`` makes the file part's temporary file (a named one, where the
    caller keeps the file by renaming it); on an error it is closed, and the
    caller removes a named one.
    """
    kind, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise UnsupportedMediaType("send the upload as multipart/form-data", param="Content-Type")
    reader = _Reader(file_field, set(fields), max_file_bytes, spool)
    parser = MultipartParser(boundary, reader.callbacks())  # type: ignore[arg-type]
    try:
        async for chunk in chunks:
            parser.write(chunk)
        parser.finalize()
    except MultipartParseError as exc:
        reader.upload.close()
        raise InvalidRequest(
            f"the multipart body could not be read ({exc})", code="invalid_upload"
        ) from None
    except BaseException:
        reader.upload.close()
        raise
    if reader.upload.file is not None:
        reader.upload.file.seek(0)
    return reader.upload
