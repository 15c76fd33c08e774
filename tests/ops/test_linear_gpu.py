"""Triton skinny GEMV on the GPU: bf16 at the Llama-3.1-8B linear shapes, and graph capture."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.gpu

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def _rel(y, ref):
    return float((y.detach().float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_8b_shapes_bf16(n, k, m):
    from infercore.ops.linear import skinny_linear
    from infercore.ops.linear import triton as T

    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float(), b.float())
    assert _rel(T.skinny_linear(x, w, b), ref) < 1e-2
    assert _rel(skinny_linear(x, w, b), ref) < 1e-2  # public op, dispatched
    assert _rel(F.linear(x, w, b), ref) < 1e-2  # the tolerance is one cuBLAS meets too
    for cfg in (T.DEFAULT, T.DEFAULT_DOT, T.GemvConfig("fma", 2, 1024, 4, 4)):
        assert _rel(T.gemv(x, w, None, cfg), ref - b.float()) < 1e-2, cfg


def test_gemv_linear_cuda_graph():
    from infercore.models.gpu_layout import TritonGemvLinear, use_triton_gemv_
    from infercore.ops.linear import triton as T

    model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 14336, bias=False)).cuda().bfloat16()

    def ref_model(x):
        return F.linear(F.linear(x, model[0].weight.float(), model[0].bias.float()), model[1].weight.float())

    old = dict(T.TUNED)
    # Force the GEMV path (the table may not claim a win for these shapes) and a split-K config.
    T.TUNED[(4096, 4096, 1)] = (T.GemvConfig("fma", 2, 1024, 4, 2), 2.0)
    T.TUNED[(14336, 4096, 1)] = (T.GemvConfig("fma", 4, 512, 4, 1), 2.0)
    try:
        assert use_triton_gemv_(model, max_m=4) == 2
        assert all(isinstance(m, TritonGemvLinear) for m in model)
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        model(x)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = model(x)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        ref = ref_model(x.float())
        assert _rel(y, ref) < 1e-2
        # Above max_m it is F.linear again.
        xb = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
        assert _rel(model(xb), ref_model(xb.float())) < 1e-2
    finally:
        T.TUNED.clear()
        T.TUNED.update(old)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
def test_gate_up_act_epilogue_bf16(act, m):
    from infercore.ops.activation.naive import gelu_and_mul_ref, silu_and_mul_ref
    from infercore.ops.linear import skinny_linear
    from infercore.ops.linear import triton as T

    torch.manual_seed(0)
    n, k = 2 * 14336, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    h = F.linear(x.float(), w.float())
    approximate = "tanh" if act == "gelu_tanh" else "none"
    ref = silu_and_mul_ref(h) if act == "silu" else gelu_and_mul_ref(h, approximate=approximate)
    assert _rel(skinny_linear(x, w, act=act), ref) < 1e-2
    for cfg in (T.DEFAULT, T.DEFAULT_DOT, T.GemvConfig("fma", 8, 512, 4, 4), T.GemvConfig("dot", 64, 128, 4, 2)):
        assert _rel(T.gemv(x, w, None, cfg, act), ref) < 1e-2, cfg


def test_fused_mlp_cuda_graph():
    from infercore.models import ModelConfig, build_model
    from infercore.models.gpu_layout import use_triton_gemv_

    cfg = ModelConfig.from_hf(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=1024,
        intermediate_size=3584, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
    ))  # fmt: skip
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda", init="normal")
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    want = mlp(x).float()
    use_triton_gemv_(model, max_m=4, force=True)  # force: the table may not list these shapes
    assert type(mlp).__name__ == "GemvFusedLlamaMLP"
    mlp(x)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mlp(x)
    g.replay()
    torch.cuda.synchronize()
    assert _rel(y, want) < 1e-2
