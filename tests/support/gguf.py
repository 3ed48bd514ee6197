"""Small GGUF files written by hand: real headers, for the upload checks to refuse or pass.

``gguf_bytes`` writes the format's version 3 as the spec lays it out (header,
metadata, tensor table, aligned data), so a test can make exactly the file it
needs: a LoRA for another architecture, a pair of the wrong shape, a tensor
that declares more data than the file holds.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["F32", "I32", "Tensor", "gguf_bytes", "lora_for"]

F32 = 0
I32 = 26
ALIGN = 32

Tensor = tuple[str, Sequence[int], int]  # name, shape (ne order), ggml type


def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(v: Any) -> bytes:
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<Iq", 11, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _str(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_str(x) for x in v)
        return struct.pack("<IIQ", 9, 5, len(v)) + b"".join(struct.pack("<i", x) for x in v)
    raise TypeError(v)


def gguf_bytes(
    metadata: Mapping[str, Any],
    tensors: Sequence[Tensor],
    *,
    declared_bytes: Mapping[str, int] | None = None,
    offsets: Mapping[str, int] | None = None,
) -> bytes:
    """A GGUF v3 file; ``declared_bytes`` writes less data than a tensor's shape says,
    ``offsets`` puts a tensor's data where it says (not after the tensor before it)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, value in metadata.items():
        head += _str(key) + _value(value)
    offset = 0
    sizes = []
    for name, shape, kind in tensors:
        n = 1
        for d in shape:
            n *= d
        size = n * {F32: 4, I32: 4}.get(kind, 2)
        head += _str(name) + struct.pack("<I", len(shape))
        head += b"".join(struct.pack("<Q", d) for d in shape)
        head += struct.pack("<IQ", kind, (offsets or {}).get(name, offset))
        written = (declared_bytes or {}).get(name, size)
        sizes.append(written)
        offset += -(-written // ALIGN) * ALIGN
    head += b"\0" * (-len(head) % ALIGN)
    data = b"".join(b"\0" * (-(-s // ALIGN) * ALIGN) for s in sizes)
    return head + data


def lora_for(
    architecture: str,
    pairs: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    *,
    extra: Mapping[str, Any] | None = None,
    **options: Any,
) -> bytes:
    """A LoRA adapter file: ``pairs`` maps a base tensor to (lora_a shape, lora_b shape);
    ``extra`` adds or replaces metadata, ``options`` go to ``gguf_bytes``."""
    tensors: list[Tensor] = []
    for target, (a, b) in pairs.items():
        tensors += [(f"{target}.lora_a", a, F32), (f"{target}.lora_b", b, F32)]
    meta = {
        "general.architecture": architecture,
        "general.type": "adapter",
        "adapter.type": "lora",
        "adapter.lora.alpha": 16.0,
        **(extra or {}),
    }
    return gguf_bytes(meta, tensors, **options)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
