"""Our numpy dequantizers against the reference `gguf` package (gguf.quants), bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from infercore.loading import GGMLType, GGUFFile, dequantize
from infercore.loading.gguf_quants import BLOCK_LAYOUT, DEQUANTIZABLE

# Byte offsets of each format's fp16 scale fields (random bytes there could be inf/NaN).
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for every field (all bit patterns of the quants and packed scales), with finite
    fp16 scales."""
    _, block_bytes = BLOCK_LAYOUT[GGMLType[type_name]]
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in _F16_FIELDS[type_name]:
        scale = rng.uniform(-2.0, 2.0, size=(n_blocks, 1)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8)
    return blocks


def test_block_layout_matches_reference():
    # Sizes decide tensor byte spans (and the truncation check): every type both sides know.
    # gguf-py still lists Q8_1 with two fp32 scales (40 bytes); ggml's block_q8_1 has two fp16
    # (36). Q8_1 is a matmul-internal type that never appears in a file, so it is left out.
    for t in GGMLType:
        if t is GGMLType.Q8_1:
            continue
        ref_type = Q[t.name]
        assert BLOCK_LAYOUT[t] == gguf.GGML_QUANT_SIZES[ref_type], t.name


@pytest.mark.parametrize("type_name", sorted(_F16_FIELDS))
def test_random_blocks_match_reference(type_name):
    rng = np.random.default_rng(sum(type_name.encode()))
    blocks = random_blocks(type_name, 64, rng)
    ours = dequantize(blocks, GGMLType[type_name])
    ref = ref_dequantize(blocks, Q[type_name]).reshape(-1)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16"])
def test_reference_quantized_data_roundtrip(type_name):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    packed = ref_quantize(x, Q[type_name])  # uint8 [8, bytes per row]
    _, block_bytes = BLOCK_LAYOUT[GGMLType[type_name]]
    ours = dequantize(packed.reshape(-1, block_bytes), GGMLType[type_name]).reshape(x.shape)
    np.testing.assert_array_equal(ours, ref_dequantize(packed, Q[type_name]))
    # ...and it is the data, not just agreement: within the format's quantization error.
    tol = {"Q4_0": 0.35, "Q4_1": 0.3, "Q5_0": 0.15, "Q5_1": 0.15, "Q8_0": 0.02, "BF16": 0.02}[type_name]
    assert np.abs(ours - x).max() < tol * np.abs(x).max()


def test_plain_types():
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    np.testing.assert_array_equal(dequantize(x.view(np.uint8).reshape(-1, 4), GGMLType.F32), x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(
        dequantize(h.view(np.uint8).reshape(-1, 2), GGMLType.F16), h.astype(np.float32)
    )
    bf = torch.from_numpy(x).to(torch.bfloat16)
    raw = bf.view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
    np.testing.assert_array_equal(dequantize(raw, GGMLType.BF16), bf.float().numpy())


def test_q8_k_by_hand():
    # The gguf package has no Q8_K dequantizer: y = d * q, block sums ignored.
    rng = np.random.default_rng(1)
    d = np.array([0.5, -0.125], dtype=np.float32)
    q = rng.integers(-128, 128, size=(2, 256)).astype(np.int8)
    bsums = rng.integers(-1000, 1000, size=(2, 16)).astype(np.int16)
    blocks = np.concatenate([d.reshape(2, 1).view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)], axis=1)
    np.testing.assert_array_equal(dequantize(blocks, GGMLType.Q8_K), (d[:, None] * q).reshape(-1))


def test_dequantize_validates():
    with pytest.raises(ValueError, match="ggml_type"):
        dequantize(np.zeros((1, 18), np.uint8), 99)
    with pytest.raises(ValueError, match="no dequantizer for IQ2_XXS"):
        dequantize(np.zeros((1, 66), np.uint8), GGMLType.IQ2_XXS)
    with pytest.raises(ValueError, match="blocks"):
        dequantize(np.zeros((1, 17), np.uint8), GGMLType.Q4_0)
    with pytest.raises(TypeError, match="blocks"):
        dequantize(np.zeros((1, 18), np.int8), GGMLType.Q4_0)


@pytest.mark.parametrize("type_name", sorted(_F16_FIELDS))
def test_through_file(tmp_path, write_gguf, type_name):
    """Blocks written into a GGUF come back through GGUFFile.tensor/raw as the reference reads them."""
    rng = np.random.default_rng(3)
    block_elems, block_bytes = BLOCK_LAYOUT[GGMLType[type_name]]
    rows, blocks_per_row = 3, 2
    blocks = random_blocks(type_name, rows * blocks_per_row, rng).reshape(rows, blocks_per_row * block_bytes)
    path = write_gguf(tmp_path / "q.gguf", tensors={"w": (blocks, Q[type_name])})

    gf = GGUFFile(path)
    raw, ggml_type, shape = gf.raw("w")
    assert ggml_type == GGMLType[type_name] and shape == (rows, blocks_per_row * block_elems)
    assert raw.shape == (rows, blocks_per_row, block_bytes) and not raw.flags.writeable
    np.testing.assert_array_equal(raw.reshape(rows, -1), blocks)

    ref_tensor = gguf.GGUFReader(path).tensors[0]
    expected = ref_dequantize(ref_tensor.data, ref_tensor.tensor_type)
    t = gf.tensor("w")
    assert t.dtype == torch.float32 and tuple(t.shape) == shape
    np.testing.assert_array_equal(t.numpy(), expected)
    assert gf.tensor("w", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_supported_set():
    required = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K", "Q8_K"}
    assert required <= {t.name for t in DEQUANTIZABLE}
