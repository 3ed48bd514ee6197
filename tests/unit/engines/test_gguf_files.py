"""The strict GGUF header reader: real files pass, every lie a hostile file tells is refused."""

from __future__ import annotations

import io

import pytest

from batchyard.engines import gguf_files as g
from batchyard.engines.model_files import default_model_path
from batchyard.errors import InvalidRequest
from tests.support.gguf import F32, gguf_bytes, lora_for

Q = "blk.0.attn_q.weight"
K = "blk.0.attn_k.weight"


def _read(data: bytes) -> g.GgufHeader:
    return g.read_header(io.BytesIO(data), len(data))


def _base() -> g.GgufHeader:
    return g.read_path(default_model_path())


def test_the_embedded_model_reads_as_what_it_is() -> None:
    h = _base()
    assert h.architecture == "llama"
    assert h.tensors[Q].shape == (576, 576)
    assert h.tensors[K].shape == (576, 192)


def test_a_lora_that_fits_the_base_passes_with_its_pairs_counted() -> None:
    adapter = _read(lora_for("llama", {Q: ((576, 8), (8, 576)), K: ((576, 8), (8, 192))}))
    assert g.check_lora(adapter, _base()) == 2


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"PK\x03\x04 this is a zip file, not a model" * 4, "not_gguf"),
        (b"GG", "not_gguf"),
        (lora_for("llama", {Q: ((576, 8), (8, 576))})[:40], "invalid_model_file"),
        # A tensor whose shape declares 2**40 floats in a file of a few hundred bytes.
        (
            gguf_bytes(
                {"general.architecture": "llama"},
                [("x", (1 << 20, 1 << 20), F32)],
                declared_bytes={"x": 64},
            ),
            "invalid_model_file",
        ),
        # A string that claims to be 2**60 bytes long.
        (
            b"GGUF"
            + (3).to_bytes(4, "little")
            + (0).to_bytes(8, "little")
            + (1).to_bytes(8, "little")
            + (1 << 60).to_bytes(8, "little"),
            "invalid_model_file",
        ),
        # An array that claims more elements than the file could hold.
        (
            b"GGUF"
            + (3).to_bytes(4, "little")
            + (0).to_bytes(8, "little")
            + (1).to_bytes(8, "little")
            + (1).to_bytes(8, "little")
            + b"k"
            + (9).to_bytes(4, "little")
            + (4).to_bytes(4, "little")
            + (1 << 21).to_bytes(8, "little"),
            "invalid_model_file",
        ),
    ],
    ids=["zip", "two-bytes", "truncated", "huge-tensor", "huge-string", "huge-array"],
)
def test_files_that_lie_about_themselves_are_refused(data: bytes, code: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _read(data)
    assert caught.value.code == code


def test_a_tensor_whose_data_is_cut_short_is_refused() -> None:
    data = gguf_bytes(
        {"general.architecture": "llama"}, [("x", (64, 64), F32)], declared_bytes={"x": 32}
    )
    with pytest.raises(InvalidRequest, match="past the end"):
        _read(data)


@pytest.mark.parametrize(
    ("pairs", "arch", "code"),
    [
        ({Q: ((576, 8), (8, 576))}, "qwen2", "lora_base_mismatch"),
        ({Q: ((512, 8), (8, 576))}, "llama", "lora_base_mismatch"),
        ({K: ((576, 8), (8, 576))}, "llama", "lora_base_mismatch"),
        ({Q: ((576, 8), (4, 576))}, "llama", "lora_base_mismatch"),
        ({"blk.99.attn_q.weight": ((576, 8), (8, 576))}, "llama", "lora_base_mismatch"),
    ],
    ids=[
        "other-architecture",
        "wrong-input-width",
        "wrong-output-width",
        "ranks-differ",
        "no-such",
    ],
)
def test_an_adapter_llama_cpp_would_refuse_for_this_base_is_refused(pairs, arch, code) -> None:
    with pytest.raises(InvalidRequest) as caught:
        g.check_lora(_read(lora_for(arch, pairs)), _base())
    assert caught.value.code == code


def test_full_weights_are_not_an_adapter() -> None:
    with pytest.raises(InvalidRequest) as caught:
        g.check_lora(_base(), _base())
    assert caught.value.code == "not_a_lora"


def test_an_embedding_pair_is_read_the_way_llama_cpp_reads_it() -> None:
    """token_embd's pair is (a: ne [rank, n_vocab], b: ne [rank, n_embd]); only on a base
    with an output layer of its own (on tied embeddings llama.cpp would abort)."""
    embd = "token_embd.weight"
    tensors = [(embd, (64, 1000), F32), ("output.weight", (64, 1000), F32)]
    untied = _read(gguf_bytes({"general.architecture": "llama"}, tensors))
    tied = _read(gguf_bytes({"general.architecture": "llama"}, tensors[:1]))
    fits = _read(lora_for("llama", {embd: ((8, 1000), (8, 64))}))
    assert g.check_lora(fits, untied) == 1
    with pytest.raises(InvalidRequest) as refused:
        g.check_lora(fits, tied)
    assert refused.value.code == "lora_base_mismatch"
    # The matrix way round, which fits an ordinary weight, does not fit an embedding.
    with pytest.raises(InvalidRequest):
        g.check_lora(_read(lora_for("llama", {embd: ((64, 8), (8, 1000))})), untied)
