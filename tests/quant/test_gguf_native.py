"""The real SmolLM2 Q4_1 checkpoint run through its blocks as stored equals the dequantized model."""

import torch

from infercore.loading import default_model_path
from infercore.models import load_model
from infercore.ops import AttentionMetadata
from infercore.ops.moe import cpu_native
from infercore.quant import QuantLinear
from infercore.quant.gguf_native import use_gguf_blocks


def _logits(model, ids):
    t = len(ids)
    caches = [(torch.zeros(1, 32, s.num_kv_heads, s.head_dim), torch.zeros(1, 32, s.num_kv_heads, s.head_dim))
              for s in model.kv_specs()]
    meta = AttentionMetadata.from_lists(query_lens=[t], seq_lens=[t], block_tables=[[0]],
                                        slot_mapping=list(range(t)))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t), caches, meta))


def test_native_q4_1_blocks_match_dequantized_model():
    path = default_model_path()
    model, tok, _ = load_model(path, dtype=torch.float32, device="cpu")
    ids = tok.encode("The capital of France is")
    dense = _logits(model, ids)
    swapped = use_gguf_blocks(model, path, tied_lm_head=True)
    # qkv, o, gate_up, down: every Q4_1 projection of 30 layers; the tied lm_head from the embedding's Q8_0 blocks
    assert len(swapped) == 4 * 30 + 1 and swapped[-1] == "lm_head"
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.kind == "gguf"
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.qweight_format.qtype == "q8_0"
    assert isinstance(model.model.embed_tokens.weight, torch.Tensor)  # the lookup keeps the dense table
    model.finish_init()  # re-tying leaves the quantized head alone
    assert isinstance(model.lm_head, QuantLinear)
    native = _logits(model, ids)
    assert torch.allclose(native, dense, atol=1e-4, rtol=1e-4)
    assert torch.equal(native[-1].argmax(), dense[-1].argmax())


def test_tied_lm_head_stays_dense_by_default():
    path = default_model_path()
    with cpu_native.int8_activations(True) as a8:  # with 8-bit activations the default runs the embedding's blocks
        model, _, _ = load_model(path, dtype=torch.bfloat16, device="cpu")
        assert ("lm_head" in use_gguf_blocks(model, path)) == a8
    with cpu_native.int8_activations(False):
        model, _, _ = load_model(path, dtype=torch.bfloat16, device="cpu")
        swapped = use_gguf_blocks(model, path)
    assert "lm_head" not in swapped and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():  # tied_lm_head=True: the Q8_0 blocks through the native INT8 GEMV, close to dense
        x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
        dense = model.lm_head(x).float()
        assert use_gguf_blocks(model, path, tied_lm_head=True)[-1] == "lm_head"
        assert cpu_native.q4_supported(), cpu_native.status()  # the CI machine has AVX512-BF16
        blocks = model.lm_head(x).float()
    assert ((blocks - dense).norm() / dense.norm()).item() < 0.01


def test_native_q4_1_blocks_in_bf16_take_the_packed_cpu_kernel(monkeypatch):
    # bf16 activations run the blocks through ATen's packed INT4 kernel (quant/cpu.py). Against the fp32 model its
    # logits carry bf16 rounding like the dequantizing reference's and the dense bf16 model's. Which of them lands
    # closest differs from prompt to prompt (one rounding flip early on moves the whole trajectory), so the bound is
    # over three prompts. Measured (relative distance per prompt): fast 2.32 / 2.27 / 2.67%, reference 1.61 / 2.47 /
    # 1.87%, dense bf16 2.26 / 2.19 / 1.87%; the next token is the fp32 model's on each.
    path = default_model_path()
    m32, tok, _ = load_model(path, dtype=torch.float32, device="cpu")
    dense, _, _ = load_model(path, dtype=torch.bfloat16, device="cpu")
    model, _, _ = load_model(path, dtype=torch.bfloat16, device="cpu")
    use_gguf_blocks(model, path)
    prompts = ["The capital of France is",  # each within _logits' 32 cache slots
               "The capital of France is Paris. It is known for the Eiffel Tower and its cafes.",
               "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
    dist = {"fast": 0.0, "reference": 0.0, "dense": 0.0}
    for text in prompts:
        ids = tok.encode(text)
        exact = _logits(m32, ids)
        fast = _logits(model, ids).float()
        with monkeypatch.context() as m:
            m.setenv("INFERCORE_BACKEND", "quant.gguf_matmul:reference")
            ref = _logits(model, ids).float()
        for name, got in (("fast", fast), ("reference", ref), ("dense", _logits(dense, ids).float())):
            dist[name] += ((got - exact).norm() / exact.norm()).item() / len(prompts)
        assert torch.equal(fast[-1].argmax(), exact[-1].argmax())
    assert dist["fast"] < 0.03
    assert dist["fast"] < 1.5 * dist["reference"] and dist["fast"] < 1.5 * dist["dense"]
