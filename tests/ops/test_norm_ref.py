import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from infercore.ops import fused_add_rms_norm, rms_norm


def test_rms_norm_matches_hf_llama_fp32():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64)
    hf = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
        expected = hf(x)
    torch.testing.assert_close(rms_norm(x, hf.weight.detach(), eps=1e-5), expected, rtol=1e-6, atol=1e-6)


def test_rms_norm_offset_matches_hf_gemma3():
    torch.manual_seed(1)
    x = torch.randn(7, 32)
    hf = Gemma3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(32) * 0.1)
        expected = hf(x)
    y = rms_norm(x, hf.weight.detach(), eps=1e-6, offset=1.0)
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    # Without the offset the result differs: the test can tell the two conventions apart.
    assert not torch.allclose(rms_norm(x, hf.weight.detach(), eps=1e-6), expected, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_low_precision_computes_in_fp32(dtype):
    torch.manual_seed(2)
    x = (torch.randn(9, 48) * 30).to(dtype)
    w = torch.randn(48).to(dtype)
    y = rms_norm(x, w, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    xf = x.double()
    expected = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).to(dtype)
    # One rounding at the end: at most one ulp away from the exact result.
    torch.testing.assert_close(
        y.float(), expected.float(), rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=1e-3
    )


def test_fused_add_rms_norm_residual_in_activation_dtype():
    torch.manual_seed(3)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    res = torch.randn(4, 64, dtype=torch.bfloat16) * 100
    w = torch.randn(64, dtype=torch.bfloat16)
    x0, r0 = x.clone(), res.clone()
    y, new_res = fused_add_rms_norm(x, res, w, eps=1e-6, offset=0.5)
    assert new_res.dtype == torch.bfloat16
    assert torch.equal(new_res, x0 + r0)
    assert torch.equal(y, rms_norm(x0 + r0, w, eps=1e-6, offset=0.5))
    assert torch.equal(x, x0) and torch.equal(res, r0)  # inputs untouched


def test_rms_norm_errors_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match=r"rms_norm: weight must be a floating tensor, got torch.int64"):
        rms_norm(x, torch.ones(8, dtype=torch.int64), eps=1e-6)
    with pytest.raises(TypeError, match="rms_norm: x"):
        rms_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8), eps=1e-6)
    with pytest.raises(TypeError, match="rms_norm: x"):
        rms_norm(x.double(), torch.ones(8), eps=1e-6)
    with pytest.raises(ValueError, match="rms_norm: weight"):
        rms_norm(x, torch.ones(7), eps=1e-6)
    with pytest.raises(ValueError, match="rms_norm: weight"):
        rms_norm(x, torch.ones(1, 8), eps=1e-6)
    with pytest.raises(ValueError, match="rms_norm: eps"):
        rms_norm(x, torch.ones(8), eps=-1.0)
    with pytest.raises(TypeError, match="rms_norm: x must be a torch.Tensor"):
        rms_norm([1.0], torch.ones(8), eps=1e-6)


def test_fused_add_rms_norm_errors_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="fused_add_rms_norm: residual"):
        fused_add_rms_norm(x, torch.randn(3, 8), torch.ones(8), eps=1e-6)
    with pytest.raises(TypeError, match="fused_add_rms_norm: residual"):
        fused_add_rms_norm(x, torch.randn(2, 8, dtype=torch.float16), torch.ones(8), eps=1e-6)
    with pytest.raises(TypeError, match="fused_add_rms_norm: weight"):
        fused_add_rms_norm(x, x, torch.ones(8, dtype=torch.int32), eps=1e-6)
