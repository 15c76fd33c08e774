"""Triton gated activations against the reference, on the CPU under TRITON_INTERPRET=1."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401
from infercore.devices import implementation  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(4, 40), (2, 3, 2200)])  # 2200: d=1100 spans two column blocks
def test_silu_and_mul(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    got = implementation("silu_and_mul", "triton")(x)
    want = implementation("silu_and_mul", "reference")(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_and_mul(dtype, approximate):
    x = torch.randn(7, 96, dtype=dtype) * 3
    got = implementation("gelu_and_mul", "triton")(x, approximate=approximate)
    want = implementation("gelu_and_mul", "reference")(x, approximate=approximate)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_gelu_variants_differ():
    # Guards against the approximate flag being ignored: the two GELUs differ by ~1e-3 near |x| ~ 2.
    x = torch.full((1, 2), 2.0)
    tanh = implementation("gelu_and_mul", "triton")(x, approximate="tanh")
    exact = implementation("gelu_and_mul", "triton")(x, approximate="none")
    assert (tanh - exact).abs().item() > 1e-4
