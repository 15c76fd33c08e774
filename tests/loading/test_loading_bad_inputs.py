"""Bad checkpoints and arguments give a ValueError/TypeError that names the file or the key."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from infercore.loading import GGMLType, GGUFFile, Tokenizer, iter_safetensors, load_checkpoint

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 32, 4, 2, 48, 8


def _llama_kv(**overrides):
    """A writer callback adding a tiny llama's metadata; an override of None drops the key."""
    values = {
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": INTER,
        "llama.block_count": 1,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        **overrides,
    }

    def add(w):
        for key, value in values.items():
            if value is None:
                continue
            if isinstance(value, str):
                w.add_string(key, value)
            elif isinstance(value, float):
                w.add_float32(key, value)
            elif isinstance(value, list):
                w.add_array(key, value)
            else:
                w.add_uint32(key, value)

    return add


def _llama_tensors(**extra):
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (INTER, HIDDEN),
        "blk.0.ffn_up.weight": (INTER, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, INTER),
    }
    tensors = {name: (rng.standard_normal(shape).astype(np.float32), None) for name, shape in shapes.items()}
    return {**tensors, **extra}


# ----------------------------------------------------------------------------------- paths, JSON
def test_empty_path_is_not_the_current_directory():
    with pytest.raises(ValueError, match="path: .*empty string"):
        load_checkpoint("")


def _st_dir(tmp_path, tensors=None):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file(tensors or {"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_config_json_not_utf8(tmp_path):
    _st_dir(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"invalid JSON in .*config\.json"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "index, match",
    [
        (b'{"weight_map": ["model.safetensors"]}', "weight_map"),
        (b'{"weight_map": {"w": 3}}', "weight_map"),
        (b'{"weight_map": {"w": "../elsewhere.safetensors"}}', "shard names must be file names"),
        (b"\xff\xfe", r"invalid JSON in .*model\.safetensors\.index\.json"),
    ],
)
def test_bad_safetensors_index(tmp_path, index, match):
    _st_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("bad", [torch.arange(4, dtype=torch.int32).reshape(2, 2), torch.ones(2, 2, dtype=torch.bool)])
def test_integer_weights_are_not_cast_to_float(tmp_path, bad):
    root = _st_dir(tmp_path, {"w": bad})
    with pytest.raises(ValueError, match=r"tensor 'w' in .*model\.safetensors has dtype .*floating-point"):
        list(iter_safetensors(root, torch.float32))
    assert dict(iter_safetensors(root))["w"].dtype == bad.dtype  # no dtype asked: stored as is


# ----------------------------------------------------------------------------------- HF tokenizer
@pytest.fixture
def tok_dir(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models

    RustTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    return tmp_path


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("tokenizer_config.json", b"\xff\xfe", r"invalid JSON in .*tokenizer_config\.json"),
        ("tokenizer_config.json", b"[1, 2]", r"tokenizer_config\.json must hold a JSON object"),
        ("tokenizer_config.json", b'{"chat_template": 5}', "chat_template"),
        ("chat_template.jinja", b"\xff\xfe", r"chat_template\.jinja is not UTF-8"),
        ("config.json", b'{"eos_token_id": "x"}', r"eos_token_id in .*config\.json"),
    ],
)
def test_bad_tokenizer_side_files(tok_dir, name, content, match):
    (tok_dir / name).write_bytes(content)
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_hf_dir(tok_dir)


# ----------------------------------------------------------------------------------- GGUF reader
def test_gguf_path_type():
    with pytest.raises(TypeError, match="path"):
        GGUFFile(5)


def test_truncated_real_header(tmp_path, smollm_path):
    with open(smollm_path, "rb") as f:
        head = f.read(4096)
    (tmp_path / "cut.gguf").write_bytes(head)
    with pytest.raises(ValueError, match=r"truncated or corrupt GGUF file .*cut\.gguf"):
        load_checkpoint(tmp_path / "cut.gguf")


def test_alignment_must_be_an_int(tmp_path, write_gguf):
    path = write_gguf(tmp_path / "a.gguf", kv=lambda w: w.add_string("general.alignment", "x"))
    with pytest.raises(ValueError, match=r"general\.alignment .*'x'.*a\.gguf"):
        GGUFFile(path)


def test_overflowing_dims_are_caught_at_open(tmp_path, write_gguf):
    path = write_gguf(tmp_path / "o.gguf", tensors={"w": (np.zeros((4, 8), np.float32), None)})
    data = bytearray(path.read_bytes())
    at = data.find(b"w\x02\x00\x00\x00") + 1  # name "w", then n_dims = 2
    struct.pack_into("<IQQ", data, at, 2, 2**40, 2**40)  # 2**80 elements wrap around in int64
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"truncated GGUF file .*o\.gguf: tensor 'w'"):
        GGUFFile(path)


