"""Request bodies sealed at rest: AES-256-GCM with the deployment's batch key.

A deferred request can sit in the store for a day, in backups and in WAL
files; the text must not be readable there. AES-GCM authenticates as well as
hides, so a blob that was tampered with, or moved to another row, fails to
open instead of decrypting to something else: callers pass the row's ID as
associated data.

Blob layout: one version byte, a 12-byte random nonce, then ciphertext+tag.
The version byte leaves room for key rotation without guessing formats.

The key is 32 random bytes, written as base64 text in configuration
(``BATCHYARD_BATCH_ENCRYPTION_KEY``) or in a key file. ``ensure_key_file``
creates that file with mode 0600 atomically (``O_EXCL``), so two processes
starting at once cannot each write their own key and lock the other out of
its data.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "KEY_BYTES",
    "SealError",
    "Sealer",
    "ensure_key_file",
    "generate_key",
    "key_fingerprint",
    "key_text",
    "parse_key",
]

KEY_BYTES = 32
_VERSION = b"\x01"
_NONCE_BYTES = 12


class SealError(ValueError):
    """A key that cannot be used, or a blob that cannot be opened with it."""


def generate_key() -> bytes:
    return AESGCM.generate_key(bit_length=KEY_BYTES * 8)


def key_fingerprint(key: bytes) -> str:
    """A name for a key that does not reveal it: an HMAC of a constant under the key.

    The store keeps it (``store.key_check``) so a process started with another
    key is refused before it reads anything; messages show its first 12 digits.
    """
    return hmac.new(key, b"batchyard batch key fingerprint v1", hashlib.sha256).hexdigest()


def key_text(key: bytes) -> str:
    """The key as configuration holds it: standard base64."""
    return base64.b64encode(key).decode("ascii")


def parse_key(text: str) -> bytes:
    """A 32-byte key from base64 text (standard or URL-safe, padding optional)."""
    cleaned = "".join(text.split())
    if not cleaned:
        raise SealError("the batch encryption key is empty")
    padded = cleaned + "=" * (-len(cleaned) % 4)
    try:
        if "-" in padded or "_" in padded:
            key = base64.urlsafe_b64decode(padded)
        else:
            key = base64.b64decode(padded, validate=True)
    except (binascii.Error, ValueError):
        raise SealError("the batch encryption key is not valid base64") from None
    if len(key) != KEY_BYTES:
        raise SealError(
            f"the batch encryption key must decode to {KEY_BYTES} bytes, not {len(key)}; "
            "make one with `openssl rand -base64 32`"
        )
    return key


def ensure_key_file(path: str | os.PathLike[str]) -> tuple[bytes, bool]:
    """The key in ``path``, creating it (mode 0600) when absent: (key, created)."""
    target = Path(path)
    try:
        return parse_key(target.read_text(encoding="ascii")), False
    except FileNotFoundError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = generate_key()
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        # Another process won the race; its key is the one to use.
        return parse_key(target.read_text(encoding="ascii")), False
    try:
        os.write(fd, (key_text(key) + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.chmod(target, 0o600)  # umask cannot widen it, but be explicit
    return key, True


class Sealer:
    """Seals and opens blobs with one key; ``aad`` binds a blob to its row."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise SealError(f"a sealing key is {KEY_BYTES} bytes")
        self._aead = AESGCM(key)
        self.fingerprint = key_fingerprint(key)

    def seal(self, data: bytes, aad: bytes = b"") -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        return _VERSION + nonce + self._aead.encrypt(nonce, data, aad or None)

    def open(self, blob: bytes, aad: bytes = b"") -> bytes:
        if len(blob) < 1 + _NONCE_BYTES + 16 or blob[:1] != _VERSION:
            raise SealError("not a sealed blob of a known version")
        nonce = blob[1 : 1 + _NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, blob[1 + _NONCE_BYTES :], aad or None)
        except InvalidTag:
            raise SealError(
                "the sealed blob does not open with this key (wrong key, or altered)"
            ) from None
