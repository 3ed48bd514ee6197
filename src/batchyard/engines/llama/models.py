"""What the embedded engine loads: models, versions, their files, and the helpers around them.

A model is a GGUF's weights (a small ``Llama``: vocabulary, template) and the
step thread that serves its requests; a version is a LoRA adapter on the base
model or a GGUF of its own (``VersionSpec``), loaded on first use.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from batchyard.engines.llama.context import Adapter
from batchyard.engines.llama.steps import StepThread
from batchyard.engines.model_files import sha256_of
from batchyard.engines.tokenizers import ChatTemplate
from batchyard.errors import ModelUnavailable

__all__ = [
    "FA_TILE_ROWS",
    "Model",
    "VersionGate",
    "VersionSpec",
    "VersionState",
    "check_file",
    "embedding_packs",
    "kv_bytes",
    "open_models",
    "route_llama_logs",
]

log = logging.getLogger("batchyard.engines.llama_cpp")

_T = TypeVar("_T")

#: Entries ``Model.remember`` keeps: a few decision sets' candidates and their pieces.
KEPT = 256


@functools.cache
def route_llama_logs() -> Any:
    """Send llama.cpp's log lines to ``batchyard.engines.llama``, errors only above debug.

    llama-cpp-python's own callback maps ggml's levels by an older enum (ggml now
    counts 1 debug, 2 info, 3 warn, 4 error), so its quiet mode printed warnings raw
    to stderr (the shared cache's ``n_ctx_seq > n_ctx_train``, which does not apply
    to a cache of many sequences) and hid errors. Installed once, after the first
    ``Llama`` set llama-cpp-python's own; the cache keeps the C callback alive.
    """
    import ctypes

    import llama_cpp

    llama_log = logging.getLogger("batchyard.engines.llama")
    last = [logging.DEBUG]  # a continuation line (5) keeps the level of the line before

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level != 5:
            last[0] = logging.ERROR if level == 4 else logging.DEBUG
        if llama_log.isEnabledFor(last[0]):
            llama_log.log(last[0], "llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


#: Flash attention's CPU kernel tiles a micro-batch of this many query rows or more
#: (``GGML_FA_TILE_Q``) and reads fewer row by row; the two round differently.
FA_TILE_ROWS = 64


def embedding_packs(counts: list[int]) -> list[list[int]]:
    """The inputs (by index, in order) read together in one decode each: under 64 rows.

    Short inputs read alone leave most of a decode's matrix work idle, so
    consecutive inputs share a decode while their tokens stay under
    ``FA_TILE_ROWS``. Under it every row takes the row-by-row attention kernel over
    its own sequence's cells, in order, exactly as when read alone, so a text's
    vector does not depend on what it was sent with; at 64 rows or more the tiled
    kernel rounds otherwise (docs/explanation/batch-invariance.md), so a longer
    input is read alone.
    """
    packs: list[list[int]] = []
    rows = FA_TILE_ROWS
    for i, n in enumerate(counts):
        if rows + n < FA_TILE_ROWS:
            packs[-1].append(i)
            rows += n
        else:
            packs.append([i])
            rows = n
    return packs


@dataclass(frozen=True, slots=True)
class VersionSpec:
    """A fine-tuned version: a LoRA adapter on the base GGUF, or a GGUF of its own.

    ``sha256``, when given, is the file's digest as accepted: it is checked on
    the loading thread, just before llama.cpp reads the file, so a file changed
    at rest is refused (``model_version_corrupt``) and the check never blocks
    the event loop.
    """

    kind: Literal["lora", "gguf"]
    path: Path
    sha256: str | None = None


#: Asked before each use of a version: whether it is still served (a project
#: version deleted through another process is not). Wired by the composition root.
VersionGate = Callable[[str], Awaitable[bool]]


class Model:
    """One loaded model: its weights (a small ``Llama``), its template, its step thread."""

    def __init__(self, llama: Any, steps: StepThread, version: str | None = None) -> None:
        self.llama = llama
        self.steps = steps
        self.version = version
        self.template = ChatTemplate.from_llama(llama)
        self.n_vocab: int = llama.n_vocab()
        end = llama.token_eos()
        if self.template is not None:
            suffix = self.template.reply_suffix()
            if suffix:
                tokens = llama.tokenize(suffix.encode("utf-8"), add_bos=False, special=True)
                end = tokens[0] if tokens else end
        # The token that closes an assistant turn, for scoring a candidate as
        # the complete reply (see ``LlamaCppEngine.score_turn_end``).
        self.turn_end: int = end
        self._kept: dict[Hashable, Any] = {}

    def remember(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """What ``make`` gives for ``key``, made once and kept (per-request work that
        depends only on the model and a few strings, such as a decision set's
        candidates' tokens). At most ``KEPT`` entries; all go when it is full."""
        if key in self._kept:
            return cast(_T, self._kept[key])
        if len(self._kept) >= KEPT:
            self._kept.clear()
        value = self._kept[key] = make()
        return value

    def recall(self, key: Hashable) -> Any:
        """What ``remember`` kept for ``key`` (None: nothing)."""
        return self._kept.get(key)

    def prompt_text(self, messages: list[dict[str, Any]]) -> str:
        if self.template is not None:
            return self.template.prompt(messages)
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(parts) + "<|im_start|>assistant\n"

    def close(self) -> None:
        self.steps.close()
        self.llama.close()


# Models still open at exit: Llama's finaliser fails if it runs after
# llama_cpp's module teardown, so they are closed first.
open_models: weakref.WeakSet[Model] = weakref.WeakSet()


@atexit.register
def _close_open_models() -> None:
    for model in list(open_models):
        model.close()


class VersionState:
    """One model or version: how to load it, what is loaded, and how it is used.

    The base and a full-weights version load a ``Model`` (weights, context,
    step thread); a LoRA version loads only an ``Adapter`` on the base model,
    whose step thread serves its requests beside the base's.
    """

    def __init__(self, version: str | None, spec: VersionSpec | None) -> None:
        self.version = version
        self.spec = spec
        self.model: Model | None = None
        self.adapter: Adapter | None = None
        self.lock = asyncio.Lock()
        self.load_seconds: float | None = None
        # Requests running on it now, when the last one ended, and any keep-warm pin
        # (all on the engine's clock): what idle eviction and the memory budget read.
        self.active = 0
        self.last_used = 0.0
        self.keep_until = 0.0

    @property
    def lora(self) -> bool:
        return self.spec is not None and self.spec.kind == "lora"

    @property
    def loaded(self) -> bool:
        return self.model is not None or self.adapter is not None


def check_file(version: str, spec: VersionSpec) -> None:
    """The version's file is the one accepted (on the loading thread, before llama.cpp)."""
    try:
        intact = spec.path.is_file() and (
            spec.sha256 is None or sha256_of(spec.path) == spec.sha256
        )
    except OSError:
        intact = False
    if not intact:
        log.warning(
            "model version file missing or changed at rest",
            extra={"event": "model_version_corrupt", "id": version},
        )
        raise ModelUnavailable(
            f"model version {version}'s file is missing or was changed since it was "
            "uploaded; upload it again",
            param="model",
            code="model_version_corrupt",
        )


def kv_bytes(llama: Any, cells: int) -> int:
    """The bytes of a KV cache of ``cells`` cells (f16 keys and values) for ``llama``'s model."""
    import llama_cpp

    model = llama._model.model
    n_layer = llama_cpp.llama_model_n_layer(model)
    n_head = max(1, llama_cpp.llama_model_n_head(model))
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    n_embd = llama_cpp.llama_model_n_embd(model)
    return int(cells * n_layer * 2 * n_head_kv * (n_embd // n_head) * 2)
