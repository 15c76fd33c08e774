"""Triton skinny GEMV against the F.linear reference, on the CPU under TRITON_INTERPRET=1."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from llama_helpers import run_tiny_llama, tiny_llama  # noqa: E402
from torch import nn  # noqa: E402

import infercore.ops.linear as L  # noqa: E402
from infercore.devices import implementation, resolve  # noqa: E402
from infercore.models.gpu_layout import TritonGemvLinear, use_triton_gemv_  # noqa: E402
from infercore.ops.linear import triton as T  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _ref(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _rel(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


CONFIGS = [
    T.GemvConfig("fma", 4, 32, 1, 1),
    T.GemvConfig("fma", 8, 16, 1, 3, evict_first=False),  # split-K with a ragged last split
    T.GemvConfig("dot", 16, 32, 1, 1),
    T.GemvConfig("dot", 16, 16, 1, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.variant}-bn{c.block_n}-bk{c.block_k}-s{c.split_k}")
def test_gemv_configs(dtype, m, cfg):
    n, k = 37, 100  # neither a multiple of any block
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if m % 2 else None
    y = T.gemv(x, w, b, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, _ref(x, w, b)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (2, 3, 48), (5, 24)])
def test_op_matches_reference(dtype, shape):
    n = 40
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(n, shape[-1], dtype=dtype)
    b = torch.randn(n, dtype=dtype)
    got = implementation("skinny_linear", "triton")(x, w, b)
    want = implementation("skinny_linear", "reference")(x, w, b)
    assert got.shape == (*shape[:-1], n)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)


def test_non_contiguous_inputs():
    x = torch.randn(3, 128)[:, :64]  # row stride 128
    w = torch.randn(20, 64).T.contiguous().T  # column-major: copied to K-contiguous
    y = implementation("skinny_linear", "triton")(x, w, None)
    assert _rel(y, _ref(x, w, None)) < 1e-5


def test_public_op_dispatches_to_reference_on_cpu():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    torch.testing.assert_close(L.skinny_linear(x, w), x @ w.T)
    assert resolve("skinny_linear", "cpu").name != "triton"
    assert "triton" in implementations()


def implementations():
    from infercore.devices import implementations as impls

    return impls("skinny_linear")


@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((torch.randn(2, 16), torch.randn(8, 15)), ValueError, "weight"),
        ((torch.randn(2, 16), torch.randn(8, 16, 1)), ValueError, "weight"),
        ((torch.randn(2, 16), torch.randn(8, 16, dtype=torch.float16)), TypeError, "weight"),
        ((torch.randint(0, 3, (2, 16)), torch.randn(8, 16)), TypeError, "x"),
        ((torch.randn(2, 16), torch.randn(8, 16), torch.randn(7)), ValueError, "bias"),
        ((torch.randn(2, 16), torch.randn(8, 16), torch.randn(8, dtype=torch.float16)), TypeError, "bias"),
        (("x", torch.randn(8, 16)), TypeError, "x"),
        ((torch.randn(()), torch.randn(8, 16)), ValueError, "x"),
    ],
)
def test_bad_inputs(args, exc, words):
    with pytest.raises(exc, match=f"skinny_linear: {words}"):
        L.skinny_linear(*args)


def test_tuning_table_lookup():
    assert [T.m_bucket(m) for m in (1, 2, 3, 5, 9, 16, 40)] == [1, 2, 4, 8, 16, 16, 16]
    assert T.pick_config(123, 456, 1) == T.DEFAULT  # untuned shape
    assert not T.beats_cublas(123, 456, 1)
    for (n, k, m), (cfg, speedup) in T.TUNED.items():
        assert m in (1, 2, 4, 8, 16) and cfg.variant in ("fma", "dot") and speedup > 0
        assert T.pick_config(n, k, m) is cfg


def test_gpu_layout_swap_leaves_cpu_models_alone():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
    assert use_triton_gemv_(model, max_m=4) == 0
    assert all(type(m) is not TritonGemvLinear for m in model.modules())
    with pytest.raises(ValueError, match="max_m"):
        use_triton_gemv_(model, max_m=-1)
    with pytest.raises(TypeError, match="use_triton_gemv_: model"):
        use_triton_gemv_([nn.Linear(4, 4)])


def test_gemv_linear_falls_back_off_cuda():
    lin = nn.Linear(16, 8)
    x = torch.randn(3, 16)
    want = lin(x)
    lin.__class__ = TritonGemvLinear  # what use_triton_gemv_ does to CUDA modules
    torch.testing.assert_close(lin(x), want)
    assert isinstance(lin, nn.Linear) and set(lin.state_dict()) == {"weight", "bias"}


# ---------------------------------------------------------------- gated-MLP epilogue (act=...)

ACT_CONFIGS = [
    T.GemvConfig("fma", 4, 32, 1, 1),
    T.GemvConfig("fma", 2, 16, 1, 3, evict_first=False),  # split-K: the act runs in the reduce kernel
    T.GemvConfig("dot", 16, 32, 1, 1),
    T.GemvConfig("dot", 16, 16, 1, 2),
]
ACTS = ["silu", "gelu_tanh", "gelu"]


def _act_ref(x, w, b, act):
    # Float64 of the reference op (F.linear, then ops.activation's *_and_mul reference).
    return L.naive.skinny_linear_ref(x.double(), w.double(), None if b is None else b.double(), act=act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("cfg", ACT_CONFIGS, ids=lambda c: f"{c.variant}-bn{c.block_n}-bk{c.block_k}-s{c.split_k}")
def test_gemv_act_configs(dtype, m, cfg):
    d, k = 19, 50  # D odd (a ragged last program), K not a multiple of any block
    act = ACTS[m % 3]
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(2 * d, k, dtype=dtype) * 0.3
    b = torch.randn(2 * d, dtype=dtype) if m % 2 else None
    y = T.gemv(x, w, b, cfg, act)
    assert y.shape == (m, d) and y.dtype == dtype
    assert _rel(y, _act_ref(x, w, b, act)) < TOL[dtype] * 2


@pytest.mark.parametrize("act", ACTS)
def test_gemv_act_matches_unfused_path(act):
    # Against what the models do without the fusion: the linear, then the *_and_mul kernel (fp16
    # rounding of g and u included), so both paths agree to about one fp16 rounding.
    from infercore.ops.activation import triton as A

    x = torch.randn(3, 40, dtype=torch.float16)
    w = torch.randn(2 * 24, 40, dtype=torch.float16) * 0.3
    fused = implementation("skinny_linear", "triton")(x, w, None, act=act)
    h = T.skinny_linear(x, w)
    approximate = "tanh" if act == "gelu_tanh" else "none"
    unfused = A.silu_and_mul(h) if act == "silu" else A.gelu_and_mul(h, approximate=approximate)
    torch.testing.assert_close(fused, unfused, atol=2e-3, rtol=2e-3)
    assert not torch.equal(fused, T.skinny_linear(x, w)[:, :24])  # the activation did run


@pytest.mark.parametrize("act", [None, "silu", "gelu"])
def test_gemv_empty_dims(act):
    # K = 0: nothing to stream, y = act(bias) (or act(0)); M = 0: an empty result.
    cfg = T.GemvConfig("fma", 4, 32, 1, 1)
    b = torch.randn(6)
    for bias in (None, b):
        y = T.gemv(torch.randn(3, 0), torch.randn(6, 0), bias, cfg, act)
        want = (torch.zeros(3, 6) if bias is None else b.expand(3, 6)).double()
        if act is not None:
            want = L.naive.skinny_linear_ref(want, torch.eye(6, dtype=torch.float64), None, act=act)
        assert y.shape == (3, 6 if act is None else 3) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), want)
    assert T.gemv(torch.randn(0, 8), torch.randn(6, 8), b, cfg, act).shape == (0, 6 if act is None else 3)


def test_gemv_act_rejects_odd_block_n():
    with pytest.raises(ValueError, match="block_n"):
        T.gemv(torch.randn(1, 8), torch.randn(6, 8), None, T.GemvConfig("fma", 3, 8, 1, 1), "silu")


def test_public_op_act_reference_and_checks():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    h = x @ w.T
    torch.testing.assert_close(L.skinny_linear(x, w, act="silu"), torch.nn.functional.silu(h[:, :4]) * h[:, 4:])
    with pytest.raises(ValueError, match="skinny_linear: act"):
        L.skinny_linear(x, w, act="relu")
    with pytest.raises(ValueError, match="even N"):
        L.skinny_linear(x, torch.randn(7, 16), act="silu")


def test_act_tuning_lookup():
    old = dict(T.TUNED_ACT)
    try:
        T.TUNED_ACT.clear()
        n, k = 28672, 4096
        base = T.TUNED.get((n, k, 1))
        assert T.pick_config(n, k, 1, "silu").block_n % 2 == 0
        assert T.pick_config(4096, 4096, 1, "silu").block_n == 2  # TUNED has block_n=1 there
        assert T.beats_cublas(n, k, 1, "silu") == (base is not None and base[1] > 1.0)
        cfg = T.GemvConfig("fma", 8, 512, 4, 1)
        T.TUNED_ACT[(n, k, 1)] = (cfg, 0.9)
        assert T.pick_config(n, k, 1, "silu") is cfg and not T.beats_cublas(n, k, 1, "silu")
        assert T.pick_config(n, k, 1) is not cfg  # the plain GEMV keeps its own table
    finally:
        T.TUNED_ACT.clear()
        T.TUNED_ACT.update(old)


# ---------------------------------------------------------------- the model-level swap


@pytest.mark.parametrize("hidden_act, mlp_bias", [("silu", False), ("gelu_pytorch_tanh", True)])
def test_use_triton_gemv_on_tiny_llama_keeps_logits(hidden_act, mlp_bias, monkeypatch):
    model = tiny_llama(hidden_act, mlp_bias)
    want = run_tiny_llama(model, [5, 17, 3, 40, 22], 2)
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    calls = []
    real = T.skinny_linear
    monkeypatch.setattr(T, "skinny_linear", lambda *a, **kw: calls.append(kw.get("act")) or real(*a, **kw))
    # force: convert CPU modules and take the GEMV (Triton interpreter) whatever the tuning table says
    assert use_triton_gemv_(model, max_m=8, force=True) == 2 * 4 + 1  # qkv, o, gate_up, down; lm_head
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "GemvFusedLlamaMLP" and isinstance(mlp, type(model.model.layers[0].mlp))
    assert mlp.gemv_act == ("silu" if hidden_act == "silu" else "gelu_tanh")
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params  # no copies
    got = run_tiny_llama(model, [5, 17, 3, 40, 22], 2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # per forward: 2 layers x (qkv, o, fused gate_up+act, down) + lm_head, for 3 forwards
    assert calls.count(mlp.gemv_act) == 3 * 2 and calls.count(None) == 3 * (2 * 3 + 1)
    calls.clear()
    run_tiny_llama(model, list(range(1, 10)), 0)  # 9 rows > max_m: every module takes its original forward
    assert calls == []


def test_use_triton_gemv_fusion_off_and_fallbacks():
    model = tiny_llama()
    assert use_triton_gemv_(model, max_m=4, fuse_act=False, force=True) == 9
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert use_triton_gemv_(model, max_m=4, force=True) == 0  # already converted; adds the fusion
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "GemvFusedLlamaMLP"
    x = torch.randn(2, 32)
    want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_up_proj(x)[:, :40]) * mlp.gate_up_proj(x)[:, 40:])
    torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)

    class OtherLinear(nn.Linear):  # e.g. a quantized linear swapped in after use_triton_gemv_
        def forward(self, x):
            return super().forward(x) * 0.0

    mlp.gate_up_proj.__class__ = OtherLinear
    torch.testing.assert_close(mlp(x), mlp.down_proj(torch.zeros(2, 40)))  # the original forward ran
    # without force nothing happens on the CPU
    fresh = tiny_llama()
    assert use_triton_gemv_(fresh) == 0 and type(fresh.model.layers[0].mlp).__name__ == "LlamaMLP"


@pytest.mark.parametrize("scheme", ["w4a16-g128", "fp8-wo", "w8a8"])
def test_use_triton_gemv_swaps_quantized_gated_mlp(scheme):
    """A gated MLP whose gate_up is weight-only quantized joins the fused class (its CUDA GEMV
    carries the activation); W8A8 does not. On the CPU the fused class runs the unfused path, with
    the same output."""
    from infercore.models import ModelConfig
    from infercore.models.llama import LlamaMLP
    from infercore.quant import quantize

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 256, "intermediate_size": 384,
                               "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8,
                               "vocab_size": 128})
    mlp = LlamaMLP(cfg, dtype=torch.float32)
    quantize(mlp, scheme)
    x = torch.randn(2, 256)
    want = mlp(x)
    use_triton_gemv_(mlp, force=True)
    assert type(mlp).__name__.startswith("GemvFused") == (scheme != "w8a8")
    assert torch.allclose(mlp(x), want)


@pytest.mark.parametrize("cfg", [T.GemvConfig("fma", 4, 32, 1, 1), T.GemvConfig("fma", 8, 16, 1, 3),
                                 T.GemvConfig("fma", 4, 128, 1, 1), T.GemvConfig("fma", 4, 32, 1, 4)],
                         ids=lambda c: f"bn{c.block_n}-bk{c.block_k}-s{c.split_k}")
@pytest.mark.parametrize("tiles", [1, 2])
def test_gemv_first_tiles_read_before_the_pdl_wait(cfg, tiles, monkeypatch):
    """With PDL, the fma GEMV loads its first 1 or 2 weight tiles before waiting for the previous
    kernel (PREWAIT) and consumes them ahead of the K loop; the interpreter has no PDL, so force the
    variant: same results with one or several tiles per split, split-K, ragged K, bias and the fused
    activation."""
    monkeypatch.setattr(T, "pdl_enabled", lambda t: True)
    monkeypatch.setattr(T, "pdl_launch", lambda use: {})
    monkeypatch.setattr(T, "GEMV_PREWAIT", tiles)
    torch.manual_seed(5)
    for m, k in ((1, 100), (3, 100), (2, 128)):  # K = 128: whole tiles (EVEN), one or more per split
        x = torch.randn(m, k)
        w = torch.randn(38, k)
        b = torch.randn(38)
        assert _rel(T.gemv(x, w, b, cfg), _ref(x, w, b)) < 1e-5
        if cfg.block_n % 2 == 0:
            assert _rel(T.gemv(x, w, b, cfg, "silu"), _act_ref(x, w, b, "silu")) < 2e-5
