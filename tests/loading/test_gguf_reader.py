"""GGUFFile: header, metadata of every value type, tensor table, alignment and validation."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch

from infercore.loading import GGMLType, GGUFFile


def _all_value_types(w: gguf.GGUFWriter) -> None:
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.arr_str", ["a", "", "日本"])
    w.add_array("t.arr_int", [1, -2, 3])
    w.add_array("t.arr_f", [0.5, 1.5])
    w.add_array("t.arr_bool", [True, False])
    w.add_key_value("t.arr_nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY)


def test_metadata_all_value_types(tmp_path, write_gguf):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = write_gguf(tmp_path / "m.gguf", kv=_all_value_types, tensors={"x": (x, None)})
    gf = GGUFFile(path)
    md = gf.metadata
    assert gf.version == 3 and gf.architecture == "llama"
    assert (md["t.u8"], md["t.i8"], md["t.u16"], md["t.i16"]) == (250, -5, 65000, -30000)
    assert (md["t.u32"], md["t.i32"], md["t.u64"], md["t.i64"]) == (
        4_000_000_000,
        -2_000_000_000,
        2**63 + 5,
        -(2**62),
    )
    assert md["t.f32"] == 0.25 and md["t.f64"] == 1e-300 and md["t.bool"] is True
    assert md["t.str"] == "héllo ✓"
    assert md["t.arr_str"] == ["a", "", "日本"]
    assert md["t.arr_int"] == [1, -2, 3]
    assert md["t.arr_f"] == [0.5, 1.5]
    assert md["t.arr_bool"] == [True, False]
    assert md["t.arr_nested"] == [[1, 2], [3]]
    # ...and every key the reference reader sees, we see.
    assert set(md) == set(gguf.GGUFReader(path).fields) - {
        "GGUF.version",
        "GGUF.tensor_count",
        "GGUF.kv_count",
    }
    assert torch.equal(gf.tensor("x"), torch.from_numpy(x))


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_alignment_and_offsets(tmp_path, write_gguf, alignment):
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": (rng.standard_normal((i + 1, 3)).astype(np.float32), None) for i in range(4)}
    tensors["h"] = (rng.standard_normal((2, 5)).astype(np.float16), None)
    path = write_gguf(tmp_path / "a.gguf", tensors=tensors, alignment=alignment)
    gf = GGUFFile(path)
    assert gf.alignment == (alignment or 32)
    assert gf.data_start % gf.alignment == 0
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert list(gf.tensors) == list(ref)
    for name, (arr, _) in tensors.items():
        info = gf.tensors[name]
        assert info.offset == ref[name].data_offset and info.shape == arr.shape
        out = gf.tensor(name, dtype=None)
        assert out.dtype == (torch.float16 if arr.dtype == np.float16 else torch.float32)
        np.testing.assert_array_equal(out.numpy(), arr)


def test_real_file_table_matches_reference(smollm, ref_reader):
    ref = ref_reader
    assert len(smollm.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        info = smollm.tensors[t.name]
        assert info.shape == tuple(reversed([int(d) for d in t.shape]))
        assert int(info.ggml_type) == int(t.tensor_type) and info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
    assert {t.ggml_type for t in smollm.tensors.values()} == {GGMLType.F32, GGMLType.Q4_1, GGMLType.Q8_0}
    tokens = smollm.get("tokenizer.ggml.tokens")
    assert len(tokens) == 49152 and tokens[1] == "<|im_start|>"


@pytest.mark.parametrize(
    "name",
    [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.7.ffn_down.weight",
        "blk.29.ffn_norm.weight",
        "output_norm.weight",
    ],
)
def test_real_tensors_match_reference(smollm, ref_reader, name):
    """Q8_0, Q4_1 and F32 tensors of the real model, dequantized by us and by gguf-py."""
    ref = next(t for t in ref_reader.tensors if t.name == name)
    expected = gguf.quants.dequantize(ref.data, ref.tensor_type)
    np.testing.assert_array_equal(smollm.tensor(name).numpy(), expected)


def test_raw_blocks(smollm):
    blocks, ggml_type, shape = smollm.raw("blk.0.attn_k.weight")
    assert ggml_type is GGMLType.Q4_1 and shape == (192, 576)
    assert blocks.shape == (192, 576 // 32, 20) and blocks.dtype == np.uint8
    # First block of row 5, by hand: y = d * nibble + m.
    d, m = blocks[5, 0, :4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blocks[5, 0, 4:] & 15, blocks[5, 0, 4:] >> 4]).astype(np.float32)
    np.testing.assert_array_equal(smollm.tensor("blk.0.attn_k.weight")[5, :32].numpy(), d * q + m)


# --- validation -------------------------------------------------------------------------------


def _small(tmp_path, write_gguf):
    return write_gguf(tmp_path / "s.gguf", tensors={"w": (np.ones((4, 32), np.float32), None)})


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        GGUFFile(tmp_path / "nope.gguf")


def test_bad_magic(tmp_path, write_gguf):
    path = _small(tmp_path, write_gguf)
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"bad magic.*s\.gguf"):
        GGUFFile(path)


def test_bad_version(tmp_path, write_gguf):
    path = _small(tmp_path, write_gguf)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 1)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="version 1"):
        GGUFFile(path)


def test_truncated_data(tmp_path, write_gguf):
    path = _small(tmp_path, write_gguf)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ValueError, match=r"truncated GGUF file .*s\.gguf.*'w'"):
        GGUFFile(path)


def test_truncated_header(tmp_path, write_gguf):
    path = write_gguf(tmp_path / "h.gguf", kv=lambda w: w.add_string("x.s", "a" * 100))
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ValueError, match=r"truncated or corrupt GGUF file .*h\.gguf"):
        GGUFFile(path)


def test_unknown_tensor_type(tmp_path, write_gguf):
    path = _small(tmp_path, write_gguf)
    data = bytearray(path.read_bytes())
    # The tensor info ends with dims (ggml order), the type id, then the offset.
    needle = struct.pack("<QQ", 32, 4) + struct.pack("<I", 0)  # dims (ggml order) + type F32
    type_pos = data.index(needle) + 16
    data[type_pos : type_pos + 4] = struct.pack("<I", 77)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"unknown ggml type 77.*s\.gguf"):
        GGUFFile(path)


def test_no_dequantizer(tmp_path, write_gguf):
    blocks = np.zeros((1, 66), np.uint8)  # one IQ2_XXS super-block: readable raw, not dequantizable
    path = write_gguf(tmp_path / "iq.gguf", tensors={"w": (blocks, gguf.GGMLQuantizationType.IQ2_XXS)})
    gf = GGUFFile(path)
    assert gf.raw("w")[1] is GGMLType.IQ2_XXS
    with pytest.raises(ValueError, match="IQ2_XXS"):
        gf.tensor("w")


def test_unknown_tensor_name(smollm):
    with pytest.raises(KeyError, match="nope"):
        smollm.tensor("nope")


def test_string_arrays_read_whole_and_truncated(tmp_path, write_gguf):
    """Token lists (arrays of strings) take a fast path; a cut inside one still names the file."""
    words = ["a", "", "ünï", "🤖" * 3, "x" * 300]
    path = write_gguf(tmp_path / "v.gguf", kv=lambda w: w.add_array("tokenizer.ggml.tokens", words * 50))
    assert GGUFFile(path).metadata["tokenizer.ggml.tokens"] == words * 50
    data = path.read_bytes()
    cut = data.index(b"x" * 300) + 100  # inside the first long string
    for end in (cut, data.index(b"x" * 300) - 4):  # inside a string, inside a length
        path.write_bytes(data[:end])
        with pytest.raises(ValueError, match=r"truncated or corrupt GGUF file .*v\.gguf"):
            GGUFFile(path)
    bad = bytearray(data)
    bad[data.index("ünï".encode()) : data.index("ünï".encode()) + 1] = b"\xff"
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=r"corrupt GGUF file .*v\.gguf: invalid utf-8"):
        GGUFFile(path)
