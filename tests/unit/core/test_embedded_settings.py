"""The embedded engine's sizes: read from the file and the environment, checked at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchyard.core.config import load_settings


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "batchyard.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_and_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHYARD_CONFIG", raising=False)
    plain = load_settings(database_url="sqlite://")
    assert (plain.embedded_slots, plain.embedded_n_ctx, plain.embedded_threads) == (8, 2048, None)
    assert plain.embedded_prefill_tokens == 512 and plain.embedded_cache_tokens is None
    path = write(
        tmp_path,
        "embedded_slots: 4\nembedded_n_ctx: 1024\nembedded_threads: 2\n"
        "embedded_prefill_tokens: 256\nembedded_cache_tokens: 8192\n",
    )
    s = load_settings(config_file=path, database_url="sqlite://")
    assert (s.embedded_slots, s.embedded_contexts, s.embedded_n_ctx) == (4, 4, 1024)
    assert (s.embedded_threads, s.embedded_prefill_tokens, s.embedded_cache_tokens) == (
        2,
        256,
        8192,
    )


def test_the_old_name_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "embedded_contexts: 3\n")
    assert load_settings(config_file=path, database_url="sqlite://").embedded_slots == 3
    monkeypatch.setenv("BATCHYARD_EMBEDDED_SLOTS", "5")
    monkeypatch.setenv("BATCHYARD_EMBEDDED_N_CTX", "4096")
    s = load_settings(config_file=path, database_url="sqlite://")
    assert (s.embedded_slots, s.embedded_contexts, s.embedded_n_ctx) == (5, 5, 4096)


@pytest.mark.parametrize(
    "line", ["embedded_slots: 0", "embedded_n_ctx: lots", "embedded_threads: 1.5"]
)
def test_a_bad_value_is_one_line_naming_the_field(tmp_path: Path, line: str) -> None:
    path = write(tmp_path, line + "\n")
    field = line.split(":")[0]
    with pytest.raises(ValueError, match=f"field {field}: .* is not a whole number") as err:
        load_settings(config_file=path, database_url="sqlite://")
    assert "\n" not in str(err.value)
