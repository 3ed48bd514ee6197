"""GGUF headers read strictly: what a file says it is, before llama.cpp is let near it.

An uploaded model version is a stranger's file. llama.cpp trusts a GGUF's
header (its counts, lengths, shapes and offsets), so a hostile one can make it
allocate without bound or read past the end. This reader checks every number
against the file's real size and fixed limits as it goes, and stops at the
first one that does not hold, with a coded ``invalid_model_file``; only a file
whose header and tensor table are consistent with its bytes is handed on.

Tensors must lie one after another in the data section, each at the end of
the last (padded to the alignment), as ggml's own reader requires.

``check_lora`` then applies llama.cpp's own adapter rules
(``llama_adapter_lora_init``): ``general.type`` adapter, ``adapter.type``
lora, the base's architecture, ``adapter.lora.alpha`` a 32-bit float when
given (llama.cpp asserts its type: any other would abort the process that
loads it), and for each ``<t>.lora_a``/``<t>.lora_b`` pair a base tensor
``<t>`` with ``a.ne[0] == t.ne[0]``, ``b.ne[1] == t.ne[1]`` and
``a.ne[1] == b.ne[0]`` (for ``token_embd.weight``, whose pair llama.cpp reads
the other way round, ``b.ne[1] == t.ne[0]`` and ``a.ne[1] == t.ne[1]``), so an
adapter that passes loads. Two rules llama.cpp checks only when it computes,
by aborting the process, are checked here too: a LoRA's tensors must be of a
type its matrix products take (F32, F16, BF16 or Q8_0, what
``convert_lora_to_gguf.py`` writes), and ``token_embd.weight`` may not be
adapted on a base whose output layer is that same tensor (no
``output.weight``: tied embeddings), since the output's product then reads
the embedding's pair the wrong way round. An activated LoRA
(``adapter.alora.*``), which llama.cpp applies only after its invocation
tokens, is refused: the engine applies an adapter to whole sequences.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from batchyard.errors import InvalidRequest

__all__ = ["GgufHeader", "TensorInfo", "check_lora", "read_header"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_KEY = 256
MAX_STRING = 16 * 1024 * 1024
MAX_ARRAY = 4 * 1024 * 1024
MAX_KV = 4096
MAX_TENSORS = 65536
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

# ggml type -> (bytes per block, elements per block), ggml.c's type traits.
GGML_TYPES: dict[int, tuple[int, int]] = {
    0: (4, 1),  # F32
    1: (2, 1),  # F16
    2: (18, 32),  # Q4_0
    3: (20, 32),  # Q4_1
    6: (22, 32),  # Q5_0
    7: (24, 32),  # Q5_1
    8: (34, 32),  # Q8_0
    9: (36, 32),  # Q8_1
    10: (84, 256),  # Q2_K
    11: (110, 256),  # Q3_K
    12: (144, 256),  # Q4_K
    13: (176, 256),  # Q5_K
    14: (210, 256),  # Q6_K
    15: (292, 256),  # Q8_K
    16: (66, 256),  # IQ2_XXS
    17: (74, 256),  # IQ2_XS
    18: (98, 256),  # IQ3_XXS
    19: (50, 256),  # IQ1_S
    20: (18, 32),  # IQ4_NL
    21: (110, 256),  # IQ3_S
    22: (82, 256),  # IQ2_S
    23: (136, 256),  # IQ4_XS
    24: (1, 1),  # I8
    25: (2, 1),  # I16
    26: (4, 1),  # I32
    27: (8, 1),  # I64
    28: (8, 1),  # F64
    29: (56, 256),  # IQ1_M
    30: (2, 1),  # BF16
}

# GGUF value types: fixed-size scalars by struct format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOAT32 = 6
#: The ggml types of a LoRA's tensors: F32, F16, Q8_0, BF16 (convert_lora_to_gguf's).
LORA_TYPES = {0: "F32", 1: "F16", 8: "Q8_0", 30: "BF16"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    #: ggml's order: ne[0] first (the row length).
    shape: tuple[int, ...]
    type: int
    offset: int
    nbytes: int


@dataclass
class GgufHeader:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_start: int = 0
    #: Each metadata key's GGUF value type (llama.cpp asserts some of them).
    kinds: dict[str, int] = field(default_factory=dict)

    def string(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None

    @property
    def architecture(self) -> str | None:
        return self.string("general.architecture")


def _bad(message: str, code: str = "invalid_model_file") -> InvalidRequest:
    return InvalidRequest(message, param="file", code=code)


class _Reader:
    def __init__(self, f: IO[bytes], size: int) -> None:
        self.f = f
        self.size = size
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise _bad("the GGUF file is truncated: its header runs past the end of the file")
        data = self.f.read(n)
        if len(data) != n:
            raise _bad("the GGUF file is truncated: its header runs past the end of the file")
        self.pos += n
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, limit: int = MAX_STRING) -> str:
        n = self.unpack("<Q")
        if n > limit:
            raise _bad(f"the GGUF file declares a {n}-byte string, over the {limit} allowed")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise _bad("the GGUF file holds a string that is not UTF-8") from None

    def value(self, kind: int, depth: int = 0) -> Any:
        fmt = _SCALARS.get(kind)
        if fmt is not None:
            return self.unpack(fmt)
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth == 0:
            item = self.unpack("<I")
            count = self.unpack("<Q")
            if count > MAX_ARRAY:
                raise _bad(f"the GGUF file declares an array of {count} values, over {MAX_ARRAY}")
            if item in _SCALARS:
                # Each value takes at least its own size: a count the file cannot hold
                # is refused before it is read.
                width = struct.calcsize(_SCALARS[item])
                if self.pos + count * width > self.size:
                    raise _bad("the GGUF file is truncated: an array runs past its end")
                raw = self.take(count * width)
                return list(struct.unpack(f"<{count}{_SCALARS[item][1]}", raw))
            if item == _STRING and self.pos + count * 8 > self.size:
                raise _bad("the GGUF file is truncated: an array runs past its end")
            return [self.value(item, depth + 1) for _ in range(count)]
        raise _bad(f"the GGUF file holds a value of unknown type {kind}")


def read_header(f: IO[bytes], size: int) -> GgufHeader:
    """The metadata and tensor table of a GGUF file of ``size`` bytes, checked against it."""
    r = _Reader(f, size)
    if size < 24 or r.take(4) != MAGIC:
        raise _bad("the file is not a GGUF model (it does not start with GGUF)", "not_gguf")
    version = r.unpack("<I")
    if version not in VERSIONS:
        raise _bad(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors = r.unpack("<Q")
    n_kv = r.unpack("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise _bad(
            f"the GGUF file declares {n_tensors} tensors and {n_kv} metadata keys, "
            f"over the {MAX_TENSORS} and {MAX_KV} allowed"
        )
    header = GgufHeader(version)
    for _ in range(n_kv):
        key = r.string(MAX_KEY)
        if key in header.metadata:
            raise _bad(f"the GGUF file declares the metadata key {key!r} twice")
        kind = r.unpack("<I")
        header.kinds[key] = kind
        header.metadata[key] = r.value(kind)
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = r.string(MAX_KEY)
        dims = r.unpack("<I")
        if not 1 <= dims <= MAX_DIMS:
            raise _bad(f"tensor {name!r} declares {dims} dimensions (1 to {MAX_DIMS})")
        shape = tuple(r.unpack("<Q") for _ in range(dims))
        kind = r.unpack("<I")
        offset = r.unpack("<Q")
        infos.append((name, shape, kind, offset))
    alignment = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _bad("general.alignment must be a power of two")
    start = -(-r.pos // alignment) * alignment
    header.data_start = start
    room = size - start
    expected = 0
    for name, shape, kind, offset in infos:
        if name in header.tensors:
            raise _bad(f"the GGUF file declares tensor {name!r} twice")
        traits = GGML_TYPES.get(kind)
        if traits is None:
            raise _bad(f"tensor {name!r} has unknown ggml type {kind}")
        block_bytes, block = traits
        elements = 1
        for d in shape:
            if d < 1:
                raise _bad(f"tensor {name!r} has an empty dimension")
            elements *= d
            if elements > size * 256:
                raise _bad(f"tensor {name!r} declares more data than the file holds")
        if shape[0] % block:
            raise _bad(f"tensor {name!r}: its rows are not whole blocks of its type")
        nbytes = elements // block * block_bytes
        if offset % alignment or offset + nbytes > room:
            raise _bad(
                f"tensor {name!r} declares {nbytes} bytes at offset {offset}, past the end "
                "of the file (truncated, or a size it does not hold)"
            )
        if offset != expected:
            raise _bad(
                f"tensor {name!r} starts at offset {offset}, not {expected} where the tensor "
                "before it ends (tensors lie one after another)"
            )
        expected = offset + -(-nbytes // alignment) * alignment
        header.tensors[name] = TensorInfo(name, shape, kind, offset, nbytes)
    return header


def read_path(path: Path) -> GgufHeader:
    with path.open("rb") as f:
        return read_header(f, path.stat().st_size)


def check_lora(adapter: GgufHeader, base: GgufHeader) -> int:
    """Refuse an adapter llama.cpp would refuse for this base; the number of pairs it adapts."""
    if adapter.string("general.type") != "adapter" or adapter.string("adapter.type") != "lora":
        raise _bad(
            "the file is not a LoRA adapter (general.type adapter, adapter.type lora); "
            "upload full weights with type=weights",
            "not_a_lora",
        )
    if adapter.architecture != base.architecture:
        raise _bad(
            f"the adapter is for architecture {adapter.architecture!r}, the base model is "
            f"{base.architecture!r}",
            "lora_base_mismatch",
        )
    if "adapter.lora.alpha" in adapter.metadata and adapter.kinds.get("adapter.lora.alpha") != (
        _FLOAT32
    ):
        raise _bad("adapter.lora.alpha must be a 32-bit float (as llama.cpp reads it)")
    if any(key.startswith("adapter.alora.") for key in adapter.metadata):
        raise _bad(
            "the adapter is an activated LoRA (adapter.alora.*), applied only after its "
            "invocation tokens; the engine applies adapters to whole requests",
            "alora_unsupported",
        )
    pairs: dict[str, dict[str, TensorInfo]] = {}
    for name, info in adapter.tensors.items():
        for suffix in (".lora_a", ".lora_b"):
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], {})[suffix] = info
                break
        else:
            raise _bad(f"tensor {name!r} is not a lora_a or lora_b tensor", "lora_base_mismatch")
    if not pairs:
        raise _bad("the adapter holds no LoRA tensors", "lora_base_mismatch")
    for target, pair in sorted(pairs.items()):
        a, b = pair.get(".lora_a"), pair.get(".lora_b")
        if a is None or b is None:
            raise _bad(f"tensor {target!r} has lora_a or lora_b but not both", "lora_base_mismatch")
        t = base.tensors.get(target)
        if t is None:
            raise _bad(f"the base model has no tensor {target!r}", "lora_base_mismatch")
        if a.type not in LORA_TYPES or b.type not in LORA_TYPES:
            raise _bad(
                f"tensor {target!r}: LoRA tensors are {', '.join(LORA_TYPES.values())}",
                "invalid_model_file",
            )
        if target == "token_embd.weight" and "output.weight" not in base.tensors:
            raise _bad(
                "the base model's output layer is its token embedding (tied embeddings), "
                "which llama.cpp cannot adapt: adapt the other layers",
                "lora_base_mismatch",
            )
        if len(a.shape) != 2 or len(b.shape) != 2 or len(t.shape) < 2:
            raise _bad(f"tensor {target!r}: LoRA tensors are matrices", "lora_base_mismatch")
        if target.endswith("token_embd.weight"):
            # llama.cpp reads an embedding's pair the other way round (see llm_build_inp_embd).
            fits = b.shape[1] == t.shape[0] and a.shape[1] == t.shape[1]
        else:
            fits = a.shape[0] == t.shape[0] and b.shape[1] == t.shape[1]
            fits = fits and a.shape[1] == b.shape[0]
        if not fits:
            raise _bad(
                f"tensor {target!r}: lora_a {list(a.shape)} and lora_b {list(b.shape)} do not "
                f"fit the base's {list(t.shape)}",
                "lora_base_mismatch",
            )
    return len(pairs)
