"""GGUF Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks kept as stored: their values against the reference ``gguf`` package
bit for bit, the CPU's native kernels on them against the dequantized weight, and a GGUF file with them run by
``use_gguf_blocks`` against the model dequantized at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as ref_dequantize

from infercore.models import load_model
from infercore.ops import AttentionMetadata
from infercore.ops.moe import cpu_native
from infercore.quant import GGUFWeight, QuantLinear
from infercore.quant.cpu import native_operands
from infercore.quant.gguf import AFFINE, BLOCK_BYTES, BLOCK_ELEMS, affine_parts, sub_block
from infercore.quant.gguf_native import use_gguf_blocks

# Byte offsets of each format's fp16 fields (d, and dmin / m)
_F16 = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def blocks(qtype: str, rows: int, k: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    """Random ``uint8 [rows, k / block_elems, block_bytes]`` blocks: every code and packed-scale bit pattern, fp16
    fields uniform in ``(-scale, scale)``."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows, k // BLOCK_ELEMS[qtype], BLOCK_BYTES[qtype]), dtype=np.uint8)
    for off in _F16[qtype]:
        f = rng.uniform(-scale, scale, size=(rows, k // BLOCK_ELEMS[qtype], 1)).astype(np.float16)
        b[..., off : off + 2] = f.view(np.uint8)
    return torch.from_numpy(b)


@pytest.mark.parametrize("qtype", AFFINE)
def test_values_equal_the_gguf_package_bit_for_bit(qtype):
    b = blocks(qtype, 5, 512, seed=len(qtype) + ord(qtype[1]))
    w = GGUFWeight.from_blocks(b, qtype)
    assert w.shape == (5, 512)
    want = torch.from_numpy(ref_dequantize(b.reshape(-1, BLOCK_BYTES[qtype]).numpy(), Q[qtype.upper()]))
    assert torch.equal(w.dequantize(), want.reshape(5, 512))
    codes, scale, zero = affine_parts(w.raw, qtype)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2 ** {"q6_k": 6, "q4_k": 4}.get(qtype, 5)
    assert scale.shape == zero.shape == (5, 512 // sub_block(qtype))


@pytest.mark.parametrize("qtype", AFFINE)
@pytest.mark.parametrize("rows", [1, 3, 20])  # decode rows through the GEMVs; 20: decoded into the dense GEMM
def test_cpu_kernels_match_the_dequantized_weight(qtype, rows):
    assert cpu_native.q4_supported(), cpu_native.status()  # the CI machine has AVX512-BF16
    w = GGUFWeight.from_blocks(blocks(qtype, 48, 512, seed=rows, scale=0.01), qtype)
    codes, sz, bits = native_operands(w)
    # Q4_K: the INT4 GEMV; Q5_*: the INT4 one with a plane of fifth bits; Q6_K: its codes as bytes, groups of 16
    assert bits == {"q4_k": 4, "q6_k": 8}.get(qtype, 5)
    if qtype in ("q4_k", "q6_k"):  # the blocks' own sub-block scales (int8) under fp32 super-block ones
        assert sz.shape == (48, 1, 2 * 512 // 256 + 512 // sub_block(qtype) // 2)
    else:
        assert sz.shape == (48, 3 if bits == 5 else 2, 512 // sub_block(qtype))
    lin = QuantLinear(w, None)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    want = F.linear(x.float(), w.dequantize())
    with torch.inference_mode():
        got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    err = (got.float() - want).abs()
    assert (err <= want.abs() * 2**-7 + 2e-3 * want.abs().max()).all(), err.max()


@pytest.mark.parametrize("parts,bits", [(("q4_k", "q6_k", "q8_0"), 8), (("q4_k", "q4_0"), 4), (("q5_1", "q4_1"), 8),
                                        (("q5_0", "q5_k"), 8)])
def test_rows_of_several_formats_make_one_weight(parts, bits):
    from infercore.quant.formats import QuantizedWeight

    ws = [GGUFWeight.from_blocks(blocks(q, 16 * (i + 1), 512, seed=i, scale=0.01), q) if q in AFFINE
          else GGUFWeight.quantize(torch.randn(16 * (i + 1), 512), qtype=q) for i, q in enumerate(parts)]
    m = GGUFWeight.concat(ws)
    assert m.qtype == "mixed" and m.shape == (sum(w.shape[0] for w in ws), 512)
    assert torch.equal(m.dequantize(), torch.cat([w.dequantize() for w in ws]))
    back = QuantizedWeight.from_parts(m.meta(), m.tensors())  # how QuantLinear keeps it, and saved checkpoints
    assert back.parts == m.parts and torch.equal(back.dequantize(), m.dequantize())
    codes, sz, got_bits = native_operands(m)
    assert got_bits == bits and sz.shape[2] == 512 // min(sub_block(q) for q in parts)
    x = torch.randn(3, 512).bfloat16()
    want = F.linear(x.float(), m.dequantize())
    with torch.inference_mode():
        got = QuantLinear(m, None)(x).float()
    assert ((got - want).norm() / want.norm()).item() < 4e-3
    with pytest.raises(ValueError, match="K differs"):
        GGUFWeight.concat([ws[0], GGUFWeight.quantize(torch.randn(4, 256), qtype="q8_0")])
    with pytest.raises(TypeError, match="weights"):
        GGUFWeight.concat([])


def test_load_only_formats_are_refused_where_they_cannot_be_made():
    with pytest.raises(ValueError, match="qtype"):
        GGUFWeight.quantize(torch.randn(4, 256), qtype="q4_k")
    with pytest.raises(ValueError, match="qtype"):
        GGUFWeight.from_blocks(blocks("q6_k", 2, 256, 0), "q7_k")
    with pytest.raises(ValueError, match="blocks"):
        GGUFWeight.from_blocks(blocks("q6_k", 2, 256, 0), "q4_k")  # 210-byte blocks are not Q4_K's 144


def _tiny_llama_gguf(path, write_gguf):
    """A 2-layer Llama in GGUF whose linears use every format here: layer 0 q / k / v / gate / up Q4_K, o Q5_K, down
    Q6_K; layer 1 q / k Q4_K beside v Q6_K (a merged projection of two formats), o Q5_0, gate / up Q5_1, down Q4_K;
    output Q6_K."""
    from gguf import GGMLQuantizationType as G

    hidden, heads, kv_heads, inter, vocab = 256, 4, 2, 512, 64
    rng = np.random.default_rng(7)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * 64, hidden), "attn_v": (kv_heads * 64, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    types = [{"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q4_k", "attn_output": "q5_k", "ffn_gate": "q4_k",
              "ffn_up": "q4_k", "ffn_down": "q6_k"},
             {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q5_0", "ffn_gate": "q5_1",
              "ffn_up": "q5_1", "ffn_down": "q4_k"}]
    # fp16 fields sized so the weights are about unit variance over K (no overflow through two layers)
    mag = {"q4_k": 2e-3, "q5_k": 1e-3, "q6_k": 3e-4, "q5_0": 4e-3, "q5_1": 4e-3}
    tensors = {"token_embd.weight": (rng.standard_normal((vocab, hidden)).astype(np.float32), None),
               "output_norm.weight": (np.ones(hidden, np.float32), None)}
    for i, ty in enumerate(types):
        tensors[f"blk.{i}.attn_norm.weight"] = (np.ones(hidden, np.float32), None)
        tensors[f"blk.{i}.ffn_norm.weight"] = (np.ones(hidden, np.float32), None)
        for name, (n, k) in shapes.items():
            b = blocks(ty[name], n, k, seed=100 * i + len(name), scale=mag[ty[name]]).numpy().reshape(n, -1)
            tensors[f"blk.{i}.{name}.weight"] = (b, getattr(G, ty[name].upper()))
    b = blocks("q6_k", vocab, hidden, seed=9, scale=mag["q6_k"]).numpy().reshape(vocab, -1)
    tensors["output.weight"] = (b, G.Q6_K)

    def kv(w):
        for key, v in (("embedding_length", hidden), ("feed_forward_length", inter), ("block_count", 2),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("context_length", 256)):
            w.add_uint32(f"llama.{key}", v)
        w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        w.add_float32("llama.rope.freq_base", 10000.0)

    return write_gguf(path, tensors=tensors, kv=kv)


def _logits(model, ids):
    t, dtype = len(ids), model.model.embed_tokens.weight.dtype
    caches = [tuple(torch.zeros(1, 32, s.num_kv_heads, s.head_dim, dtype=dtype) for _ in range(2))
              for s in model.kv_specs()]
    meta = AttentionMetadata.from_lists(query_lens=[t], seq_lens=[t], block_tables=[[0]],
                                        slot_mapping=list(range(t)))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t), caches, meta))


def test_a_gguf_file_of_k_quants_runs_its_blocks_on_the_cpu(tmp_path, write_gguf):
    path = _tiny_llama_gguf(tmp_path / "k.gguf", write_gguf)
    exact, _, _ = load_model(path, dtype=torch.float32, device="cpu")  # dequantized at load
    model, _, _ = load_model(path, dtype=torch.bfloat16, device="cpu")
    swapped = use_gguf_blocks(model, path)
    assert sorted(swapped) == sorted([f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")] + ["lm_head"])
    qkv = model.model.layers[1].self_attn.qkv_proj.qweight_format  # Q4_K q / k beside a Q6_K v: one weight
    assert qkv.qtype == "mixed" and qkv.parts == [["q4_k", 256], ["q4_k", 128], ["q6_k", 128]]
    assert model.lm_head.qweight_format.qtype == "q6_k"
    qtypes = {m.qweight_format.qtype for m in model.modules() if isinstance(m, QuantLinear)}
    assert qtypes == {"q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "mixed"}
    ids = [3, 17, 42, 5, 60, 11, 2, 33, 8]
    want = _logits(exact, ids)
    got = _logits(model, ids).float()
    assert ((got - want).norm() / want.norm()).item() < 0.03  # bf16 activations against the fp32 model
    assert torch.equal(got[-1].argmax(), want[-1].argmax())


def test_on_other_devices_the_load_only_formats_stay_dense(tmp_path, write_gguf, monkeypatch):
    from infercore.quant import gguf_native

    path = _tiny_llama_gguf(tmp_path / "k.gguf", write_gguf)
    model, _, _ = load_model(path, dtype=torch.bfloat16, device="cpu")
    monkeypatch.setattr(gguf_native, "_runs_here", lambda qtype, device: qtype in ("q4_0", "q4_1", "q8_0"))
    assert use_gguf_blocks(model, path) == []  # as on a GPU: no kernel reads these formats there
