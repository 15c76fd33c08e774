"""Triton skinny GEMV against the F.linear reference, on the CPU under TRITON_INTERPRET=1."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
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


def test_gemv_linear_falls_back_off_cuda():
    lin = nn.Linear(16, 8)
    x = torch.randn(3, 16)
    want = lin(x)
    lin.__class__ = TritonGemvLinear  # what use_triton_gemv_ does to CUDA modules
    torch.testing.assert_close(lin(x), want)
    assert isinstance(lin, nn.Linear) and set(lin.state_dict()) == {"weight", "bias"}
