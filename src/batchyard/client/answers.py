"""The answers file of a run, its meta sidecar and its errors file.

The answers file is append-only JSONL, one line per answer as it arrives,
flushed at once and fsynced every few lines, so a crash loses at most the
requests in flight, which a rerun sends again under the same keys and gets
back from the server's saved responses. Reading keeps the last line per id,
which is how a resent fallback answer replaces the first one.

The sidecar ``<output>.meta.json`` names the decision set and model the file
answers; a rerun with other decisions stops before sending anything rather
than mixing two question sets in one file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from batchyard.client.inputs import InputError

__all__ = ["AnswerFile"]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Lines of a JSONL file; a torn last line (a crash mid-write) is ignored."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):
                break
            raise InputError(f"{path}:{n} is not valid JSON; fix or move the file") from exc
        if isinstance(row, dict) and "id" in row:
            out.append(row)
    return out


def _cut_torn_tail(path: Path) -> None:
    """Drop bytes after the last newline, so new lines never glue onto a torn one."""
    if not path.exists():
        return
    with path.open("rb+") as fh:
        data = fh.read()
        if data and not data.endswith(b"\n"):
            fh.truncate(data.rfind(b"\n") + 1)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


class AnswerFile:
    """One run's output: answers, failures and what they answer."""

    def __init__(self, path: str | Path, *, fsync_every: int = 20) -> None:
        self.path = Path(path)
        self.meta_path = self.path.with_name(self.path.name + ".meta.json")
        self.errors_path = self.path.with_suffix(".errors.jsonl")
        self._fsync_every = max(1, fsync_every)
        self._unsynced = 0
        self._answers_fh: IO[str] | None = None
        self._errors_fh: IO[str] | None = None

    # reading -----------------------------------------------------------------

    def check_meta(self, meta: dict[str, Any]) -> None:
        """Stop when the file answers another decision set or model."""
        if self.meta_path.exists():
            try:
                saved = json.loads(self.meta_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise InputError(f"cannot read {self.meta_path}: {exc}") from exc
            for field, what in (("decision_set_hash", "decision set"), ("model", "model")):
                if saved.get(field) != meta[field]:
                    raise InputError(
                        f"{self.path} holds answers for a different {what} "
                        f"({field} {saved.get(field)!r}, now {meta[field]!r}); "
                        "write to another --output file"
                    )
        elif self.read_answers():
            raise InputError(
                f"{self.path} already holds answers but has no {self.meta_path.name}, "
                "so which decisions it answers is unknown; write to another --output file"
            )

    def read_answers(self) -> dict[str, dict[str, Any]]:
        """The answer per id; the last line for an id wins."""
        return {str(row["id"]): row for row in _read_jsonl(self.path)}

    def read_errors(self, answered: Collection[str] | None = None) -> dict[str, dict[str, Any]]:
        """The latest failure per id not answered since (pass ``answered`` if already read)."""
        if answered is None:
            answered = self.read_answers().keys()
        return {
            str(row["id"]): row
            for row in _read_jsonl(self.errors_path)
            if str(row["id"]) not in answered
        }

    # writing -----------------------------------------------------------------

    def open(self, meta: dict[str, Any]) -> AnswerFile:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.meta_path.exists():
            _write_atomic(self.meta_path, json.dumps(meta, indent=2) + "\n")
        _cut_torn_tail(self.path)
        _cut_torn_tail(self.errors_path)
        self._answers_fh = self.path.open("a", encoding="utf-8")
        # The errors file is opened at the first failure: it exists only while something failed.
        return self

    def __enter__(self) -> AnswerFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _append(self, fh: IO[str] | None, row: dict[str, Any]) -> None:
        if fh is None:
            raise RuntimeError("open the answer file first")
        fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        fh.flush()
        self._unsynced += 1
        if self._unsynced >= self._fsync_every:
            self.sync()

    def write_answer(self, row: dict[str, Any]) -> None:
        self._append(self._answers_fh, row)

    def write_error(self, row: dict[str, Any]) -> None:
        if self._errors_fh is None:
            if self._answers_fh is None:
                raise RuntimeError("open the answer file first")
            self._errors_fh = self.errors_path.open("a", encoding="utf-8")
        self._append(self._errors_fh, row)

    def sync(self) -> None:
        for fh in (self._answers_fh, self._errors_fh):
            if fh is not None:
                fh.flush()
                os.fsync(fh.fileno())
        self._unsynced = 0

    def close(self) -> None:
        """Sync, then rewrite the errors file without the ids answered since."""
        if self._answers_fh is None:
            return
        self.sync()
        for fh in (self._answers_fh, self._errors_fh):
            if fh is not None:
                fh.close()
        self._answers_fh = self._errors_fh = None
        pending = self.read_errors()
        if pending:
            _write_atomic(
                self.errors_path,
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pending.values()),
            )
        else:
            self.errors_path.unlink(missing_ok=True)
