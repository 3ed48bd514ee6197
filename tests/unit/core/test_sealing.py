"""Sealing request bodies at rest: authenticated, bound to their row, keys kept private."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from batchyard.core.sealing import (
    KEY_BYTES,
    Sealer,
    SealError,
    ensure_key_file,
    generate_key,
    key_text,
    parse_key,
)


def test_seal_round_trips_and_hides_the_text():
    sealer = Sealer(generate_key())
    secret = b"Summarize this public release note."
    blob = sealer.seal(secret, b"bti.1")
    assert secret not in blob
    assert sealer.open(blob, b"bti.1") == secret
    # Fresh nonce each time: the same text never seals to the same bytes.
    assert sealer.seal(secret, b"bti.1") != blob


def test_a_blob_moved_to_another_row_does_not_open():
    sealer = Sealer(generate_key())
    blob = sealer.seal(b"text", b"bti.1")
    with pytest.raises(SealError):
        sealer.open(blob, b"bti.2")


def test_a_tampered_blob_or_another_key_does_not_open():
    key = generate_key()
    blob = bytearray(Sealer(key).seal(b"text"))
    blob[-1] ^= 1
    with pytest.raises(SealError):
        Sealer(key).open(bytes(blob))
    with pytest.raises(SealError):
        Sealer(generate_key()).open(Sealer(key).seal(b"text"))
    with pytest.raises(SealError):
        Sealer(key).open(b"\x02" + bytes(40))


def test_keys_parse_from_standard_and_urlsafe_base64():
    key = generate_key()
    assert parse_key(key_text(key)) == key
    assert parse_key(" " + key_text(key) + "\n") == key
    assert parse_key(base64.urlsafe_b64encode(key).decode().rstrip("=")) == key


@pytest.mark.parametrize(
    "text", ["", "not base64!!", base64.b64encode(b"short").decode(), key_text(bytes(33))]
)
def test_bad_keys_are_refused_with_a_reason(text):
    with pytest.raises(SealError):
        parse_key(text)
    with pytest.raises(SealError):
        Sealer(b"x" * (KEY_BYTES - 1))


def test_key_file_is_created_once_with_mode_0600(tmp_path):
    path = tmp_path / "home" / "batch.key"
    key, created = ensure_key_file(path)
    assert created and len(key) == KEY_BYTES
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again, created_again = ensure_key_file(path)
    assert (again, created_again) == (key, False)


def test_a_corrupt_key_file_is_an_error_not_a_new_key(tmp_path):
    path = tmp_path / "batch.key"
    path.write_text("garbage")
    with pytest.raises(SealError):
        ensure_key_file(path)
    assert path.read_text() == "garbage"