def test_deeply_nested_arrays(tmp_path):
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9)
    body = struct.pack("<IQ", 9, 1) * 2000 + struct.pack("<IQ", 4, 0)  # arrays of arrays of ...
    (tmp_path / "n.gguf").write_bytes(header + body)
    with pytest.raises(ValueError, match=r"corrupt GGUF file .*n\.gguf: arrays nested"):
        GGUFFile(tmp_path / "n.gguf")


# ----------------------------------------------------------------------------------- GGUF -> HF
@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"llama.attention.head_count": 0}, r"'llama\.attention\.head_count' must be an integer >= 1, got 0"),
        ({"llama.attention.head_count": "four"}, r"'llama\.attention\.head_count' .*'four'"),
        ({"llama.embedding_length": 32.5}, r"'llama\.embedding_length' .*32\.5"),
        ({"llama.rope.freq_base": "x"}, r"'llama\.rope\.freq_base' must be a positive number"),
        ({"llama.rope.dimension_count": 4}, r"'llama\.rope\.dimension_count'=4 differs from the head size 8"),
        ({"llama.expert_count": 2}, "mixture-of-experts"),
        ({"tokenizer.ggml.bos_token_id": "a"}, r"'tokenizer\.ggml\.bos_token_id'"),
    ],
)
def test_bad_gguf_metadata(tmp_path, write_gguf, overrides, match):
    path = write_gguf(tmp_path / "m.gguf", tensors=_llama_tensors(), kv=_llama_kv(**overrides))
    with pytest.raises(ValueError, match=rf"{match}.*m\.gguf"):
        load_checkpoint(path)


def test_integer_gguf_tensor_is_not_a_weight(tmp_path, write_gguf):
    tensors = _llama_tensors(**{"blk.0.ffn_up.weight": (np.zeros((INTER, HIDDEN), np.int32), None)})
    gf = GGUFFile(write_gguf(tmp_path / "i.gguf", tensors=tensors, kv=_llama_kv()))
    assert gf.tensors["blk.0.ffn_up.weight"].ggml_type is GGMLType.I32
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has type I32.*i\.gguf"):
        gf.weights()  # raised when asked, before any tensor is read


# ----------------------------------------------------------------------------------- GGUF tokenizer
@pytest.mark.parametrize(
    "tokens, merges, match",
    [
        (None, None, r"'tokenizer\.ggml\.tokens' is missing or empty"),
        ([1, 2, 3], None, r"'tokenizer\.ggml\.tokens' must be an array of strings"),
        (["a", "b"], [5], r"'tokenizer\.ggml\.merges' must be an array of strings"),
        (["a", "b"], ["a c"], "cannot build the tokenizer"),
    ],
)
def test_bad_gguf_tokenizer(tmp_path, write_gguf, tokens, merges, match):
    def kv(w):
        w.add_string("tokenizer.ggml.model", "gpt2")
        if tokens is not None:
            w.add_array("tokenizer.ggml.tokens", tokens)
        if merges is not None:
            w.add_array("tokenizer.ggml.merges", merges)

    path = write_gguf(tmp_path / "t.gguf", kv=kv)
    with pytest.raises(ValueError, match=rf"{match}.*t\.gguf"):
        Tokenizer.from_gguf(path)
