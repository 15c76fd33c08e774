"""Triton RMSNorm kernels against the reference, on the CPU under TRITON_INTERPRET=1."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import infercore.ops  # noqa: E402,F401  (registers the references)
from infercore.devices import implementation, resolve  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 48), (2, 3, 100)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(dtype, shape, offset):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    got = implementation("rms_norm", "triton")(x, w, eps=1e-6, offset=offset)
    want = implementation("rms_norm", "reference")(x, w, eps=1e-6, offset=offset)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_add_rms_norm(dtype):
    x = torch.randn(5, 72, dtype=dtype)
    res = torch.randn(5, 72, dtype=dtype)
    w = torch.rand(72) + 0.5  # fp32 weight with fp16 activations is allowed
    x_copy, res_copy = x.clone(), res.clone()
    y, new_res = implementation("fused_add_rms_norm", "triton")(x, res, w, eps=1e-5, offset=1.0)
    y_ref, res_ref = implementation("fused_add_rms_norm", "reference")(x, res, w, eps=1e-5, offset=1.0)
    torch.testing.assert_close(new_res, res_ref, atol=0, rtol=0)  # same rounding of the sum
    torch.testing.assert_close(y, y_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(x, x_copy) and torch.equal(res, res_copy), "inputs must not be modified"


def test_non_contiguous_rows():
    x = torch.randn(6, 128)[:, :64]  # row stride 128, last dim contiguous
    w = torch.randn(64)
    got = implementation("rms_norm", "triton")(x, w, eps=1e-6)
    torch.testing.assert_close(got, implementation("rms_norm", "reference")(x, w, eps=1e-6))


def test_registered_for_cuda_only():
    # On the CPU the Triton kernel never serves (there it is the interpreter, for tests only).
    assert resolve("rms_norm", "cpu").name != "triton"
    assert "triton" in infercore.devices.implementations("fused_add_rms_norm")
